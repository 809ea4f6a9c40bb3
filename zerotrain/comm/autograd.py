"""Collectives that autograd differentiates through.

`all_gather_with_grad(comm, x)`: every rank's `x` concatenated along dim 0, in rank order. Its
backward is the exact gradient of a loss summed over ranks: the gradient of the gathered tensor
is reduce-scattered (summed over ranks, each rank keeping the rows of its own `x`). A contrastive
loss that scores this rank's queries against every rank's candidates (`zerotrain.embedding`) thus
gets, after the engine averages gradients over data-parallel ranks, the gradient of the mean loss
over the global batch, the same as one process holding the whole batch.
"""
from __future__ import annotations

import torch

from .core import Comm

__all__ = ["all_gather_with_grad"]


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
