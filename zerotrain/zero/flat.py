"""Flat buffers of parameters, padded and split into equal per-rank shards.

A :class:`FlatBucket` lays a run of parameters end to end in one contiguous
buffer (the parameters become views into it), pads it to a multiple of the
number of partitions, and assigns partition r the r-th equal slice. Every stage
uses the same buckets: stage 0 with one partition (each rank holds all), stages
1 and 2 with one partition per data-parallel rank. A bucket carries its
:class:`~zerotrain.sharding.ShardGroup` (`bucket.group`): the Comm it is reduced and
gathered over and how it counts in norms; split experts are buckets whose group is
their expert-data-parallel group (`build_sharded_buckets`).

Each piece of a parameter that falls inside a shard is described by a
:class:`~zerotrain.sharding.ShardRecord`; checkpointing, clipping and tests read those records rather
than re-deriving the layout.
"""
from __future__ import annotations

from typing import Hashable, Iterable, Optional, Sequence

import torch

from ..comm import Comm
from ..sharding import ExpertGroups, ShardGroup, ShardRecord, is_split_expert


def padded_numel(numel: int, partitions: int) -> int:
    """`numel` rounded up to a multiple of `partitions`: a flat layout every rank shards equally (the padding
    of a FlatBucket and of a stage-3 PartitionedParam; `zerotrain.estimate` counts with it too)."""
    return -(-numel // partitions) * partitions


def bucket_layout(sizes: Sequence[tuple[int, Hashable]], bucket_numel: int) -> list[list[int]]:
    """How `build_buckets` packs: for parameters given as (numel, kind) in registration order, the indices of
    each bucket's members, in packing order.

    Parameters are taken in reverse registration order, which is roughly the order backward produces their
    gradients, so the first bucket fills first. A bucket never mixes kinds (dtype and optimizer group) and
    closes before it would exceed `bucket_numel` elements; a parameter larger than the limit gets a bucket of
    its own. Pure arithmetic: `zerotrain.estimate` lays out a model it never builds with it."""
    buckets: list[list[int]] = []
    current: list[int] = []
    current_numel = 0
    for index in reversed(range(len(sizes))):
        numel, kind = sizes[index]
        if current and (sizes[current[0]][1] != kind or current_numel + numel > bucket_numel):
            buckets.append(current)
            current, current_numel = [], 0
        current.append(index)
        current_numel += numel
    if current:
        buckets.append(current)
    return buckets


class ShardLayout:
    """The layout of a run of parameters laid end to end, padded and cut into equal shards over a
    ShardGroup: what a FlatBucket (stages 0-2) and a PartitionedParam (stage 3, one parameter) share.

    Partition `rank` owns elements [rank * shard_numel, (rank + 1) * shard_numel) of the flat layout.

    It is the bucket interface the reducers and optimizers are handed (stages 0-2 and stage 3 alike): the
    layout below, `local_shard()`, and where the shard lives, as real attributes (a PartitionedParam
    computes them from its parameter store), so no optimizer asks a bucket by name what it is.
    """

    keeps_full_copy = True  # stages 1-2: every rank holds the whole flat buffer between steps
    offloaded = False  # offload_param (stage 3): the shard lives in a parameter store (`write_shard` changes it)
    shard_in_device_memory = True  # `local_shard()` is a lasting tensor in device memory (an fp32 master may share it)

    def __init__(self, index: int, names: list[str], params: list[torch.nn.Parameter], shapes: list[tuple],
                 group_index: int, group: ShardGroup):
        if not params:
            raise ValueError("a bucket needs at least one parameter")
        self.index = index
        self.group_index = group_index
        self.group = group
        self.partitions = partitions = group.partitions
        self.rank = group.rank
        self.names = names
        self.params = params
        self.shapes = shapes
        self.numels = [int(torch.Size(shape).numel()) for shape in shapes]
        self.offsets: list[int] = []
        total = 0
        for numel in self.numels:
            self.offsets.append(total)
            total += numel
        self.numel = total
        self.padded_numel = padded_numel(total, partitions)
        self.shard_numel = self.padded_numel // partitions
        first = params[0]
        self.dtype, self.device = first.dtype, first.device

    def shard_extent(self):
        """Where an NVMe parameter store keeps the shard (`interfaces.ShardExtent`), or None: stages 0-2 and
        every shard not in such a store (PartitionedParam overrides)."""
        return None

    def lend_shard_extent(self) -> None:
        """Lend `shard_extent()` until the next `write_shard` (the gradient spilled there; see ParamStore.lend)."""
        raise RuntimeError(f"bucket {self.index}: its shard is not kept in a parameter store's file")

    # --- layout -----------------------------------------------------------
    def shard_bounds(self, rank: int | None = None) -> tuple[int, int]:
        """[start, end) of partition `rank` (default: this rank) in the flat buffer."""
        rank = self.rank if rank is None else rank
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def shard_of(self, flat: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """The view of a full-size flat tensor that partition `rank` owns."""
        start, end = self.shard_bounds(rank)
        return flat[start:end]

    def param_view(self, position: int, flat: torch.Tensor) -> torch.Tensor:
        """Parameter `position`'s slice of a full-size flat tensor, shaped like the parameter."""
        offset = self.offsets[position]
        return flat[offset:offset + self.numels[position]].view(self.shapes[position])

    def shard_records(self, rank: int | None = None) -> list[ShardRecord]:
        """The pieces of parameters that partition `rank` owns, in shard order."""
        start, end = self.shard_bounds(rank)
        records = []
        for name, shape, offset, numel in zip(self.names, self.shapes, self.offsets, self.numels):
            lo, hi = max(start, offset), min(end, offset + numel)
            if lo < hi:
                records.append(ShardRecord(name, shape, lo - offset, hi - lo, lo - start))
        return records

    def new_zeros(self) -> torch.Tensor:
        """A zeroed full-size flat tensor of the bucket's dtype (for gradient staging)."""
        return torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a full-size flat tensor into named tensors shaped like the parameters."""
        return {name: self.param_view(i, flat) for i, name in enumerate(self.names)}


class FlatBucket(ShardLayout):
    """A contiguous run of parameters of one dtype and one optimizer group.

    `flat_param` holds the full (unsharded) values in the training dtype and every
    parameter's `.data` is a view into it. Partition `group.rank` owns elements
    [rank * shard_numel, (rank + 1) * shard_numel) of it. `group` is what it is sharded over
    (required: every sharded tensor carries its group; `ShardGroup.local()` for a single-process
    bucket in tests and benchmarks).
    """

    def __init__(self, index: int, named_params: Sequence[tuple[str, torch.nn.Parameter]],
                 group_index: int, group: ShardGroup):
        if not isinstance(group, ShardGroup):
            raise TypeError(f"FlatBucket {index}: group must be a ShardGroup (what the bucket is sharded over; "
                            f"ShardGroup.local() for a single process), got {type(group).__name__}")
        params = [param for _, param in named_params]
        super().__init__(index, [name for name, _ in named_params], params, [tuple(p.shape) for p in params],
                         group_index, group)
        self.flat_param = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for param, offset in zip(self.params, self.offsets):
                view = self.flat_param[offset:offset + param.numel()].view_as(param)
                view.copy_(param.data)
                param.data = view

    def local_shard(self) -> torch.Tensor:
        """This rank's shard of the parameters, in the training dtype (a view of flat_param)."""
        return self.shard_of(self.flat_param)


def build_buckets(named_params: Iterable[tuple[str, torch.nn.Parameter]], group_of: dict[int, int],
                  bucket_numel: int, group: ShardGroup) -> list[FlatBucket]:
    """Pack trainable parameters into buckets of at most `bucket_numel` elements (`bucket_layout`: reverse
    registration order, one dtype and optimizer group per bucket). `group_of` maps id(param) to its optimizer
    group index; every bucket is sharded over `group`.
    """
    trainable = [(name, p) for name, p in named_params if p.requires_grad]
    sizes = [(p.numel(), (p.dtype, group_of[id(p)])) for _, p in trainable]
    buckets: list[FlatBucket] = []
    for members in bucket_layout(sizes, bucket_numel):
        first = trainable[members[0]][1]
        buckets.append(FlatBucket(len(buckets), [trainable[i] for i in members], group_of[id(first)], group))
    return buckets


def build_sharded_buckets(named_params: Iterable[tuple[str, torch.nn.Parameter]], group_of: dict[int, int],
                          bucket_numel: int, comm: Comm, partitioned: bool,
                          experts: Optional[ExpertGroups] = None) -> list[FlatBucket]:
    """The buckets of stages 0-2: dense parameters over `comm` (partitioned over it at stages 1-2), then
    split expert parameters (zerotrain.parallel.experts) in buckets of their own over their
    expert-data-parallel group (`experts.data`), partitioned there when the dense ones are."""
    named = list(named_params)
    shared = [(name, p) for name, p in named if not is_split_expert(p)]
    split = [(name, p) for name, p in named if is_split_expert(p)]
    buckets = build_buckets(shared, group_of, bucket_numel, ShardGroup.over(comm, partitioned))
    if split and experts is None:
        raise ValueError(f"expert-parallel parameters {[n for n, _ in split[:4]]} need their ExpertGroups")
    if split:
        expert_group = ShardGroup.over(comm, partitioned and experts.data.size > 1, experts)
        for bucket in build_buckets(split, group_of, bucket_numel, expert_group):
            bucket.index = len(buckets)
            buckets.append(bucket)
    return buckets
