"""Stage-3 reduce buckets in process: how `build_reduce_buckets` groups partitioned parameters (the spawned
tests in test_stage3_grads_reuse.py count the collectives it gives at world 2, at limits no bucket meets exactly)."""
from __future__ import annotations

import torch

from zerotrain.comm import Comm
from zerotrain.sharding import ShardGroup
from zerotrain.zero.stage3.grads import build_reduce_buckets
from zerotrain.zero.stage3.partition import partition_parameter


def _parts(specs: list[tuple[int, torch.dtype, Comm]]) -> list:
    return [partition_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(numel, dtype=dtype)), ShardGroup.over(comm, True))
            for i, (numel, dtype, comm) in enumerate(specs)]


def test_reduce_buckets_fill_to_exactly_the_limit_and_split_at_a_dtype_or_group_change():
    comm, other = Comm(None, 0, 1), Comm(None, 0, 1)  # two groups (as split experts' expert-data group is)
    f32, f16 = torch.float32, torch.float16
    # 3 + 4 + 5 = 12 and 2 + 10 = 12: both buckets exactly at the limit (a bucket closes only past it);
    # then 20 > 12 alone, a dtype change, and a group change with the same dtype
    parts = _parts([(3, f32, comm), (4, f32, comm), (5, f32, comm), (2, f32, comm), (10, f32, comm),
                    (20, f32, comm), (1, f16, comm), (2, f16, comm), (3, f16, other), (4, f32, other)])
    buckets = build_reduce_buckets(parts, 12, comm)
    assert [[parts.index(p) for p in b.parts] for b in buckets] == [[0, 1, 2], [3, 4], [5], [6, 7], [8], [9]]
    assert [b.index for b in buckets] == list(range(6))
    assert [b.comm for b in buckets] == [comm] * 4 + [other] * 2
    assert [(b.offsets, b.shard_numel) for b in buckets[:2]] == [([0, 3, 7], 12), ([0, 2], 12)]
