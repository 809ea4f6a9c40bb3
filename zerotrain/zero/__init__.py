"""Sharding of model states across data-parallel ranks (ZeRO stages 0-3).

`zerotrain.zero.Init()` and `zerotrain.zero.GatheredParameters()` mirror DeepSpeed's.

- `interfaces`: the Protocols the engine talks to: GradientReducer, MasterOptimizer, ParamStore, and
  BucketReduce (the sum a reducer is given).
- `flat`: ShardLayout, FlatBucket (stages 0-2) and bucket building with each bucket's ShardGroup
  (`zerotrain.sharding`: split experts get their expert-data-parallel group).
- `grads`: the gradient reducers by what they keep (FullBufferReducer: stages 0-1, PartitionedReducer:
  stage 2) and what they share (BucketReducer); `reduce`: the sum they are given (exact, or qgZ with
  LoCo); `gradnorm`: the global norm.
- `optimizer`: ShardedOptimizer, the master-weight step (zerotrain.offload subclasses it).
- `stage3`: partitioned parameters, their fetcher (prefetch, qwZ, hpZ) and bucketed reducer.
"""
from .flat import FlatBucket, ShardRecord, build_buckets
from .stage3 import GatheredParameters, Init

__all__ = ["FlatBucket", "ShardRecord", "build_buckets", "GatheredParameters", "Init"]
