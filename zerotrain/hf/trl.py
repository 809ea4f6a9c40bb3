"""`zerotrain.hf.SFTTrainer` / `SFTConfig`: TRL's SFT trainer on zerotrain's engine (needs `trl`).

TRL's trainers derive from its own `_BaseTrainer` (a transformers Trainer), so the zerotrain part is the
same mixin as `zerotrain.hf.Trainer`'s, put first; the config is TRL's `SFTConfig` with `deepspeed=` as
zerotrain's config, all of its fields unchanged (packing incl. `bfd` / padding-free, completion-only
loss, chat templates). Any other TRL trainer without a reference model is built the same way:

    class MyTrainer(ZeroTrainMixin, trl.SomeTrainer): ...
    class MyConfig(ZeroTrainArguments, trl.SomeConfig): ...

`args.deepspeed_plugin` stays None, and that is the answer SFT's DeepSpeed fixups need: at ZeRO-3 with a
PEFT model TRL keeps LoRA adapters in the base dtype and forces reentrant activation checkpointing to
work around DeepSpeed bugs (deepspeedai/DeepSpeed#8072, #8130); zerotrain's engine casts every trainable
parameter to the training dtype (fp32 masters kept apart) and runs either checkpointing, so neither
fixup applies.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import trl
from transformers import TrainerCallback
from trl.trainer.callbacks import SyncRefModelCallback

import zerotrain
from zerotrain.zero import GatheredParameters

from .trainer import ZeroTrainArguments, ZeroTrainMixin

__all__ = ["SFTTrainer", "SFTConfig", "DPOTrainer", "DPOConfig", "RewardTrainer", "RewardConfig", "GRPOTrainer",
           "GRPOConfig"]


class SFTConfig(ZeroTrainArguments, trl.SFTConfig):
    """TRL's SFTConfig with `deepspeed=` as zerotrain's config."""


class SFTTrainer(ZeroTrainMixin, trl.SFTTrainer):
    """TRL's SFTTrainer, trained by zerotrain's engine."""

    def compute_loss(self, model: Any, inputs: dict, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        # TRL's fused LM head reads `lm_head.weight` directly, never calling the lm_head module, and gathers it
        # only under DeepSpeed's ZeRO-3 (`maybe_gather_lm_head_ctx`); under zerotrain's ZeRO-3 it is gathered
        # here for the forward (the reference autograd saves gathers it again for the backward).
        with self.zerotrain_gathered(self.model.get_output_embeddings().parameters()):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)


class DPOConfig(ZeroTrainArguments, trl.DPOConfig):
    """TRL's DPOConfig with `deepspeed=` as zerotrain's config."""


def reference_config(config: dict) -> dict:
    """The reference model's engine config from the training one: forward-only (no optimizer, scheduler or
    optimizer offload), partitioned at ZeRO-3, as TRL's `prepare_deepspeed` holds a ZeRO-3 reference."""
    out = copy.deepcopy(config)
    for key in ("optimizer", "scheduler"):
        out.pop(key, None)
    zero = dict(out.get("zero_optimization") or {})
    zero.pop("offload_optimizer", None)
    zero["stage"] = 3
    out["zero_optimization"] = zero
    return out


class _ReferenceEngine:
    """The reference model of a TRL trainer (`self.ref_model`: given, or loaded by TRL) on a forward-only ZeRO-3
    engine built with the training engine: partitioned over the ranks, no gradients or optimizer state. Put it
    before `ZeroTrainMixin`."""

    _zt_reference: Any = None

    def _zt_build_engine(self, model: torch.nn.Module) -> Any:
        engine = super()._zt_build_engine(model)
        reference = self.ref_model
        if reference is not None and self._zt_reference is None:
            config = reference_config(self.zerotrain_config(model, int(self.state.max_steps)))
            self._zt_reference, *_ = zerotrain.initialize(model=reference, config=config)
            self._zt_reference.eval()
            self.ref_model = self._zt_reference
        return engine

    def _zt_heads_gathered(self) -> contextlib.ExitStack:
        """A context in which the policy's output head (at ZeRO-3) and the reference's (always ZeRO-3) are whole:
        TRL's fused LM head reads `lm_head.weight` without calling the module (gathered by TRL under DeepSpeed's
        ZeRO-3 only)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.zerotrain_gathered(self.model.get_output_embeddings().parameters()))
        if self._zt_reference is not None:
            head = self._zt_reference.module.get_output_embeddings().parameters()
            stack.enter_context(GatheredParameters(list(head)))
        return stack


class _SyncReference(TrainerCallback):
    """TRL's `SyncRefModelCallback` on zerotrain's engines: every `ref_model_sync_steps` optimizer steps the
    reference becomes `alpha * policy + (1 - alpha) * reference` (`ref_model_mixup_alpha`), as TRL mixes them; the
    policy's weights gathered at ZeRO-3 and the reference's (always ZeRO-3) gathered with rank 0 as the modifier, as
    TRL does under DeepSpeed's ZeRO-3."""

    def __init__(self, trainer: "DPOTrainer") -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        reference = trainer._zt_reference
        if reference is None or state.global_step % args.ref_model_sync_steps != 0:
            return
        alpha = args.ref_model_mixup_alpha
        policy = list(trainer.model.parameters())
        target = list(reference.module.parameters())
        with trainer.zerotrain_gathered(policy), GatheredParameters(target, modifier_rank=0), torch.no_grad():
            if args.process_index == 0:
                for ref_param, param in zip(target, policy, strict=True):
                    ref_param.data.mul_(1.0 - alpha).add_(param.data.to(ref_param.dtype), alpha=alpha)


