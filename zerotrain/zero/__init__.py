"""Sharding of model states across data-parallel ranks (ZeRO stages 0-2)."""
from .flat import FlatBucket, ShardRecord, build_buckets

__all__ = ["FlatBucket", "ShardRecord", "build_buckets"]
