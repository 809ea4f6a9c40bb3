"""zerotrain.sharding in-process: a TensorSlice's runs against the slice itself, and what a ShardGroup says."""
from __future__ import annotations

import pytest
import torch

from zerotrain.sharding import ShardGroup, TensorSlice, expert_slice_of, is_split_expert

SLICES = [
    TensorSlice((6, 4), 0, ((2, 3),)),            # rows 2-4 of a row-split weight
    TensorSlice((4, 6), 1, ((1, 2),)),            # columns 1-2: strided in the full tensor
    TensorSlice((9, 2), 0, ((1, 1), (4, 1), (7, 1))),  # a fused q/k/v projection: one row of each part
    TensorSlice((2, 6, 3), 1, ((0, 2), (3, 2))),  # a middle dimension, two pieces
]


@pytest.mark.parametrize("piece", SLICES, ids=lambda s: f"{s.full_shape}-dim{s.dim}-{len(s.pieces)}")
def test_flat_runs_address_exactly_the_local_elements_and_refuse_outside_ranges(piece):
    full = torch.arange(1, torch.Size(piece.full_shape).numel() + 1).reshape(piece.full_shape)  # no zero
    local = piece.take(full).flatten()
    assert tuple(piece.take(full).shape) == piece.local_shape
    flat = full.flatten()
    numel = local.numel()
    for start in range(numel + 1):
        for count in range(numel - start + 1):
            read = torch.empty(count, dtype=full.dtype)
            for full_start, length, offset in piece.flat_runs(start, count):
                read[offset:offset + length] = flat[full_start:full_start + length]
            assert torch.equal(read, local[start:start + count]), (start, count)
    for start, count in ((numel - 1, 2), (-1, 1), (0, -1), (1, numel)):
        with pytest.raises(ValueError, match="outside the local tensor"):
            piece.flat_runs(start, count)
    # place() writes the local values back where take() read them
    target = torch.zeros_like(full)
    piece.place(piece.take(full), target)
    written = target != 0
    assert int(written.sum()) == numel and torch.equal(target[written], full[written])


def test_split_experts_and_what_a_shard_group_counts():
    weight = torch.nn.Parameter(torch.zeros(2, 3))
    assert expert_slice_of(weight) is None and not is_split_expert(weight)
    weight.ep_slice = TensorSlice((4, 3), 0, ((0, 2),))  # 2 of 4 experts here
    assert is_split_expert(weight)
    weight.ep_slice = TensorSlice((2, 3), 0, ((0, 2),))  # every expert here
    assert not is_split_expert(weight)
    local = ShardGroup.local()
    assert (local.partitions, local.rank, local.distinct, local.counts_in_norm) == (1, 0, False, True)
    assert ShardGroup(None, 2, 1).distinct and ShardGroup(None, 2, 1).counts_in_norm
