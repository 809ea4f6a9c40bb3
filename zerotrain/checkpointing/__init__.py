"""Activation checkpointing with DeepSpeed's API (`deepspeed.checkpointing`), on torch's non-reentrant checkpoint.

    import zerotrain.checkpointing as checkpointing
    checkpointing.configure(topology, partition_activations=True)  # the engine does this from the config
    out = checkpointing.checkpoint(block, hidden)                    # in the model's forward

A checkpointed function keeps only its inputs for backward; its activations are recomputed by
running it again when backward reaches it. The recompute is `torch.utils.checkpoint.checkpoint`
with `use_reentrant=False` (it follows autograd's saved-tensor mechanism instead of replaying a
second graph, so `torch.autograd.grad`, keyword arguments and inputs that need no gradient work);
zerotrain adds, per DeepSpeed's `activation_checkpointing` block:

- `partition_activations` / `cpu_checkpointing` / `contiguous_memory_optimization` +
  `number_checkpoints`: how the inputs are kept (see `saved.py`);
- the named RNG states of `get_rng_tracker()` (`get_cuda_rng_tracker`) are snapshotted at the
  forward and restored for the recompute, besides the default generators torch restores, so dropout
  inside tensor-parallel regions (`with get_rng_tracker().fork():`) replays the same mask;
- `synchronize_checkpoint_boundary`: the accelerator is synchronized at each checkpoint's start and
  end, forward and recompute; `profile`: each forward and recompute is timed, logged, and summed
  into `stats()`.

Early stopping of the recompute is turned off: at ZeRO-3 every module whose forward hook gathered
parameters in the recompute must reach its post-hook, which releases them again.

Hugging Face models: `enable_hf_gradient_checkpointing(model)` routes `gradient_checkpointing_enable()`
through `checkpoint` here.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint

from ..comm import Comm
from .rng import (CudaRNGStatesTracker, RNGStatesTracker, get_cuda_rng_tracker, get_rng_tracker,
                  model_parallel_cuda_manual_seed, model_parallel_manual_seed)
from .saved import ContiguousArena, InputSaver
from .settings import Settings as _State, fresh_stats as _fresh_stats, settings as _state

__all__ = ["checkpoint", "configure", "is_configured", "reset", "stats", "enable_hf_gradient_checkpointing",
           "get_rng_tracker", "get_cuda_rng_tracker", "model_parallel_manual_seed", "model_parallel_cuda_manual_seed",
           "RNGStatesTracker", "CudaRNGStatesTracker", "partition_activations_in_checkpoint", "set_num_layers"]

logger = logging.getLogger("zerotrain")




def _tp_comm(mpu: Any) -> Optional[Comm]:
    """The tensor-parallel Comm from a Topology, a Comm, or a Megatron-style mpu object (None: no TP)."""
    if mpu is None:
        return None
    if isinstance(mpu, Comm):
        return mpu
    from ..topology import Topology
    if isinstance(mpu, Topology):
        if mpu.tp_size == 1:
            return None
        return Comm.tensor_parallel(mpu)
    for prefix in ("get_tensor_model_parallel_", "get_model_parallel_"):
        if hasattr(mpu, prefix + "group"):
            size = int(getattr(mpu, prefix + "world_size")())
            return Comm(getattr(mpu, prefix + "group")(), int(getattr(mpu, prefix + "rank")()), size) if size > 1 else None
    raise TypeError(f"checkpointing.configure: mpu_ must be a Topology, a Comm or an object with "
                    f"get_model_parallel_group/rank/world_size, not {type(mpu).__name__}")


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """Set how `checkpoint` keeps inputs (DeepSpeed's `deepspeed.checkpointing.configure`).

    `mpu_`: the tensor-parallel group (Topology, Comm, or a Megatron-style mpu). `deepspeed_config`:
    a config (dict, path, or ZeroTrainConfig) whose `activation_checkpointing` block is read first;
    the keyword arguments override it.
    """
    block = _config_block(deepspeed_config)
    state = _State()
    state.stats = _state.stats
    state.tp = _tp_comm(mpu_)
    if block is not None:
        state.partition, state.cpu = bool(block.partition_activations), bool(block.cpu_checkpointing)
        state.contiguous = bool(block.contiguous_memory_optimization)
        state.number_checkpoints = block.number_checkpoints
        state.synchronize, state.profile = bool(block.synchronize_checkpoint_boundary), bool(block.profile)
    for name, value in (("partition", partition_activations), ("contiguous", contiguous_checkpointing),
                        ("number_checkpoints", num_checkpoints), ("cpu", checkpoint_in_cpu),
                        ("synchronize", synchronize), ("profile", profile)):
        if value is not None:
            setattr(state, name, value)
    if state.contiguous and not state.partition:
        raise ValueError("activation_checkpointing.contiguous_memory_optimization needs partition_activations: true")
    # Without number_checkpoints the contiguous buffer is sized later (set_num_layers, or configure's
    # num_checkpoints, as Megatron passes it); DeepSpeed accepts such a config too and checks only on use.
    if state.contiguous and state.number_checkpoints:
        state.arena = ContiguousArena(int(state.number_checkpoints))
    state.configured = True
    _state.__dict__.update(state.__dict__)
    logger.info("activation checkpointing: partition_activations=%s cpu_checkpointing=%s contiguous=%s "
                "(number_checkpoints=%s) synchronize=%s profile=%s tp=%d", state.partition, state.cpu,
                state.contiguous, state.number_checkpoints, state.synchronize, state.profile,
                state.tp.size if state.tp is not None else 1)


def _config_block(config: Any):
    """The `activation_checkpointing` block of a config given as ZeroTrainConfig, dict or path (None: none)."""
    if config is None:
        return None
    from ..config import ZeroTrainConfig, load_config
    if not isinstance(config, ZeroTrainConfig):
        config = load_config(config)
    return config.activation_checkpointing


def is_configured() -> bool:
    """True once `configure` was called (DeepSpeed's `is_configured`)."""
    return _state.configured


def reset() -> None:
    """Forget the contiguous buffers and counters of the last iterations (DeepSpeed calls it between
    iterations); the configuration stays."""
    if _state.arena is not None:
        _state.arena.reset()
    _state.stats = _fresh_stats()


def stats() -> dict:
    """Counters: forwards / recomputes (and their seconds when `profile`), bytes of checkpoint inputs
    seen by the partition/cpu saver (`input_bytes`) and what it kept on the device and in host memory."""
    return dict(_state.stats)


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """DeepSpeed's setter for `partition_activations`."""
    _state.partition = bool(partition_activation)


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's setter for `number_checkpoints`."""
    _state.number_checkpoints = int(nlayers)
    if _state.contiguous:
        _state.arena = ContiguousArena(int(nlayers))


def _synchronize(args: tuple) -> None:
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if device is not None and device.type != "cpu":
        torch.get_device_module(device.type).synchronize()


@contextlib.contextmanager
def _timed(kind: str, args: tuple):
    """The synchronize/profile bracket around one forward or recompute of a checkpoint."""
    state = _state
    if state.synchronize or state.profile:
        _synchronize(args)
    start = time.perf_counter()
    try:
        yield
    finally:
        if state.synchronize or state.profile:
            _synchronize(args)
        state.stats[kind + "s"] += 1
        if state.profile:
            seconds = time.perf_counter() - start
            state.stats[kind + "_seconds"] += seconds
            logger.info("activation checkpoint %s: %.3f ms", kind, seconds * 1e3)


def _context_fn(args: tuple) -> Callable[[], tuple]:
    """torch's `context_fn`: the forward snapshots the tracked RNG states, the recompute replays them."""
    def make() -> tuple:
        snapshot: dict = {}

        @contextlib.contextmanager
        def forward():
            snapshot.update(get_rng_tracker().get_states())
            with _timed("forward", args):
                yield

        @contextlib.contextmanager
        def recompute():
            tracker = get_rng_tracker()
            current = tracker.get_states()
            tracker.set_states(snapshot)
            try:
                with _timed("recompute", args):
                    yield
            finally:
                tracker.set_states(current)
        return forward(), recompute()
    return make


def checkpoint(function: Callable, *args, **kwargs):
    """Run `function(*args, **kwargs)` keeping only its inputs for backward; recompute it in backward.

    DeepSpeed's `deepspeed.checkpointing.checkpoint`, with non-reentrant semantics (see module docstring).
    Keyword arguments `use_reentrant`, `preserve_rng_state` and `determinism_check` of torch's checkpoint
    are accepted (Hugging Face passes them); `use_reentrant=True` is refused: its recompute is a second
    autograd graph that ZeRO-3's saved-tensor hooks and the input saver here do not see.
    """
    if kwargs.pop("use_reentrant", False):
        raise ValueError("zerotrain.checkpointing.checkpoint: use_reentrant=True is not supported; "
                         "it runs with use_reentrant=False semantics")
    options = {key: kwargs.pop(key) for key in ("preserve_rng_state", "determinism_check", "debug") if key in kwargs}
    kwargs.pop("early_stop", None)  # always off (see module docstring)
    if kwargs.pop("context_fn", None) is not None:
        raise ValueError("zerotrain.checkpointing.checkpoint: context_fn is not supported (zerotrain's own "
                         "context_fn replays the RNG tracker and the checkpoint boundary options)")
    saver = None
    if _state.contiguous and _state.arena is None:
        raise ValueError("activation_checkpointing.contiguous_memory_optimization needs number_checkpoints (how "
                         "many checkpoints one forward keeps): set it in the config, or call "
                         "checkpointing.configure(num_checkpoints=N) or checkpointing.set_num_layers(N)")
    if _state.partition or _state.cpu:
        saver = InputSaver(_state.tp, _state.partition, _state.cpu, _state.arena, _state.stats)
    with saver.hooks() if saver is not None else contextlib.nullcontext():
        # Entered around torch's checkpoint, the saver sees only the inputs torch saves before
        # installing its own hooks for the function's body (see saved.py).
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=_context_fn(args),
                                           early_stop=False, **options, **kwargs)


def enable_hf_gradient_checkpointing(model: torch.nn.Module, **checkpoint_kwargs) -> torch.nn.Module:
    """Turn on a Hugging Face model's gradient checkpointing with zerotrain's `checkpoint` as the function.

    transformers' `gradient_checkpointing_enable` installs `functools.partial(torch checkpoint, **kwargs)`
    on every `GradientCheckpointingLayer`; here the layers get `checkpoint` above instead (non-reentrant,
    ZeRO-3 gathers again in the recompute and releases after it, partition/cpu as configured).
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    checkpoint_kwargs.setdefault("use_reentrant", False)
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5.x name
    if enable is not None:
        enable(activation_checkpointing_kwargs=dict(checkpoint_kwargs))
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(checkpoint_kwargs))
    function = functools.partial(checkpoint, **checkpoint_kwargs)
    replaced = 0
    for module in model.modules():
        if hasattr(module, "gradient_checkpointing"):  # transformers sets the function on exactly these
            module._gradient_checkpointing_func = function
            replaced += bool(module.gradient_checkpointing)
    if replaced == 0:
        raise RuntimeError(f"{type(model).__name__}: gradient checkpointing turned on no layer")
    return model
