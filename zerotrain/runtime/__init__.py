"""`zerotrain.runtime`: DeepSpeed's `deepspeed.runtime` import paths that training programs use.

Thin re-exports of zerotrain's own parts, with DeepSpeed's names: `runtime.zero.partition_parameters`
(`ZeroParamStatus`, `GatheredParameters`, `Init`; `param.ds_status` on partitioned parameters),
`runtime.zero` (`GatheredParameters`, `Init`), `runtime.utils` (`set_random_seed`, `see_memory_usage`,
`RepeatingLoader`, `partition_uniform` / `partition_balanced`, `move_to_device`), `runtime.dataloader`
(`RepeatingLoader`). The list of mirrored paths and what to write for the
others is `zerotrain.port.paths` (docs/porting.md's table is generated from it).
"""
from . import dataloader, utils, zero

__all__ = ["zero", "utils", "dataloader"]