class DPOTrainer(_ReferenceEngine, ZeroTrainMixin, trl.DPOTrainer):
    """TRL's DPOTrainer, trained by zerotrain's engine; the reference model (given, or loaded by TRL from the
    model's path) runs on a forward-only ZeRO-3 engine built with the training engine (partitioned over the
    ranks, no optimizer state). A PEFT model without a reference model uses its base (adapters disabled), as
    TRL does. `precompute_ref_log_probs` computes the reference log-probs before training on the whole model (the
    reference, or the policy when none is given), as TRL does outside DeepSpeed; `sync_ref_model` mixes the policy
    into the reference engine's weights (`_SyncReference`)."""

    def add_callback(self, callback: Any) -> None:
        """The Trainer's `add_callback`, with TRL's `SyncRefModelCallback` (which mixes whole tensors, or gathers
        under DeepSpeed's ZeRO-3 only) replaced by `_SyncReference`."""
        is_sync = callback is SyncRefModelCallback or isinstance(callback, SyncRefModelCallback)
        super().add_callback(_SyncReference(self) if is_sync else callback)

    def compute_loss(self, model: Any, inputs: dict, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        with self._zt_heads_gathered():
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)


class GRPOConfig(ZeroTrainArguments, trl.GRPOConfig):
    """TRL's GRPOConfig with `deepspeed=` as zerotrain's config."""


# GRPOConfig fields zerotrain.hf.GRPOTrainer refuses (name -> why)
_GRPO_REFUSED = {
    "use_vllm": "vLLM generation is not supported; generation runs transformers' generate on the gathered weights",
    "use_transformers_continuous_batching": "transformers' continuous batching is not supported (not tested)",
    "sync_ref_model": "not supported by zerotrain.hf.GRPOTrainer yet",
}


class GRPOTrainer(_ReferenceEngine, ZeroTrainMixin, trl.GRPOTrainer):
    """TRL's GRPOTrainer, trained by zerotrain's engine. Completions come from transformers' `generate` on the
    policy: at ZeRO-3 with `ds3_gather_for_generation` (TRL's default) on its gathered weights (every parameter
    whole for the whole generation, as TRL gathers them under DeepSpeed), else gathered layer by layer; at world
    > 1 with `synced_gpus` (every rank steps until all have finished). The reference model (the KL term, `beta`
    > 0) runs on a forward-only ZeRO-3 engine. Refused by name: `use_vllm`, `use_transformers_continuous_batching`,
    `sync_ref_model`."""

    def create_accelerator_and_postprocess(self) -> None:
        for name, why in _GRPO_REFUSED.items():
            if getattr(self.args, name, False):
                raise ValueError(f"{name}: {why}")
        super().create_accelerator_and_postprocess()

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        gathered = self.zerotrain_gathered(self.model.parameters()) if self.args.ds3_gather_for_generation \
            else contextlib.nullcontext()
        with gathered:
            return super()._generate_single_turn(*args, **kwargs)

    def _get_per_token_logps_and_entropies(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        with self._zt_heads_gathered():
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)


class RewardConfig(ZeroTrainArguments, trl.RewardConfig):
    """TRL's RewardConfig with `deepspeed=` as zerotrain's config."""


class RewardTrainer(ZeroTrainMixin, trl.RewardTrainer):
    """TRL's RewardTrainer (a sequence-classification model scoring chosen against rejected), trained by
    zerotrain's engine. Its score head is called as a module, so ZeRO-3 gathers it like any layer; nothing is
    overridden beyond the mixin's seams."""
