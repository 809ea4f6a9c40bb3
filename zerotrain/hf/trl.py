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

import zerotrain
from zerotrain.zero import GatheredParameters

from .trainer import ZeroTrainArguments, ZeroTrainMixin

__all__ = ["SFTTrainer", "SFTConfig", "DPOTrainer", "DPOConfig", "RewardTrainer", "RewardConfig"]


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


class DPOTrainer(ZeroTrainMixin, trl.DPOTrainer):
    """TRL's DPOTrainer, trained by zerotrain's engine; the reference model (given, or loaded by TRL from the
    model's path) runs on a forward-only ZeRO-3 engine built with the training engine (partitioned over the
    ranks, no optimizer state). A PEFT model without a reference model uses its base (adapters disabled), as
    TRL does; `sync_ref_model` and `precompute_ref_log_probs` are refused (not tested here)."""

    _zt_reference: Any = None

    def create_accelerator_and_postprocess(self) -> None:
        for name in ("sync_ref_model", "precompute_ref_log_probs"):
            if getattr(self.args, name, False):
                raise ValueError(f"{name}: not supported by zerotrain.hf.DPOTrainer yet")
        super().create_accelerator_and_postprocess()

    def _zt_build_engine(self, model: torch.nn.Module) -> Any:
        engine = super()._zt_build_engine(model)
        reference = self.ref_model
        if reference is not None and self._zt_reference is None:
            config = reference_config(self.zerotrain_config(model, int(self.state.max_steps)))
            self._zt_reference, *_ = zerotrain.initialize(model=reference, config=config)
            self._zt_reference.eval()
            self.ref_model = self._zt_reference
        return engine

    def compute_loss(self, model: Any, inputs: dict, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        # TRL's fused LM head reads `lm_head.weight` without calling the module (gathered by TRL under DeepSpeed's
        # ZeRO-3 only): gathered here for the policy's forward and the reference's
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.zerotrain_gathered(self.model.get_output_embeddings().parameters()))
            if self._zt_reference is not None:  # ZeRO-3 at any training stage
                head = self._zt_reference.module.get_output_embeddings().parameters()
                stack.enter_context(GatheredParameters(list(head)))
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)


class RewardConfig(ZeroTrainArguments, trl.RewardConfig):
    """TRL's RewardConfig with `deepspeed=` as zerotrain's config."""


class RewardTrainer(ZeroTrainMixin, trl.RewardTrainer):
    """TRL's RewardTrainer (a sequence-classification model scoring chosen against rejected), trained by
    zerotrain's engine. Its score head is called as a module, so ZeRO-3 gathers it like any layer; nothing is
    overridden beyond the mixin's seams."""
