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
