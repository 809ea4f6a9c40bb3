"""Megatron-style tensor-parallel layers.

A column-parallel linear splits its output features over the tensor-parallel group: each
rank computes its slice of the output from the whole input. A row-parallel linear splits
its input features: each rank multiplies its slice of the input and the partial results are
summed by an all-reduce. Paired (column, then row) a block needs one all-reduce forward and
one backward. A vocab-parallel embedding splits the vocabulary rows; a rank looks up the ids
it owns, zeros the rest, and an all-reduce assembles the rows.

Both linear layers also take a weight stored `[in, out]` (`transposed=True`: transformers'
`Conv1D`, GPT-2's layers), split along the same features, so the parameter keeps the shape
and name a checkpoint of the model has.

Every split weight carries a :class:`~zerotrain.parallel.slices.TensorSlice` as `tp_slice`.
Collectives go through a :class:`~zerotrain.comm.Comm` over the tensor-parallel group.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import Comm
from .slices import TensorSlice, split_slice

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "copy_to_tensor_parallel",
           "reduce_from_tensor_parallel", "gather_from_tensor_parallel", "scatter_to_tensor_parallel"]


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; backward sums the input gradient over the group (every rank used the
    whole input to compute only its slice of the output)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """Sum partial results over the group forward; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _gather_last_dim(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Every rank's last-dimension slice, concatenated in rank order."""
    x = x.contiguous()
    stacked = torch.empty(comm.size * x.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather(stacked, x.view(-1))
    stacked = stacked.view((comm.size,) + tuple(x.shape))
    return stacked.movedim(0, -2).reshape(*x.shape[:-1], comm.size * x.shape[-1])


class _GatherFromRegion(torch.autograd.Function):
    """Concatenate every rank's last-dimension slice forward; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm, ctx.local = comm, x.shape[-1]
        return _gather_last_dim(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.comm.rank * ctx.local
        return grad.narrow(-1, start, ctx.local).contiguous(), None


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's last-dimension slice of a whole (replicated) input forward; backward
    gathers every rank's slice of the gradient, so each rank holds the whole input gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        local = x.shape[-1] // comm.size
        return x.narrow(-1, comm.rank * local, local).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_last_dim(grad, ctx.comm), None


def copy_to_tensor_parallel(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _CopyToRegion.apply(x, comm) if comm.size > 1 else x


def reduce_from_tensor_parallel(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, comm) if comm.size > 1 else x


def gather_from_tensor_parallel(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _GatherFromRegion.apply(x, comm) if comm.size > 1 else x


def scatter_to_tensor_parallel(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _ScatterToRegion.apply(x, comm) if comm.size > 1 else x


def _sliced_parameter(full: torch.Tensor, tensor_slice: Optional[TensorSlice]) -> nn.Parameter:
    data = full.detach() if tensor_slice is None else tensor_slice.take(full.detach())
    param = nn.Parameter(data.clone(), requires_grad=full.requires_grad)
    if tensor_slice is not None:
        param.tp_slice = tensor_slice
    return param


class ColumnParallelLinear(nn.Module):
    """`y = x Wᵀ + b` with W's rows (output features) split over the group.

    `parts` > 1 splits each of that many equal blocks of outputs separately (fused q/k/v), so
    each rank gets whole heads of every block. `gather_output` returns the full output.
    `transposed`: the weight is stored `[in, out]` (transformers' `Conv1D`)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], comm: Comm, *,
                 parts: int = 1, gather_output: bool = False, name: str = "ColumnParallelLinear",
                 transposed: bool = False):
        super().__init__()
        if gather_output and parts != 1:
            raise ValueError(f"{name}: gather_output needs parts=1 (a fused output would come back reordered)")
        self.comm, self.gather_output, self.transposed = comm, gather_output, transposed
        out_dim = 1 if transposed else 0
        weight_slice = split_slice(tuple(weight.shape), out_dim, comm.rank, comm.size, parts, what=f"{name}.weight")
        self.weight = _sliced_parameter(weight, weight_slice)
        self.bias = None if bias is None else _sliced_parameter(
            bias, split_slice(tuple(bias.shape), 0, comm.rank, comm.size, parts, what=f"{name}.bias"))
        self.out_features, self.in_features = weight.shape[out_dim], weight.shape[1 - out_dim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.transposed else self.weight
        y = F.linear(copy_to_tensor_parallel(x, self.comm), weight, self.bias)
        return gather_from_tensor_parallel(y, self.comm) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """`y = x Wᵀ + b` with W's columns (input features) split over the group; the input is
    already split the same way (the output of a column-parallel layer), or with `split_input`
    whole on every rank, and each rank takes its slice. `parts` > 1: the input features are that
    many equal blocks (a packed input), each split separately. The bias is whole on every rank
    and added once, after the sum. `transposed`: the weight is stored `[in, out]` (`Conv1D`)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], comm: Comm, *,
                 name: str = "RowParallelLinear", transposed: bool = False, parts: int = 1,
                 split_input: bool = False):
        super().__init__()
        if split_input and parts != 1:
            raise ValueError(f"{name}: split_input needs parts=1")
        self.comm, self.transposed, self.split_input = comm, transposed, split_input
        in_dim = 0 if transposed else 1
        self.weight = _sliced_parameter(weight, split_slice(tuple(weight.shape), in_dim, comm.rank, comm.size, parts,
                                                            what=f"{name}.weight"))
        self.bias = None if bias is None else _sliced_parameter(bias, None)
        self.in_features, self.out_features = weight.shape[in_dim], weight.shape[1 - in_dim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input:
            x = scatter_to_tensor_parallel(x, self.comm)
        weight = self.weight.t() if self.transposed else self.weight
        y = reduce_from_tensor_parallel(F.linear(x, weight), self.comm)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding table with its rows (the vocabulary) split over the group."""

    def __init__(self, weight: torch.Tensor, comm: Comm, *, name: str = "VocabParallelEmbedding"):
        super().__init__()
        self.comm = comm
        tensor_slice = split_slice(tuple(weight.shape), 0, comm.rank, comm.size, what=f"{name}.weight")
        self.weight = _sliced_parameter(weight, tensor_slice)
        (self.vocab_start, self.vocab_local), = tensor_slice.pieces
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.vocab_local)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel(rows, self.comm)
