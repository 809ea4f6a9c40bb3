"""What a shard is, shared by every part: the records, the slot, the tensor slice and the shard group.

A neutral module: zero/, offload/, parallel/ and checkpoint/ all read these types, so it imports
none of them (only `comm` for the Comm type).

- :class:`ShardRecord`: where one piece of a parameter sits, in the full tensor and in a shard.
- :class:`ShardedSlot`: one master tensor a rank updates, with the records of its pieces (what the
  checkpoint reads and writes).
- :class:`TensorSlice`: where a tensor- or expert-parallel rank's local tensor sits in the full one.
- :class:`ExpertGroups`: the Comms of split experts (expert-parallel and expert-data-parallel).
- :class:`ShardGroup`: what a bucket (or stage-3 parameter) is sharded over: the Comm it reduces and
  gathers over, its partition count, this rank's partition, and how it counts in the gradient norm.
  Dense buckets carry the data-parallel group; split experts carry their expert-data-parallel group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .comm import Comm

__all__ = ["ShardRecord", "ShardedSlot", "TensorSlice", "tensor_slice_of", "expert_slice_of", "is_split_expert",
           "ExpertGroups", "ShardGroup"]


@dataclass(frozen=True)
class ShardRecord:
    """Where one piece of a parameter sits: in the full tensor and in a shard.

    The piece covers elements [param_start, param_start + numel) of the
    parameter flattened in row-major order, and elements
    [shard_start, shard_start + numel) of the shard buffer.
    """

    name: str
    full_shape: tuple
    param_start: int
    numel: int
    shard_start: int


@dataclass
class ShardedSlot:
    """One master tensor this rank updates, with the records of where its pieces belong.

    `master` (fp32), `model_shard` (training dtype) and every per-element optimizer
    state are 1-D tensors of the same layout; `records` maps ranges of that layout
    to named parameters. `replicated` is true when every rank holds the same slot
    (stage 0), so only one rank needs to write it.
    """

    records: list
    master: torch.Tensor
    model_shard: torch.Tensor
    replicated: bool


@dataclass(frozen=True)
class TensorSlice:
    """The local tensor is `cat([full.narrow(dim, start, length) for start, length in pieces], dim)`.

    A tensor-parallel weight is split along one dimension. Usually each rank holds one
    contiguous range, but a fused projection (GPT's `c_attn`, which stacks q, k and v) is split
    per part so that every rank gets whole attention heads of each: its local tensor is the
    concatenation of several ranges of the full one. Everything that needs the full tensor
    (gathering weights, checkpoints, clipping) reads this instead of re-deriving the layout.
    """

    full_shape: tuple[int, ...]
    dim: int
    pieces: tuple[tuple[int, int], ...]

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = sum(length for _, length in self.pieces)
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of `full` (a new contiguous tensor)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"expected a full tensor of shape {self.full_shape}, got {tuple(full.shape)}")
        parts = [full.narrow(self.dim, start, length) for start, length in self.pieces]
        return torch.cat(parts, dim=self.dim).contiguous()

    def place(self, local: torch.Tensor, full: torch.Tensor) -> None:
        """Write `local` into its ranges of `full`."""
        offset = 0
        for start, length in self.pieces:
            full.narrow(self.dim, start, length).copy_(local.narrow(self.dim, offset, length))
            offset += length

    def flat_runs(self, start: int, count: int) -> list[tuple[int, int, int]]:
        """Where elements [start, start+count) of the flattened local tensor sit in the flattened full one.

        Returns (full_start, length, offset) runs, in local order: local elements
        [start+offset, start+offset+length) are full elements [full_start, full_start+length).
        A slice along dimension 0 gives one run per piece; along a later dimension the local
        range is strided in the full tensor, one run per piece per index of the leading dims.
        Checkpoints use this to read and write a local shard of a split tensor in whole-tensor files.
        """
        local_numel = 1
        for size in self.local_shape:
            local_numel *= size
        if start < 0 or count < 0 or start + count > local_numel:
            raise ValueError(f"elements [{start}, {start + count}) are outside the local tensor of shape "
                             f"{self.local_shape}")
        inner = 1
        for size in self.full_shape[self.dim + 1:]:
            inner *= size
        local_row = self.local_shape[self.dim] * inner   # local elements per index of the leading dims
        full_row = self.full_shape[self.dim] * inner
        bounds, position = [], 0                          # (local offset in a row, full offset in a row, length)
        for piece_start, length in self.pieces:
            bounds.append((position, piece_start * inner, length * inner))
            position += length * inner
        runs, index, end = [], start, start + count
        while index < end and local_row:
            row, within = divmod(index, local_row)
            for local_offset, full_offset, length in bounds:
                if local_offset <= within < local_offset + length:
                    take = min(local_offset + length - within, end - index)
                    runs.append((row * full_row + full_offset + within - local_offset, take, index - start))
                    index += take
                    break
        return runs


def tensor_slice_of(param: torch.Tensor) -> Optional[TensorSlice]:
    """The TensorSlice a tensor-parallel parameter carries (`tp_slice`), or None for a replicated one."""
    return getattr(param, "tp_slice", None)


def mark_pipeline_replica(param: torch.Tensor) -> None:
    """Mark `param` as a copy of a parameter another pipeline stage owns (a tied layer's weight on a later
    stage): its gradient is summed with the owner's, and it counts once in the global gradient norm, there."""
    param.pipeline_replica = True


def is_pipeline_replica(param: torch.Tensor) -> bool:
    """Whether `param` is a pipeline stage's copy of a tied parameter owned by another stage."""
    return bool(getattr(param, "pipeline_replica", False))


def expert_slice_of(param: torch.Tensor) -> Optional[TensorSlice]:
    """The TensorSlice an expert-parallel parameter carries (`ep_slice`), or None."""
    return getattr(param, "ep_slice", None)


def is_split_expert(param: torch.Tensor) -> bool:
    """True for an expert weight of which this rank holds only some experts."""
    expert_slice = expert_slice_of(param)
    return expert_slice is not None and expert_slice.local_shape != expert_slice.full_shape


@dataclass
class ExpertGroups:
    """The Comms of split experts: `ep` spans the ep_size consecutive data-parallel ranks that hold every
    expert between them; `data` spans the ranks holding the same experts as this one."""

    ep_size: int
    ep: Comm
    data: Comm


@dataclass(frozen=True)
class ShardGroup:
    """What one bucket (or stage-3 parameter) is sharded over.

    `comm` is the group its gradient is reduced over and its shards gathered over: the data-parallel
    Comm, or for split experts their expert-data-parallel Comm (`experts.data`). `partitions` is how
    many shards the bucket is cut into over `comm` (1: every rank of it holds all, stage 0, or
    expert buckets when dense ones are not partitioned) and `rank` this rank's shard.
    """

    comm: Optional[Comm]  # None: a single-process bucket (tests, benchmarks), never reduced or gathered
    partitions: int
    rank: int
    experts: Optional[ExpertGroups] = None  # set for split experts (then comm is experts.data)

    @staticmethod
    def local() -> "ShardGroup":
        """This process alone, without a Comm: a single-process bucket (tests, benchmarks), one partition,
        never reduced or gathered."""
        return ShardGroup(None, 1, 0)

    @staticmethod
    def over(comm: Comm, partitioned: bool, experts: Optional[ExpertGroups] = None) -> "ShardGroup":
        """The group of a bucket over `comm` (`experts.data` for split experts), partitioned over it or not."""
        comm = experts.data if experts is not None else comm
        if partitioned:
            return ShardGroup(comm, comm.size, comm.rank, experts)
        return ShardGroup(comm, 1, 0, experts)

    @property
    def expert(self) -> bool:
        """Whether the bucket holds split experts (different experts on the ranks of the data-parallel group)."""
        return self.experts is not None

    @property
    def distinct(self) -> bool:
        """Whether ranks hold different elements, so that norms sum squares over the data-parallel ranks
        (partitioned, or split experts); otherwise every rank holds the same replica."""
        return self.partitions > 1 or self.experts is not None

    @property
    def counts_in_norm(self) -> bool:
        """Whether this rank's shard counts in global sums (norms): always, except an expert replica on a
        rank other than its expert-data-parallel group's rank 0."""
        return self.experts is None or self.partitions > 1 or self.experts.data.rank == 0
