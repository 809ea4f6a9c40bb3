"""Filling in "auto" values the way Hugging Face's Trainer / Accelerate integration does.

Config files written for the HF integration (transformers, accelerate, LLaMA-Factory, axolotl)
leave many values as "auto", to be taken from the training arguments and the model. Left in,
`load_config` reads such a value as "not set" (the batch keys) or "use zerotrain's default"
(with a `ConfigWarning`). To get the values HF would run with instead:

    values = hf_arguments.auto_values({"learning_rate": 3e-5, ...}, world_size=8, num_training_steps=1000)
    cfg = load_config(fill_auto(read_config_file("ds_config_zero3.json"), values), dp_world_size=8)

(`hf_arguments` holds the values transformers fills and checks mismatches; this is the plain fill.)

Only values that are "auto" are replaced; values the file sets stay as written. A value
keyed by its current name also fills a legacy spelling of it ("prefetch_bucket_size").
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from .base import ConfigError, is_auto
from .schema import AioConfig, ZeroTrainConfig
from .zero import ZeroConfig

__all__ = ["fill_auto"]

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
