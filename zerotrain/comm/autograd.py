"""Collectives that autograd differentiates through.

`all_gather_with_grad(comm, x)`: every rank's `x` concatenated along dim 0, in rank order. Its
backward is the exact gradient of a loss summed over ranks: the gradient of the gathered tensor
is reduce-scattered (summed over ranks, each rank keeping the rows of its own `x`). A contrastive
loss that scores this rank's queries against every rank's candidates (`zerotrain.embedding`) thus
gets, after the engine averages gradients over data-parallel ranks, the gradient of the mean loss
over the global batch, the same as one process holding the whole batch.

`all_to_all_with_grad(comm, x, scatter_dim, gather_dim)`: Ulysses' exchange. `x` is cut into
`comm.size` equal chunks along `scatter_dim`, chunk r goes to rank r, and the chunks received are
joined along `gather_dim` in rank order (sequence shards -> head shards and back). Its backward is
the same exchange with the two dims swapped (an all-to-all is a permutation of the pieces).

`all_reduce_with_grad(comm, x)`: the sum over ranks, on every rank; its backward all-reduces the
gradient (each rank's `x` feeds every rank's copy of the sum). A loss summed over a
sequence-parallel group and backpropagated on each of its ranks thus gives each rank the gradient
times the group size, which the engine's average over data × sequence ranks divides back out
(DeepSpeed's Ulysses averages over the same ranks).
"""
from __future__ import annotations

import torch

from .core import Comm

__all__ = ["all_gather_with_grad", "all_to_all_with_grad", "all_reduce_with_grad"]


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        tensor = tensor.contiguous()
        output = tensor.new_empty((comm.size * tensor.shape[0], *tensor.shape[1:]))
        comm.all_gather(output, tensor)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm = ctx.comm
        grad = grad.contiguous()
        output = grad.new_empty((grad.shape[0] // comm.size, *grad.shape[1:]))
        comm.reduce_scatter(output, grad)
        return output, None


def all_gather_with_grad(comm: Comm, tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `tensor` (same shape on each) along dim 0; differentiable (see module doc)."""
    if comm.size == 1:
        return tensor
    return _AllGather.apply(tensor, comm)


def _exchange(comm: Comm, tensor: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    if tensor.shape[scatter_dim] % comm.size:
        raise ValueError(f"all_to_all over {comm.size} ranks: dim {scatter_dim} of shape {tuple(tensor.shape)} "
                         "does not divide")
    # (size, ...) rows: row r is the chunk for rank r
    send = torch.stack(tensor.chunk(comm.size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    comm.all_to_all(received, send, kind="sequence_all_to_all")
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, comm: Comm, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.comm, ctx.dims = comm, (scatter_dim, gather_dim)
        return _exchange(comm, tensor, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(ctx.comm, grad, gather_dim, scatter_dim), None, None, None


def all_to_all_with_grad(comm: Comm, tensor: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `tensor` along `scatter_dim` over the ranks, join what arrives along `gather_dim`; differentiable."""
    if comm.size == 1:
        return tensor
    return _AllToAll.apply(tensor, comm, scatter_dim % tensor.dim(), gather_dim % tensor.dim())


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        output = tensor.clone()
        comm.all_reduce(output)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        ctx.comm.all_reduce(grad)
        return grad, None


def all_reduce_with_grad(comm: Comm, tensor: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's `tensor`, on every rank; differentiable (see module doc)."""
    if comm.size == 1:
        return tensor
    return _AllReduce.apply(tensor, comm)
