"""`zerotrain.moe`: DeepSpeed's `deepspeed.moe.utils` helpers for programs that build optimizer groups.

zerotrain's expert-parallel layers live in `zerotrain.parallel` (`ExpertParallelMoE`); DeepSpeed's
`deepspeed.moe.layer.MoE` class is not mirrored (docs/porting.md).
"""
from . import utils

__all__ = ["utils"]
