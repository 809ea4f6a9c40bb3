"""What a forward-only engine (ZeRO-Inference) holds instead of a gradient reducer and an optimizer.

`zerotrain.initialize(model=..., config=...)` with no optimizer passed and no `optimizer` block in the
config builds an engine that only runs the model forward, as DeepSpeed does (its ZeRO-Inference): every
parameter is frozen (at stage 3 partitioned, optionally offloaded with `offload_param`), and nothing of
training is allocated: no gradient buffers, no fp32 masters, no optimizer state. The engine keeps one
object of each declared interface (`zero.interfaces`), so its code paths stay the same: `NoGradients`
and `NoOptimizer` below hold nothing and refuse to train with `NoOptimizerError`.

`ForwardPasses` brackets every forward of the root module, however it is called (`engine(...)` or
`engine.module.generate(...)`, which calls the module itself once per new token), as one fetcher
micro-step: the first forward records the order of stage-3 gathers, later ones follow it (prefetch), and
reads of NVMe-offloaded shards run ahead along it, wrapping from the end of one forward into the start of
the next (the next token's forward repeats the same order). It also counts the forwards (`count`): at
world > 1 every rank must run as many as the others, or their gathers stop matching.

A TRAINING engine's `engine.module.generate(...)` (evaluation between steps) is wrapped by
`generate_between_steps`: no_grad, eval mode, each forward a `ForwardPasses` bracket kept out of the
training record (`traced=False`), synced across ranks where forwards hold collectives.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .interfaces import GradientReducer, MasterOptimizer

__all__ = ["NoOptimizerError", "NoGradients", "NoOptimizer", "ForwardPasses", "no_optimizer_message",
           "generate_between_steps", "synced_generate"]


class NoOptimizerError(RuntimeError):
    """Training was asked of a forward-only engine (built without an optimizer)."""


def no_optimizer_message(call: str) -> str:
    return (f"{call}: this engine has no optimizer (none was passed to zerotrain.initialize and the config has "
            f"no 'optimizer' block), so it is forward-only (ZeRO-Inference): it runs engine(...) and "
            f"engine.module.generate(...) but cannot train; pass optimizer= or add an 'optimizer' block to train")


class NoGradients(GradientReducer):
    """The reducer of a forward-only engine: no buckets, no gradient buffers."""

    def __init__(self) -> None:
        self.grad_shards: list = []
        self.shard_ready_callbacks: list = []
        self.optimizer_steps = 0
        self.stats: dict = {}

    def begin_backward(self, boundary: bool) -> None:
        raise NoOptimizerError(no_optimizer_message("engine.backward()"))

    def end_backward(self) -> None:
        """Nothing launched."""

    def zero(self) -> None:
        """No gradients to drop."""

    def after_optimizer_step(self, overflow: bool, scale_before: float, scale_after: float) -> None:
        raise NoOptimizerError(no_optimizer_message("engine.step()"))

    def held_bytes(self) -> int:
        return 0


class NoOptimizer(MasterOptimizer):
    """The master optimizer of a forward-only engine: no masters, no states; stepping is an error."""

    snapshot_in_background = False

    def __init__(self) -> None:
        self.buckets: list = []
        self.masters: list = []
        self.optimizer = None
        self.last_grad_norm: Optional[float] = None
        self.stats: dict = {}

    def refuse_training(self, call: str, hint: str = "") -> None:
        raise NoOptimizerError(no_optimizer_message(call) + hint)

    def has_overflow(self, grad_shards: list) -> bool:
        raise NoOptimizerError(no_optimizer_message("engine.step()"))

    def step(self, grad_shards: list, loss_scale: float) -> None:
        raise NoOptimizerError(no_optimizer_message("engine.step()"))

    def publish(self, current=()) -> None:
        """No masters to publish: a load writes the (frozen) weights themselves."""

    def state_bytes(self) -> int:
        return 0


class ForwardPasses:
    """Root-module hooks of a forward-only engine: each forward of `module` is one fetcher micro-step.

    `fetcher` is the stage-3 `ParamFetcher` (None at stages 0-2: only the count is kept). Nested calls
    of the root module (a model calling itself) count once.
    """

    def __init__(self, module: torch.nn.Module, fetcher=None, traced: bool = True):
        self.fetcher = fetcher
        self.traced = traced  # False: forwards between a training engine's steps, kept out of its record
        self.count = 0  # forwards of the root module since the engine was built
        self.listener = None  # told where each forward begins and ends (a memory timeline); None: nobody
        self._depth = 0
        if fetcher is not None and traced:
            fetcher.repeats = True  # the next forward follows the same record: reads ahead wrap to its start
        # prepend: before any hook on the root module itself (a root with its own parameters gathers there)
        self._handles = [module.register_forward_pre_hook(self._begin, prepend=True),
                         module.register_forward_hook(self._end, always_call=True)]

    def _begin(self, module, args) -> None:
        self._depth += 1
        if self._depth == 1:
            self.count += 1
            if self.listener is not None:
                self.listener.begin("forward")
            if self.fetcher is not None:
                self.fetcher.begin_micro_step() if self.traced else self.fetcher.begin_untraced()

    def _end(self, module, args, output) -> None:
        self._depth = max(self._depth - 1, 0)
        if self._depth == 0 and self.fetcher is not None and not self.traced:
            self.fetcher.end_untraced()
        elif self._depth == 0 and self.fetcher is not None:
            # no backward follows: close the record after the first forward, release every gathered shard
            self.fetcher.end_forward(backward_follows=False)
            self.fetcher.end_micro_step()
        if self._depth == 0 and self.listener is not None:
            self.listener.end("forward")

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def generate_between_steps(generate: Callable, module: torch.nn.Module, fetcher=None,
                           before_use: Callable[[], None] = lambda: None, synced: bool = False) -> Callable:
    """`generate` of a TRAINING engine's model, for evaluation between its steps (the HF Trainer's
    `predict_with_generate`, a user's own loop): under no_grad, in eval mode (the module's mode restored
    after), each forward of the model one bracket of its own at stage 3 (`fetcher`: gathered, then released
    whole, outside the training micro-steps' record, which it neither extends nor follows), so the training
    that resumes is the one it would have been without the call. `synced`: transformers' `synced_gpus=True`
    (a rank whose sequences have finished keeps running forwards until every rank has), needed where a
    forward holds collectives (stage-3 gathers, tensor / sequence / expert parallelism). `before_use`: what
    the engine undoes before its model is used (super_offload's speculative weights)."""
    import functools

    # generate runs the underlying Hugging Face model's forward (a PEFT wrapper's own forward is not called)
    target = module.get_base_model() if hasattr(module, "get_base_model") else module

    @functools.wraps(generate)
    def wrapper(*args, **kwargs):
        if synced:
            # even over an explicit False: loops written for DeepSpeed pass `is_deepspeed_zero3_enabled()` (False
            # here; the HF Seq2SeqTrainer does), and with collectives in every forward, unsynced ranks can only hang
            kwargs["synced_gpus"] = True
        before_use()
        was_training = module.training
        passes = ForwardPasses(target, fetcher, traced=False) if fetcher is not None else None
        module.eval()
        try:
            with torch.no_grad():
                return generate(*args, **kwargs)
        finally:
            if passes is not None:
                passes.remove()
            module.train(was_training)

    wrapper.zerotrain_synced = synced
    return wrapper


def synced_generate(generate: Callable) -> Callable:
    """`generate` with transformers' `synced_gpus=True` by default: a rank whose sequences have finished keeps
    running forwards (discarding them) until every rank has finished, so stage-3 gathers stay matched.

    transformers switches `synced_gpus` on by itself only under DeepSpeed ZeRO-3 or FSDP
    (`is_deepspeed_zero3_enabled()`), which it cannot know of zerotrain; a caller's explicit value wins."""
    import functools

    @functools.wraps(generate)
    def wrapper(*args, **kwargs):
        if kwargs.get("synced_gpus") is None:
            kwargs["synced_gpus"] = True
        return generate(*args, **kwargs)

    wrapper.zerotrain_synced = True
    return wrapper
