"""Hugging Face Trainer and TRL scripts on zerotrain's engine: change the imports, keep the script.

    from zerotrain.hf import Trainer, TrainingArguments        # instead of transformers'
    from zerotrain.hf import SFTTrainer, SFTConfig             # instead of trl's (needs `trl`)
    from zerotrain.hf import DPOTrainer, DPOConfig             # the reference model on a forward-only ZeRO-3 engine
    from zerotrain.hf import RewardTrainer, RewardConfig       # a sequence-classification reward model
    from zerotrain.hf import GRPOTrainer, GRPOConfig           # generate on the gathered weights, ZeRO-3 reference

`TrainingArguments(deepspeed=...)` is zerotrain's config ("auto" filled as transformers fills it);
without it the arguments alone give ZeRO-3. docs/hf.md lists what is supported and what is refused.
"""
from __future__ import annotations

from typing import Any

from .trainer import Trainer, TrainingArguments, ZeroTrainMixin

__all__ = ["Trainer", "TrainingArguments", "ZeroTrainMixin", "SFTTrainer", "SFTConfig", "DPOTrainer", "DPOConfig",
           "RewardTrainer", "RewardConfig", "GRPOTrainer", "GRPOConfig"]


_TRL = ("SFTTrainer", "SFTConfig", "DPOTrainer", "DPOConfig", "RewardTrainer", "RewardConfig", "GRPOTrainer",
        "GRPOConfig")


def __getattr__(name: str) -> Any:
    # TRL is optional: `from zerotrain.hf import Trainer` must not need it.
    if name in _TRL:
        from . import trl
        return getattr(trl, name)
    raise AttributeError(f"module 'zerotrain.hf' has no attribute {name!r}")
