"""Sharding of model states across data-parallel ranks (ZeRO stages 0-3).

`zerotrain.zero.Init()` and `zerotrain.zero.GatheredParameters()` mirror DeepSpeed's.
"""
from .flat import FlatBucket, ShardRecord, build_buckets
from .stage3 import GatheredParameters, Init

__all__ = ["FlatBucket", "ShardRecord", "build_buckets", "GatheredParameters", "Init"]
