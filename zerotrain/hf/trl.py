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

from typing import Any

import trl

from .trainer import ZeroTrainArguments, ZeroTrainMixin

__all__ = ["SFTTrainer", "SFTConfig"]


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
