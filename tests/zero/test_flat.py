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


def test_layout_closes_a_bucket_only_past_the_limit():
    """Registration order 3, 5, 4, 5 at a limit of 8, packed from the last: 5 + 4 = 9 is past it (two buckets),
    5 + 3 = 8 meets it exactly (one bucket) - the first bucket and one after a close both counted from zero."""
    from zerotrain.zero.flat import bucket_layout

    kind = (torch.float32, 0)
    assert bucket_layout([(3, kind), (5, kind), (4, kind), (5, kind)], 8) == [[3], [2], [1, 0]]


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_shards_records_and_views_of_a_padded_bucket_over_three_partitions(rank):
    """11 elements (w 5, b 3, c 3) padded to 12 over 3 partitions of 4: each rank's bounds, shard
    (a view of the flat buffer), records (a parameter cut between shards, the padding in none), and every
    parameter a view of the flat buffer holding its own values."""
    values = {"w": torch.arange(1.0, 6.0), "b": torch.arange(10.0, 13.0), "c": torch.arange(20.0, 23.0)}
    params = [("w", torch.nn.Parameter(values["w"].clone())), ("b", torch.nn.Parameter(values["b"].clone())),
              ("c", torch.nn.Parameter(values["c"].clone()))]
    bucket = FlatBucket(0, params, 0, ShardGroup(None, 3, rank))
    flat = torch.cat([values["w"], values["b"], values["c"], torch.zeros(1)])
    assert (bucket.numel, bucket.padded_numel, bucket.shard_numel) == (11, 12, 4)
    assert torch.equal(bucket.flat_param, flat)
    for position, (name, param) in enumerate(params):
        assert param.data_ptr() == bucket.flat_param.data_ptr() + bucket.offsets[position] * 4
        assert torch.equal(param, values[name])
    assert bucket.shard_bounds() == (4 * rank, 4 * rank + 4)
    assert [bucket.shard_bounds(r) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    shard = bucket.local_shard()
    assert torch.equal(shard, flat[4 * rank:4 * rank + 4])
    assert shard.data_ptr() == bucket.flat_param.data_ptr() + 4 * rank * 4
    assert torch.equal(bucket.shard_of(flat * 2, 2 - rank), flat[4 * (2 - rank):4 * (3 - rank)] * 2)
    # (name, full shape, param_start, numel, shard_start) of every rank's pieces, asked of this rank's bucket
    expected = [[("w", (5,), 0, 4, 0)], [("w", (5,), 4, 1, 0), ("b", (3,), 0, 3, 1)], [("c", (3,), 0, 3, 0)]]
    for r in range(3):
        records = bucket.shard_records(r)
        assert [(x.name, x.full_shape, x.param_start, x.numel, x.shard_start) for x in records] == expected[r]
    assert bucket.shard_records() == bucket.shard_records(rank)
    zeros = bucket.new_zeros()
    assert zeros.shape == (12,) and zeros.dtype == torch.float32 and not zeros.any()
    pieces = bucket.unflatten(flat * 3)
    assert list(pieces) == ["w", "b", "c"]
    for name in pieces:
        assert torch.equal(pieces[name], values[name] * 3)
    assert bucket.param_view(1, flat).shape == (3,)
