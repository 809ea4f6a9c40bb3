"""Sharding of model states across data-parallel ranks (ZeRO stages 0-3).

`zerotrain.zero.Init()` and `zerotrain.zero.GatheredParameters()` mirror DeepSpeed's.

- `interfaces`: the Protocols the engine talks to: GradientReducer, MasterOptimizer, ParamStore.
- `flat`: ShardLayout, FlatBucket (stages 0-2) and bucket building with each bucket's ShardGroup
  (`zerotrain.sharding`: split experts get their expert-data-parallel group).
- `grads`: the stage 0-2 gradient reducer (qgZ and LoCo included); `gradnorm`: the global norm.
- `optimizer`: ShardedOptimizer, the master-weight step (zerotrain.offload subclasses it).
- `stage3`: partitioned parameters, their fetcher (prefetch, qwZ, hpZ) and bucketed reducer.
"""
from .flat import FlatBucket, ShardRecord, build_buckets
from .stage3 import GatheredParameters, Init

__all__ = ["FlatBucket", "ShardRecord", "build_buckets", "GatheredParameters", "Init"]
