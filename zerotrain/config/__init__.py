"""zerotrain's configuration: DeepSpeed-compatible JSON keys, checked by pydantic.

    from zerotrain.config import load_config
    cfg = load_config("ds_config.json", dp_world_size=4)

Modules: `base` (errors, value types, key screening), `schema` (the top-level model),
`zero` (`zero_optimization`), `params` (`optimizer`, `scheduler`), `batch` (the batch-size
triple), `loader` (files, comments, "auto"; its docstring lists the rules), `auto`
(filling "auto"), `hf_arguments` (HF TrainingArguments names -> config keys, the "auto" values
transformers fills, a complete config from arguments alone).
"""
from .auto import fill_auto
from .hf_arguments import hf_auto_values
from .base import ConfigError, ConfigWarning
from .batch import resolve_batch_triple
from .loader import load_config, parse_json_text, read_config_file, strip_json_comments
from .params import (AdamParams, OptimizerConfig, SchedulerConfig, SGDParams, WarmupCosineLRParams,
                     WarmupDecayLRParams, WarmupLRParams)
from .monitor import CSVMonitorConfig, TensorBoardConfig, WandbConfig
from .schema import AioConfig, BF16Config, CheckpointConfig, FP16Config, FP8Config, ZeroTrainConfig
from .zero import LocoConfig, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "ConfigError", "ConfigWarning", "load_config", "ZeroTrainConfig", "resolve_batch_triple",
    "read_config_file", "parse_json_text", "strip_json_comments",
    "OptimizerConfig", "SchedulerConfig", "AdamParams", "SGDParams", "WarmupLRParams", "WarmupDecayLRParams",
    "WarmupCosineLRParams", "FP16Config", "BF16Config", "FP8Config", "CheckpointConfig", "AioConfig",
    "ZeroConfig", "OffloadOptimizerConfig", "OffloadParamConfig", "LocoConfig", "fill_auto", "hf_auto_values",
    "TensorBoardConfig", "CSVMonitorConfig", "WandbConfig",
]
