"""`zerotrain.runtime`: DeepSpeed's `deepspeed.runtime` import paths that training programs use.

Thin re-exports of zerotrain's own parts, with DeepSpeed's names: `runtime.zero.partition_parameters`
(`ZeroParamStatus`, `GatheredParameters`, `Init`; `param.ds_status` on partitioned parameters),
`runtime.zero` (`GatheredParameters`, `Init`). The list of mirrored paths and what to write for the
others is `zerotrain.port.paths` (docs/porting.md's table is generated from it).
"""
from . import zero

__all__ = ["zero"]
