"""Where a tensor-parallel rank's local slice sits in the full tensor.

A tensor-parallel weight is split along one dimension. Usually each rank holds one
contiguous range, but a fused projection (GPT's `c_attn`, which stacks q, k and v) is split
per part so that every rank gets whole attention heads of each: its local tensor is the
concatenation of several ranges of the full one. :class:`TensorSlice` records exactly that,
and everything that needs the full tensor (gathering weights, checkpoints, clipping)
reads it instead of re-deriving the layout from rank arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["TensorSlice", "split_slice", "tensor_slice_of"]


@dataclass(frozen=True)
class TensorSlice:
    """The local tensor is `cat([full.narrow(dim, start, length) for start, length in pieces], dim)`."""

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


def split_slice(full_shape: tuple[int, ...], dim: int, rank: int, size: int, parts: int = 1,
                what: str = "tensor") -> TensorSlice:
    """Rank `rank`'s slice when dimension `dim` is cut into `parts` equal parts (3 for fused
    q/k/v) and each part is split evenly over `size` ranks. Uneven splits are refused: they
    would change the math of attention heads and make checkpoints layout-dependent."""
    length = full_shape[dim]
    if length % (parts * size):
        raise ValueError(f"{what}: dimension {dim} of size {length} does not split into {parts} part(s) "
                         f"over {size} tensor-parallel ranks")
    part_len = length // parts
    local = part_len // size
    pieces = tuple((part * part_len + rank * local, local) for part in range(parts))
    return TensorSlice(tuple(full_shape), dim, pieces)


def tensor_slice_of(param: torch.Tensor) -> Optional[TensorSlice]:
    """The TensorSlice a tensor-parallel parameter carries, or None for a replicated one."""
    return getattr(param, "tp_slice", None)
