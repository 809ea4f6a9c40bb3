"""A FlatBucket carries the ShardGroup it is sharded over; without one it is refused."""
import pytest
import torch

from zerotrain.sharding import ShardGroup
from zerotrain.zero.flat import FlatBucket


def test_a_bucket_without_its_shard_group_is_refused():
    param = torch.nn.Parameter(torch.arange(5.0))
    with pytest.raises(TypeError, match="ShardGroup"):
        FlatBucket(0, [("w", param)], 0, 1)  # the old (partitions, rank) form
    with pytest.raises(TypeError):
        FlatBucket(0, [("w", param)], 0)  # noqa - no group at all
    bucket = FlatBucket(0, [("w", param)], 0, ShardGroup.local())
    assert (bucket.group.comm, bucket.partitions, bucket.shard_numel) == (None, 1, 5)
    assert bucket.shard_records() and torch.equal(bucket.local_shard(), torch.arange(5.0))


def test_buckets_follow_the_layout_function_estimate_uses():
    """`build_buckets` packs by `bucket_layout` (reverse registration order; a new bucket at the size limit, at a
    dtype or optimizer-group change; an oversized parameter alone), the function `zerotrain.estimate` counts with."""
    from zerotrain.zero.flat import bucket_layout, build_buckets, padded_numel

    numels = [3, 4, 12, 2, 2, 5, 1]
    dtypes = [torch.float32] * 5 + [torch.float16, torch.float32]
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt in zip(numels, dtypes)]
    group_of = {id(p): (1 if i == 0 else 0) for i, p in enumerate(params)}
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    layout = bucket_layout([(p.numel(), (p.dtype, group_of[id(p)])) for p in params], 8)
    # from the last: p6 | p5 (fp16) | p4 + p3 | p2 (12 > 8: alone) | p1 (4 + 12 > 8) | p0 (another optimizer group)
    assert layout == [[6], [5], [4, 3], [2], [1], [0]]
    buckets = build_buckets(named, group_of, 8, ShardGroup.local())
    assert [b.names for b in buckets] == [[f"p{i}" for i in members] for members in layout]
    assert [padded_numel(n, 4) for n in (1, 4, 5, 12)] == [4, 4, 8, 12]
