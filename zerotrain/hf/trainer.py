"""`zerotrain.hf.Trainer` / `TrainingArguments`: the Hugging Face Trainer on zerotrain's engine.

A script written for `transformers.Trainer` + DeepSpeed changes its two imports and nothing else:

    from zerotrain.hf import Trainer, TrainingArguments
    args = TrainingArguments(output_dir="out", deepspeed="ds_config.json", ...)   # or no deepspeed: ZeRO-3
    Trainer(model=model, args=args, train_dataset=ds).train()

The Trainer's loop, data loading, logging, callbacks, evaluation and checkpoint rotation are transformers'
own; only its seams are overridden (as optimum-habana's GaudiTrainer does for HPUs):

- `TrainingArguments.__post_init__` takes the `deepspeed` config out before transformers sees it (it would
  build `HfTrainerDeepSpeedConfig` and switch accelerate into its DeepSpeed mode), fills its "auto" values
  from the arguments (`zerotrain.config.hf_arguments`, transformers' rules) and keeps it as
  `zerotrain_config`; `deepspeed` keeps the value given.
- `_wrap_model` builds the engine (`zerotrain.initialize`) from that config, with the Trainer's optimizer
  and scheduler where the config has none (the Trainer's scheduler steps after each applied step, so
  the learning rates applied and logged are DeepSpeed's integration's); the accelerator's `backward` runs `engine.backward` and, at the accumulation boundary,
  `engine.step()` (clipping, optimizer, scheduler); `_clip_grad_norm` reports the engine's norm.
- `save_model` writes the full weights gathered from the shards (`from_pretrained` loads them);
  `_save_optimizer_and_scheduler` / `_load_optimizer_and_scheduler` write and read zerotrain's checkpoint
  in the `checkpoint-N` directory (it loads at any world size); `_load_best_model` reads its weights.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
from typing import Any, Callable, Optional, Union

import torch
import transformers
from accelerate import Accelerator
from transformers.trainer import SCHEDULER_NAME
from transformers.training_args import _convert_str_dict

import zerotrain
from zerotrain.pretrained import install_transformers_zero3_branches
from zerotrain.training_engine import TrainingEngine  # what this module calls on the engine (one Protocol)
from zerotrain.zero import GatheredParameters
from zerotrain.zero.stage3.partition import ZeroParameter
from zerotrain.config import ConfigError, read_config_file
from zerotrain.config.hf_arguments import (arguments_of, auto_values, config_from_arguments, fill_auto,
                                           with_mixed_precision)

__all__ = ["Trainer", "TrainingArguments", "ZeroTrainArguments", "ZeroTrainMixin"]

# Trainer features zerotrain's engine does not take over, refused by their argument name (name -> why).
_REFUSED = {
    "torch_compile": "torch.compile of the model is not supported with zerotrain's engine (its stage-3 hooks and "
                     "fetcher run eagerly)",
    "fsdp": "FSDP is another sharding engine; zerotrain shards the model itself",
    "auto_find_batch_size": "the engine is built once for the batch size of the config",
}


# resize_token_embeddings right on the partitioned models trained here (a model built under zero.Init)
install_transformers_zero3_branches()


def _read(config: Union[str, os.PathLike, dict]) -> dict:
    if isinstance(config, dict):
        return copy.deepcopy(config)
    return read_config_file(config)


@contextlib.contextmanager
def _without_deepspeed_environment() -> Any:
    """accelerate (and transformers after it) switch to DeepSpeed when ACCELERATE_USE_DEEPSPEED is set (by
    `accelerate launch --use_deepspeed`, or left by an earlier DeepSpeed run in the process): not here."""
    saved = os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = saved


class ZeroTrainArguments:
    """The zerotrain part of a TrainingArguments subclass (transformers', TRL's configs): put it first.

    `deepspeed` (a path or a dict) is zerotrain's config, never DeepSpeed's: `__post_init__` takes it out
    before transformers sees it and keeps it as `zerotrain_config`, with the "auto" values transformers
    fills at this point (batch sizes, clipping, optimizer, precision) filled; the model's and the run's
    ("auto" bucket sizes, the scheduler's steps) are filled when the engine is built. A value that
    disagrees with an argument is a `ConfigError` naming both, as transformers refuses it. Without
    `deepspeed`, the arguments alone give ZeRO-3. `deepspeed` keeps the value given; `deepspeed_plugin`
    stays None (accelerate is never in its DeepSpeed mode).

    The mixin declares no annotations: `HfArgumentParser` (and TRL's parser) read the fields' types with
    `get_type_hints`, where the first class in the MRO wins, so an annotation here would replace transformers'
    `deepspeed: dict | str | None` and `--deepspeed ds.json` would be rejected.
    """

    def __post_init__(self) -> None:
        given = self.deepspeed
        if isinstance(given, str) and given.startswith("{"):
            # a JSON object on the command line (`--deepspeed '{"zero_optimization": ...}'`): a dict, as
            # transformers' __post_init__ makes it (its string values typed by transformers' own rule)
            given = _convert_str_dict(json.loads(given))
        self.deepspeed = None  # transformers would build HfTrainerDeepSpeedConfig and switch accelerate to DeepSpeed
        try:
            with _without_deepspeed_environment():
                super().__post_init__()
                _ = self.world_size  # the distributed state is built now, while transformers sees no DeepSpeed config
        finally:
            self.deepspeed = given  # the value the user gave, as transformers keeps it
        self.zerotrain_config: Optional[dict] = None
        if given:
            arguments = arguments_of(self)
            filled = fill_auto(_read(given), auto_values(arguments, world_size=self.world_size))
            self.zerotrain_config = with_mixed_precision(filled, arguments)  # as accelerate completes DeepSpeed's


class TrainingArguments(ZeroTrainArguments, transformers.TrainingArguments):
    """transformers' TrainingArguments with `deepspeed=` as zerotrain's config (`ZeroTrainArguments`)."""


def _hidden_size(model: torch.nn.Module) -> Optional[int]:
    """The model's hidden size as transformers reads it for the "auto" bucket sizes (largest of `hidden_sizes`)."""
    config = getattr(model, "config", None)
    for candidate in (config, getattr(config, "text_config", None)):
        if candidate is None:
            continue
        if getattr(candidate, "hidden_size", None) is not None:
            return int(candidate.hidden_size)
        if getattr(candidate, "hidden_sizes", None):
            return int(max(candidate.hidden_sizes))
    return None


class _Delegate:
    """An object that answers like the one it holds, except for the methods its subclass defines."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)


class _EngineOptimizer(_Delegate):
    """The Trainer's view of the engine's optimizer: `step`/`zero_grad` are the engine's (in backward), as
    accelerate's DeepSpeedOptimizerWrapper makes them no-ops."""

    def step(self, closure: Optional[Callable] = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


class _EngineScheduler(_Delegate):
    """The Trainer's view of the scheduler the engine steps (after each applied optimizer step)."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None


class _EngineAccelerator(Accelerator):
    """accelerate's Accelerator with the engine's backward: backward + step at the boundary, its gradient norm,
    and whether its last step was skipped. The Trainer's own accelerator object becomes one (below)."""

    engine: Optional[TrainingEngine] = None

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        engine = self.engine
        if engine is None:
            return super().backward(loss, **kwargs)
        engine.set_gradient_accumulation_boundary(self.sync_gradients)
        # The Trainer has already divided the loss for accumulation (or normalized it over the accumulated
        # tokens): engine.backward must not divide it again (DeepSpeed's `scale_wrt_gas=False`).
        engine.backward(loss, scale_wrt_gas=False)
        if self.sync_gradients:
            engine.step()
        return None

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        if self.engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        return self.engine.get_global_grad_norm()  # the engine clipped by the config's gradient_clipping

    @property
    def optimizer_step_was_skipped(self) -> bool:
        if self.engine is None:
            return Accelerator.optimizer_step_was_skipped.fget(self)
        return not self.engine.was_step_applied()

    def no_sync(self, model: Any) -> Any:
        if self.engine is not None and model is self.engine:
            # as under DeepSpeed: the engine reduces by its accumulation boundary, set in backward
            return contextlib.nullcontext()
        return super().no_sync(model)

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        if self.engine is not None and model is self.engine:
            model = self.engine.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)


class ZeroTrainMixin:
    """The zerotrain seams of a transformers Trainer (or any subclass: TRL's trainers): put it first.

    `class MyTrainer(ZeroTrainMixin, SomeTrainer)` trains `SomeTrainer`'s loop on zerotrain's engine.
    """

    _zt_engine: Optional[TrainingEngine] = None
    _zt_pretrained: Optional[str] = None

    # --- set-up ------------------------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        args = self.args
        if args.deepspeed_plugin is not None:
            raise ValueError("zerotrain.hf: these TrainingArguments switched accelerate into DeepSpeed mode "
                             "(transformers.TrainingArguments(deepspeed=...) or ACCELERATE_USE_DEEPSPEED); use "
                             "zerotrain.hf.TrainingArguments, which hands the config to zerotrain")
        for name, why in _REFUSED.items():
            if getattr(args, name, None):
                raise ValueError(f"{name}: not supported by zerotrain.hf.Trainer: {why}")
        with _without_deepspeed_environment():
            super().create_accelerator_and_postprocess()
        # The Trainer builds its Accelerator inside this method with no seam for the class; rather than copy the
        # method, the instance becomes the subclass that adds the engine's backward (nothing else changes).
        self.accelerator.__class__ = _EngineAccelerator
        # The engine owns the precision (the model in the training dtype, fp32 masters, its loss scaler), as
        # DeepSpeed does, for which accelerate neither autocasts nor builds a GradScaler: nor here (fp16 on a
        # GradScaler would also unscale the engine's gradients a second time).
        self.accelerator.native_amp = False
        self.accelerator.scaler = None
        if args.save_only_model and args.load_best_model_at_end:
            raise ValueError("save_only_model with load_best_model_at_end: the best model is read from the "
                             "checkpoint's engine state, which save_only_model leaves out (as with DeepSpeed)")

    def zerotrain_config(self, model: torch.nn.Module, num_training_steps: int) -> dict:
        """The engine's config: the arguments' `deepspeed` config with the rest of "auto" filled (the model's
        hidden size, the run's steps), or without one a ZeRO-3 config from the arguments alone."""
        args = self.args
        given = args.zerotrain_config if isinstance(args, ZeroTrainArguments) else None
        if given is None:
            return config_from_arguments(arguments_of(args), world_size=args.world_size, optimizer_and_scheduler=False)
        stage = (given.get("zero_optimization") or {}).get("stage", 0)
        values = auto_values(arguments_of(args), world_size=args.world_size, num_training_steps=num_training_steps,
                             hidden_size=_hidden_size(model), zero_stage=stage)
        filled = fill_auto(given, values)
        # accelerate supplies these from the Trainer when a DeepSpeed config leaves them out: so does this
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
            if key not in filled:
                filled[key] = values[key]
        return filled

    def _zt_build_engine(self, model: torch.nn.Module) -> TrainingEngine:
        num_training_steps = int(self.state.max_steps)
        config = self.zerotrain_config(model, num_training_steps)
        optimizer = None if "optimizer" in config else self.optimizer
        engine, engine_optimizer, _, engine_scheduler = zerotrain.initialize(model=model, config=config,
                                                                             optimizer=optimizer)
        self._zt_engine = engine
        if self._zt_pretrained is not None:  # each rank reads its own shard ranges of the directory
            engine.load_checkpoint(self._zt_pretrained, load_module_only=True)
        self.accelerator.engine = engine
        self.optimizer = _EngineOptimizer(engine_optimizer)
        if engine_scheduler is not None:  # the config's `scheduler` block: the engine steps it
            self.lr_scheduler = _EngineScheduler(engine_scheduler)
        else:
            # The Trainer's scheduler on the engine's optimizer, stepped by the Trainer's loop after each applied
            # step: the learning rates logged and applied are those of DeepSpeed's integration, step for step.
            self.lr_scheduler = self.create_scheduler(num_training_steps=num_training_steps, optimizer=engine_optimizer)
        return engine

    def _move_model_to_device(self, model: torch.nn.Module, device: Any) -> Any:
        if any(isinstance(p, ZeroParameter) for p in model.parameters()):
            # built partitioned under zerotrain.zero.Init: the engine places it (as the Trainer leaves a DeepSpeed
            # model where it is); a partitioned parameter cannot be moved whole
            return None
        return super()._move_model_to_device(model, device)

    def zerotrain_load_pretrained(self, directory: Union[str, os.PathLike]) -> None:
        """Load a Hugging Face model directory's weights (safetensors, sharded or not) into the model when the
        engine is built, each rank reading only its own shard ranges: for a model built partitioned under
        `zerotrain.zero.Init` (too large to build whole), where `from_pretrained` cannot be used. Call before
        `train()`."""
        self._zt_pretrained = os.fspath(directory)

    def create_optimizer(self, model: Optional[torch.nn.Module] = None) -> Any:
        """The Trainer's optimizer, unless the config has an `optimizer` block (the engine builds that one)."""
        args = self.args
        given = args.zerotrain_config if isinstance(args, ZeroTrainArguments) else None
        if self._zt_engine is None and given is not None and "optimizer" in given:
            return self.optimizer
        return super().create_optimizer(model) if model is not None else super().create_optimizer()

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> Any:
        if self._zt_engine is not None:
            return self._zt_engine
        if not training:  # evaluation before any training: the model as it is
            return model
        return self._zt_build_engine(model)

    def zerotrain_gathered(self, params: Any) -> Any:
        """A context in which `params` are whole on every rank (partitioned ones gathered at ZeRO-3): for code
        that reads a parameter without calling its module, where transformers/TRL gather only under DeepSpeed."""
        engine = self._zt_engine
        if engine is None or engine.zero_optimization_stage() != 3:
            return contextlib.nullcontext()
        return GatheredParameters(list(params))

    # --- the step ----------------------------------------------------------------------------------------------
    def _clip_grad_norm(self, model: Any) -> Any:
        if self._zt_engine is None:
            return super()._clip_grad_norm(model)
        return self._zt_engine.get_global_grad_norm()

    # --- saving and loading ------------------------------------------------------------------------------------
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The full model, gathered from every rank's shards, as a Hugging Face directory (`from_pretrained`)."""
        engine = self._zt_engine
        if engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # collective; rank 0 holds it: the parameters in the training dtype, the persistent buffers in their own
        # (an fp32 buffer stays fp32 under bf16), as DeepSpeed's consolidated 16-bit state dict
        state_dict = engine.consolidated_16bit_state_dict()
        self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        return None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._zt_engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self._zt_engine.save_checkpoint(output_dir)  # weights, optimizer, counters: loads at any world size
        if not isinstance(self.lr_scheduler, _EngineScheduler) and self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # The weights come with the engine's checkpoint (_load_optimizer_and_scheduler), shard by shard.
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return None
        if self._zt_engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self._zt_engine.load_checkpoint(checkpoint)
        if not isinstance(self.lr_scheduler, _EngineScheduler):
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
        return None

    def _load_best_model(self) -> None:
        if self._zt_engine is None:
            return super()._load_best_model()
        self._zt_engine.load_checkpoint(self.state.best_model_checkpoint, load_module_only=True)
        return None


class Trainer(ZeroTrainMixin, transformers.Trainer):
    """transformers' Trainer, trained by zerotrain's engine (see the module docstring)."""

