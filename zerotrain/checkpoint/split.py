"""Tensor-parallel parameters in the unified checkpoint: whole tensors on disk, local slices in the engine.

A tensor-parallel rank holds a slice of each split parameter (`param.tp_slice`, a
:class:`~zerotrain.parallel.slices.TensorSlice`), and ZeRO shards that *local* tensor over
the data-parallel group, so a slot's records give flat ranges of the local tensor. The
files hold whole tensors under the model's names, as without tensor parallelism, so a
checkpoint written at one tensor-parallel degree loads at any other (1 included):

* saving: the writer of a split tensor receives the pieces of every tensor-parallel rank's
  local tensor (`plan`), joins each rank's pieces into its local tensor and places it into
  the whole tensor by that rank's TensorSlice (`assemble_whole`): one whole tensor at a
  time on its writer, never the whole model;
* loading: a local flat range maps to runs of the whole flattened tensor
  (`TensorSlice.flat_runs`: strided when the split dimension is not the first), read in
  bounded windows (`RunsRead`).

Experts split over the ranks of each expert-parallel group (`param.ep_slice`,
zerotrain.parallel.experts) are handled the same way, the holder of a slice being the rank's
position in its expert-parallel group; at stages 1-2 ZeRO partitions each slice over its
expert-data-parallel group, exactly as it partitions a tensor-parallel slice over the
data-parallel group. With tensor parallelism every tensor-parallel rank holds the same experts:
the plan takes them from tensor-parallel rank 0's ranks only, and each rank loads its own slice.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..parallel.experts import expert_slice_of, is_split_expert
from ..parallel.slices import TensorSlice, tensor_slice_of
from .format import CheckpointError

WINDOW_ELEMENTS = 4 * 1024 * 1024  # at most this many elements read at once to gather strided runs


def tensor_slices(module: torch.nn.Module) -> dict[str, TensorSlice]:
    """{parameter name: TensorSlice} of every split parameter (tied names included): tensor-parallel
    ones by `tp_slice`, experts split over data-parallel ranks by `ep_slice`."""
    slices = {name: tensor_slice_of(param) for name, param in module.named_parameters(remove_duplicate=False)
              if tensor_slice_of(param) is not None}
    slices.update({name: expert_slice_of(param) for name, param in expert_params(module)})
    return slices


def expert_params(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every expert weight of which this rank holds only some experts."""
    return [(name, param) for name, param in module.named_parameters(remove_duplicate=False)
            if is_split_expert(param)]


def refuse_split_extras(names: list[str], experts: set[str] = frozenset()) -> None:
    """A split parameter outside every slot (frozen, stages 0-2) differs per tensor-parallel rank (or per
    data-parallel rank, for `experts`) and only the writer's slice is at hand: refused, naming it, before
    anything is written."""
    if not names:
        return
    frozen_experts = [name for name in names if name in experts]
    if frozen_experts:
        raise CheckpointError(f"cannot save frozen expert-parallel parameters {frozen_experts[:3]} (experts split "
                              f"over data-parallel ranks) at ZeRO stage 0-2: they are outside the optimizer's "
                              f"shards, so their writer holds only its own experts (make them trainable, or use "
                              f"engine.full_state_dict() for the whole weights)")
    raise CheckpointError(f"cannot save frozen tensor-parallel parameters {names[:3]} at ZeRO stage 0-2: "
                          f"they are outside the optimizer's shards, so their writer holds only its own "
                          f"slice (make them trainable, or use ZeRO stage 3, which shards frozen parameters)")


def assemble_whole(shape: tuple, slices: dict[int, TensorSlice], pieces: list, chunks: list,
                   dtype: torch.dtype) -> torch.Tensor:
    """The bytes of a whole split tensor from the byte chunks of its pieces.

    `pieces` (plan.Piece, sorted by tensor-parallel rank then position, covering each rank's
    local tensor) and `chunks` correspond; `slices[r]` places rank r's local tensor."""
    whole = torch.empty(shape, dtype=dtype)
    by_rank: dict[int, list] = {}
    for piece, chunk in zip(pieces, chunks):
        by_rank.setdefault(piece.tp_rank, []).append(chunk)
    for tp_rank, parts in by_rank.items():
        tensor_slice = slices[tp_rank]
        local = torch.cat(parts).view(dtype).reshape(tensor_slice.local_shape)
        tensor_slice.place(local, whole)
    return whole.reshape(-1).view(torch.uint8)


class RunsRead:
    """Local elements [start, start+count) of a split tensor, read from the whole tensor `name` of a
    TensorReader into [offset, offset+count) of a slot tensor.

    Runs close together are read as one window of at most WINDOW_ELEMENTS elements (one
    sequential read instead of one per row of a column-split weight); a run longer than that
    is read straight into the target."""

    def __init__(self, reader, name: str, tensor_slice: TensorSlice, start: int, count: int, offset: int):
        self.reader, self.name, self.offset = reader, name, offset
        self.groups: list[list[tuple[int, int, int]]] = []
        low = high = 0
        for run in tensor_slice.flat_runs(start, count):
            begin, end = run[0], run[0] + run[1]
            if self.groups and max(high, end) - min(low, begin) <= WINDOW_ELEMENTS:
                self.groups[-1].append(run)
                low, high = min(low, begin), max(high, end)
            else:
                self.groups.append([run])
                low, high = begin, end

    def into(self, target: torch.Tensor) -> None:
        for group in self.groups:
            if len(group) == 1:
                full_start, length, at = group[0]
                self.reader.read_into(self.name, full_start, length,
                                      target[self.offset + at:self.offset + at + length])
                continue
            low = min(run[0] for run in group)
            high = max(run[0] + run[1] for run in group)
            window = self.reader.read_range(self.name, low, high - low)
            for full_start, length, at in group:
                target[self.offset + at:self.offset + at + length].copy_(
                    window[full_start - low:full_start - low + length])


def expected_shape(record_shape: tuple, tensor_slice: Optional[TensorSlice], name: str) -> tuple:
    """The shape of tensor `name` in the files: the whole tensor's, for a split parameter."""
    if tensor_slice is None:
        return tuple(record_shape)
    if tuple(tensor_slice.local_shape) != tuple(record_shape):
        raise CheckpointError(f"parameter {name!r}: its tensor-parallel slice has shape "
                              f"{list(tensor_slice.local_shape)}, its shard records say {list(record_shape)}")
    return tuple(tensor_slice.full_shape)
