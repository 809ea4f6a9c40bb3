"""Whole tensors from tensor-parallel slices, by the TensorSlice each split parameter carries."""
from __future__ import annotations

from typing import Optional

import torch

from ..comm import Comm
from .slices import TensorSlice

__all__ = ["assemble_full_tensors"]


def assemble_full_tensors(local: dict[str, torch.Tensor], slices: dict[str, TensorSlice],
                          tp: Comm) -> dict[str, torch.Tensor]:
    """Called on every rank of a tensor-parallel group with its local tensors by name (the same
    names, in the same order, everywhere; `slices` names the split ones). Returns the whole
    tensors on tensor-parallel rank 0, an empty dict elsewhere. One tensor is in flight at a time,
    so no rank holds more than one whole split tensor beyond the result."""
    if tp.size == 1:
        return dict(local)
    every_rank_slices = tp.all_gather_object(slices)  # each rank's own records: nothing re-derived
    full: dict[str, torch.Tensor] = {}
    for name, tensor in local.items():
        tensor_slice: Optional[TensorSlice] = slices.get(name)
        if tensor_slice is None:
            if tp.rank == 0:
                full[name] = tensor
            continue
        pieces = tp.gather_to(tensor.contiguous(), dst=0)
        if tp.rank != 0:
            continue
        whole = torch.empty(tensor_slice.full_shape, dtype=tensor.dtype)
        for rank_slices, piece in zip(every_rank_slices, pieces):
            rank_slices[name].place(piece, whole)
        full[name] = whole
    return full
