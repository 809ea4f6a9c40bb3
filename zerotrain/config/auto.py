"""Filling in "auto" values the way Hugging Face's Trainer / Accelerate integration does.

Config files written for the HF integration (transformers, accelerate, LLaMA-Factory, axolotl)
leave many values as "auto", to be taken from the training arguments and the model. Left in,
`load_config` reads such a value as "not set" (the batch keys) or "use zerotrain's default"
(with a `ConfigWarning`). To get the values HF would run with instead:

    values = hf_auto_values(micro_batch_per_gpu=4, gradient_accumulation_steps=2, dp_world_size=8,
                            learning_rate=3e-5, warmup_steps=100, total_steps=1000, hidden_size=4096)
    cfg = load_config(fill_auto(read_config_file("ds_config_zero3.json"), values), dp_world_size=8)

Only values that are "auto" are replaced; values the file sets stay as written. A value
keyed by its current name also fills a legacy spelling of it ("prefetch_bucket_size").
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Optional

from .base import ConfigError, is_auto
from .schema import AioConfig, ZeroTrainConfig
from .zero import ZeroConfig

__all__ = ["fill_auto", "hf_auto_values"]

# Legacy spellings per block path: current name -> the older names a file may use.
_LEGACY_BY_PATH: dict[str, dict[str, str]] = {"": ZeroTrainConfig.LEGACY, "zero_optimization": ZeroConfig.LEGACY,
                                              "aio": AioConfig.LEGACY}


def _spellings(block_path: str, name: str) -> list[str]:
    legacy = _LEGACY_BY_PATH.get(block_path, {})
    return [name] + [old for old, new in legacy.items() if new == name]


def fill_auto(config: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of `config` in which every "auto" at a dotted key of `values` is replaced by its value.

    Keys of `values` missing from `config`, or set there to something other than "auto", are left
    alone, so one `values` dict serves every config file.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"config must be a dict, got {type(config).__name__}")
    filled = copy.deepcopy(dict(config))
    for dotted, value in values.items():
        parts = dotted.split(".")
        node: Any = filled
        path = ""
        for part in parts[:-1]:
            key = next((k for k in _spellings(path, part) if isinstance(node, dict) and k in node), None)
            if key is None:
                node = None
                break
            node = node[key]
            path = f"{path}.{part}" if path else part
        if not isinstance(node, dict):
            continue
        for key in _spellings(path, parts[-1]):
            if key in node and is_auto(node[key]):
                node[key] = copy.deepcopy(value)
    return filled


def hf_auto_values(*, micro_batch_per_gpu: int, gradient_accumulation_steps: int, dp_world_size: int,
                   learning_rate: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   weight_decay: float = 0.0, max_grad_norm: float = 1.0, warmup_steps: int = 0,
                   total_steps: Optional[int] = None, hidden_size: Optional[int] = None, fp16: bool = False,
                   bf16: bool = False, save_16bit_model: bool = False) -> dict[str, Any]:
    """Dotted key -> the value HF's integration puts in place of "auto" (TrainingArguments' names and defaults).

    Bucket sizes follow the model's `hidden_size` (h*h, 0.9*h*h, 10*h) as HF does; without it they stay
    "auto" (zerotrain's defaults). `total_steps` fills `scheduler.params.total_num_steps`.
    """
    values: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_per_gpu,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "train_batch_size": micro_batch_per_gpu * gradient_accumulation_steps * dp_world_size,
        "gradient_clipping": max_grad_norm,
        "fp16.enabled": fp16,
        "bf16.enabled": bf16,
        "optimizer.params.lr": learning_rate,
        "optimizer.params.betas": list(betas),
        "optimizer.params.eps": eps,
        "optimizer.params.weight_decay": weight_decay,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": learning_rate,
        # As HF does since DeepSpeed 0.19.6 refuses 0: a no-warmup run gets the shortest warmup (1, raised to 2).
        "scheduler.params.warmup_num_steps": max(1, warmup_steps),
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": save_16bit_model,
    }
    if total_steps is not None:
        values["scheduler.params.total_num_steps"] = total_steps
    if hidden_size is not None:
        values["zero_optimization.reduce_bucket_size"] = hidden_size * hidden_size
        values["zero_optimization.stage3_prefetch_bucket_size"] = int(0.9 * hidden_size * hidden_size)
        values["zero_optimization.stage3_param_persistence_threshold"] = 10 * hidden_size
    return values
