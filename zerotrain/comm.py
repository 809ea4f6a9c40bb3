"""The only module that calls torch.distributed collectives.

Every collective goes through a :class:`Comm`, which counts what it moves so that
tests and benchmarks can check communication volume against theory. Bytes are
counted as a ring algorithm sends them from one rank: an all-reduce of S bytes
sends 2·S·(N−1)/N, a reduce-scatter or all-gather of a full buffer of S bytes
sends S·(N−1)/N. In a world of one nothing is sent and nothing is counted.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .topology import Topology

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommCounters:
    """Calls and bytes sent per collective kind since start."""

    calls: dict = field(default_factory=lambda: defaultdict(int))
    bytes: dict = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, nbytes: float) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += int(nbytes)

    def snapshot(self) -> dict:
        return {kind: {"calls": self.calls[kind], "bytes": self.bytes[kind]} for kind in sorted(self.calls)}


class _Done:
    """A finished handle, so callers can wait() uniformly in a world of one."""

    def wait(self) -> bool:
        return True


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Comm:
    """Collectives over one process group, with byte counters."""

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, size: int,
                 counters: Optional[CommCounters] = None):
        self.group = group
        self.rank = rank
        self.size = size
        self.counters = counters if counters is not None else CommCounters()

    @classmethod
    def data_parallel(cls, topology: Topology, counters: Optional[CommCounters] = None) -> "Comm":
        return cls(topology.dp_group, topology.dp_rank, topology.dp_size, counters)

    def _ring_fraction(self) -> float:
        return (self.size - 1) / self.size

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False):
        """In-place all-reduce of `tensor`."""
        if self.size == 1:
            return _Done() if async_op else None
        self.counters.add("all_reduce", 2 * _nbytes(tensor) * self._ring_fraction())
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Sum `input` (size·len(output) elements) across ranks; this rank keeps chunk `rank` in `output`."""
        if self.size == 1:
            output.copy_(input)
            return _Done() if async_op else None
        self.counters.add("reduce_scatter", _nbytes(input) * self._ring_fraction())
        return _reduce_scatter_single(output, input, group=self.group, async_op=async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Concatenate every rank's `input` into `output` (in-place when input is output's own chunk)."""
        if self.size == 1:
            if input.data_ptr() != output.data_ptr():
                output.copy_(input)
            return _Done() if async_op else None
        self.counters.add("all_gather", _nbytes(output) * self._ring_fraction())
        return _all_gather_single(output, input, group=self.group, async_op=async_op)

    def gather_to(self, tensor: torch.Tensor, dst: int = 0) -> Optional[list[torch.Tensor]]:
        """Collect every rank's `tensor` (same shape everywhere) on `dst`; None elsewhere."""
        if self.size == 1:
            return [tensor]
        self.counters.add("gather", _nbytes(tensor) if self.rank != dst else 0)
        gathered = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == dst else None
        dst_global = dist.get_global_rank(self.group, dst) if self.group is not None else dst
        dist.gather(tensor, gathered, dst=dst_global, group=self.group)
        return gathered

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.size == 1:
            return
        self.counters.add("broadcast", _nbytes(tensor) if self.rank == src else 0)
        src_global = dist.get_global_rank(self.group, src) if self.group is not None else src
        dist.broadcast(tensor, src=src_global, group=self.group)

    def any_true(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when `flag` is true on at least one (used for overflow agreement)."""
        value = torch.tensor([1.0 if flag else 0.0], device=device)
        self.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item() > 0)

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a one-element tensor over ranks (e.g. squared gradient norms of the shards)."""
        self.all_reduce(value)
        return value
