"""An expert-parallel mixture-of-experts layer (top-k routing, no token dropping).

The gate is replicated; the experts are split over the expert-parallel group, each rank
holding `num_experts / ep_size` of them. A forward pass routes every token to its top-k
experts, sends each (token, expert) copy to the rank that owns the expert with one uneven
all-to-all, runs the local experts, sends the results back with a second all-to-all, and
sums them weighted by the gate probabilities. Nothing is dropped (no capacity factor), so
the layer computes exactly what the same layer with every expert local computes: that is
what the tests check. Expert weights carry `ep_slice` (a TensorSlice of the stacked
`(num_experts, ...)` tensor). Build it over the expert-parallel group's Comm,
`comm.subgroup(*topology.expert_parallel_group(ep_size))` (blocks of ep_size consecutive
data-parallel ranks; ep_size may be any divisor of the data-parallel size, the whole of it
included): the ZeRO engine then trains it at stages 0-3, summing each expert's gradient over
the ranks holding the same expert (zerotrain/parallel/experts.py says how, and what is refused).
With tensor parallelism that group is made of the data-parallel ranks of this rank's tensor-parallel
index: the experts are not split by tensor parallelism, every tensor-parallel rank runs the same
experts on the same (all-reduced) input as its peers.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import Comm
from .slices import split_slice

__all__ = ["ExpertParallelMoE"]


def _exchange(comm: Comm, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """Uneven all-to-all of the rows of a 2-D tensor: `send_counts[r]` rows go to rank r."""
    rows = rows.contiguous()
    width = rows.shape[1] * rows.element_size()
    received = torch.empty((sum(recv_counts), rows.shape[1]), dtype=rows.dtype, device=rows.device)
    comm.all_to_all_bytes(received.view(-1).view(torch.uint8), rows.view(-1).view(torch.uint8),
                          [count * width for count in recv_counts], [count * width for count in send_counts])
    return received


class _Exchange(torch.autograd.Function):
    """Differentiable row exchange: the gradient travels back along the same routes."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, comm: Comm, send_counts: list[int], recv_counts: list[int]):
        ctx.comm, ctx.send_counts, ctx.recv_counts = comm, send_counts, recv_counts
        return _exchange(comm, rows, send_counts, recv_counts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(ctx.comm, grad, ctx.recv_counts, ctx.send_counts), None, None, None


class ExpertParallelMoE(nn.Module):
    """`y = Σ_top-k p_e(x) · expert_e(x)`, experts = GELU MLPs split over `comm`'s ranks.

    `forward(x)` takes `(..., d_model)` and returns `(y, aux_loss)`, where `aux_loss` is the
    Switch-Transformer load-balancing loss over this rank's tokens."""

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, comm: Comm, top_k: int = 2):
        super().__init__()
        if num_experts % comm.size:
            raise ValueError(f"ExpertParallelMoE: {num_experts} experts do not split over ep_size={comm.size} "
                             f"expert-parallel ranks (ep_size must divide num_experts)")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"ExpertParallelMoE: top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.comm, self.num_experts, self.top_k = comm, num_experts, top_k
        self.local_experts = num_experts // comm.size
        self.first_expert = comm.rank * self.local_experts
        self.gate = nn.Linear(d_model, num_experts, bias=False)
        shapes = {"w_in": (num_experts, d_hidden, d_model), "b_in": (num_experts, d_hidden),
                  "w_out": (num_experts, d_model, d_hidden), "b_out": (num_experts, d_model)}
        for name, full_shape in shapes.items():
            tensor_slice = split_slice(full_shape, 0, comm.rank, comm.size, what=f"ExpertParallelMoE.{name}")
            param = nn.Parameter(torch.zeros(tensor_slice.local_shape))
            param.ep_slice = tensor_slice
            setattr(self, name, param)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Deterministic per expert, whatever the split: expert e's weights come from a
        generator seeded by (torch's initial seed, e), so every layout initialises alike."""
        base = torch.initial_seed()
        with torch.no_grad():
            for local in range(self.local_experts):
                # Kept below 2**63: torch's default initial seed is a random 64-bit number.
                generator = torch.Generator().manual_seed((base * 1009 + self.first_expert + local) % (1 << 63))
                for weight in (self.w_in, self.w_out):
                    bound = 1.0 / math.sqrt(weight.shape[-1])
                    values = torch.rand(weight.shape[1:], generator=generator) * 2 * bound - bound
                    weight[local].copy_(values)
                self.b_in[local].zero_()
                self.b_out[local].zero_()

    def _experts(self, tokens: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
        out = torch.empty(tokens.shape[0], self.w_out.shape[1], dtype=tokens.dtype, device=tokens.device)
        for e in range(self.local_experts):
            rows = (local_expert == e).nonzero(as_tuple=True)[0]
            hidden = F.gelu(F.linear(tokens[rows], self.w_in[e], self.b_in[e]))
            out[rows] = F.linear(hidden, self.w_out[e], self.b_out[e])
        return out

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(tokens).float(), dim=-1)
        top_p, top_e = probs.topk(self.top_k, dim=-1)
        # One row per (token, choice), ordered by expert so each rank's rows are contiguous.
        expert_of_row = top_e.reshape(-1)
        order = torch.argsort(expert_of_row, stable=True)
        token_of_row = order // self.top_k
        sorted_experts = expert_of_row[order]
        per_expert = torch.bincount(sorted_experts, minlength=self.num_experts)
        send_counts = per_expert.view(self.comm.size, self.local_experts).sum(dim=1)
        if self.comm.size > 1:
            counts = torch.empty_like(send_counts)
            self.comm.all_to_all(counts.view(-1, 1), send_counts.view(-1, 1).contiguous())
            send, recv = send_counts.tolist(), counts.tolist()
            received = _Exchange.apply(tokens[token_of_row], self.comm, send, recv)
            received_expert = _exchange(self.comm, sorted_experts.view(-1, 1), send, recv).view(-1)
        else:
            received, received_expert = tokens[token_of_row], sorted_experts
        expert_out = self._experts(received, received_expert - self.first_expert)
        if self.comm.size > 1:
            expert_out = _Exchange.apply(expert_out, self.comm, recv, send)
        weights = top_p.reshape(-1)[order].unsqueeze(-1).to(expert_out.dtype)
        y = torch.zeros_like(tokens).index_add(0, token_of_row, expert_out * weights)
        # DeepSpeed's top-k load-balancing loss, E * sum_e(tokens routed to e / (N * k) * mean gate probability of
        # e). With no token (an empty micro-batch, or this rank's share of one) both means are over nothing: 0,
        # not DeepSpeed's NaN (its mean over an empty dim), with the graph to the gate kept (a zero gradient).
        fraction = per_expert.to(probs.dtype) / max(1, expert_of_row.numel())
        aux_loss = self.num_experts * (fraction * (probs.sum(dim=0) / max(1, tokens.shape[0]))).sum()
        return y.view(shape), aux_loss

