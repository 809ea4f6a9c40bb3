"""Where a tensor-parallel rank's local slice sits in the full tensor.

A tensor-parallel weight is split along one dimension. Usually each rank holds one
contiguous range, but a fused projection (GPT's `c_attn`, which stacks q, k and v) is split
per part so that every rank gets whole attention heads of each: its local tensor is the
concatenation of several ranges of the full one. :class:`TensorSlice` records exactly that,
and everything that needs the full tensor (gathering weights, checkpoints, clipping)
reads it instead of re-deriving the layout from rank arithmetic. The type lives in the neutral
`zerotrain.sharding` (checkpoint and zero read it too); this module builds and finds slices.
"""
from __future__ import annotations

from ..sharding import TensorSlice, tensor_slice_of

__all__ = ["TensorSlice", "split_slice", "tensor_slice_of"]


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
