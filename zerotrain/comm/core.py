"""Collectives with byte counters: the only code that calls torch.distributed collectives.

Every collective goes through a :class:`Comm`, which counts what it moves so that
tests and benchmarks can check communication volume against theory. Bytes are
counted as a ring algorithm sends them from one rank: an all-reduce of S bytes
sends 2·S·(N−1)/N, a reduce-scatter or all-gather of a full buffer of S bytes
sends S·(N−1)/N. In a world of one nothing is sent and nothing is counted.

A collective that fails (a peer died, or did not answer within the group's
timeout) raises :class:`CollectiveError` naming the collective and this rank,
whether it fails at the call or at the handle's `wait()`.
"""
from __future__ import annotations

import datetime
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..topology import Topology

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommCounters:
    """Calls and bytes sent per collective kind since start.

    Compressed collectives (kinds ending in `_q4` / `_q8`, see `zerotrain.comm.compressed`)
    also count `logical_bytes`: what the same collective would have sent uncompressed, in the
    data's own dtype, so `bytes / logical_bytes` is the compression ratio on the wire.
    """

    calls: dict = field(default_factory=lambda: defaultdict(int))
    bytes: dict = field(default_factory=lambda: defaultdict(int))
    logical: dict = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, nbytes: float, logical_bytes: Optional[float] = None) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += int(nbytes)
        if logical_bytes is not None:
            self.logical[kind] += int(logical_bytes)

    def snapshot(self) -> dict:
        out = {}
        for kind in sorted(self.calls):
            entry = {"calls": self.calls[kind], "bytes": self.bytes[kind]}
            if kind in self.logical:
                entry["logical_bytes"] = self.logical[kind]
            out[kind] = entry
        return out


class CollectiveError(RuntimeError):
    """A collective did not complete: a peer rank died or did not answer within the group's timeout."""


def _failure(kind: str, rank: int, size: int, error: BaseException) -> CollectiveError:
    return CollectiveError(f"{kind} failed on rank {rank} of {size} (did a peer rank die, or not answer "
                           f"within comm_timeout_seconds?): {error}")


class _Named:
    """A collective's handle whose wait() names the collective when it fails."""

    def __init__(self, work, kind: str, rank: int, size: int):
        self._work, self._kind, self._rank, self._size = work, kind, rank, size

    def wait(self, *args, **kwargs):
        try:
            return self._work.wait(*args, **kwargs)
        except RuntimeError as error:
            raise _failure(self._kind, self._rank, self._size, error) from error

    def __getattr__(self, name):
        return getattr(self._work, name)


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

    def _call(self, kind: str, collective, *args, async_op: bool = False, **kwargs):
        """Run a torch.distributed collective, naming it in any failure (sync, or at the handle's wait)."""
        try:
            work = collective(*args, async_op=async_op, **kwargs)
        except RuntimeError as error:
            raise _failure(kind, self.rank, self.size, error) from error
        return _Named(work, kind, self.rank, self.size) if async_op else work

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False):
        """In-place all-reduce of `tensor`."""
        if self.size == 1:
            return _Done() if async_op else None
        self.counters.add("all_reduce", 2 * _nbytes(tensor) * self._ring_fraction())
        return self._call("all_reduce", dist.all_reduce, tensor, op=op, group=self.group, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Sum `input` (size·len(output) elements) across ranks; this rank keeps chunk `rank` in `output`."""
        if self.size == 1:
            output.copy_(input)
            return _Done() if async_op else None
        self.counters.add("reduce_scatter", _nbytes(input) * self._ring_fraction())
        return self._call("reduce_scatter", _reduce_scatter_single, output, input, group=self.group,
                          async_op=async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, *,
                   kind: str = "all_gather", logical_bytes: Optional[float] = None):
        """Concatenate every rank's `input` into `output` (in-place when input is output's own chunk).

        `kind` names the counter (e.g. "all_gather_q8" for quantized weights); `logical_bytes`,
        when given, is what the uncompressed gather of the whole output would have sent.
        """
        if self.size == 1:
            if input.data_ptr() != output.data_ptr():
                output.copy_(input)
            return _Done() if async_op else None
        fraction = self._ring_fraction()
        self.counters.add(kind, _nbytes(output) * fraction,
                          None if logical_bytes is None else logical_bytes * fraction)
        return self._call(kind, _all_gather_single, output, input, group=self.group, async_op=async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, *,
                   kind: str = "all_to_all", logical_bytes: Optional[float] = None):
        """Equal-split all-to-all: row r of `input` (size rows along dim 0) goes to rank r; row r of
        `output` comes from rank r. Counts the rows sent to other ranks; `logical_bytes` is the
        uncompressed size of the whole input (counted with the same (N-1)/N fraction)."""
        if input.shape[0] != self.size or output.shape != input.shape:
            raise ValueError(f"all_to_all needs input and output of {self.size} equal rows, got "
                             f"{tuple(input.shape)} and {tuple(output.shape)}")
        if self.size == 1:
            if input.data_ptr() != output.data_ptr():
                output.copy_(input)
            return _Done() if async_op else None
        fraction = self._ring_fraction()
        self.counters.add(kind, _nbytes(input) * fraction, None if logical_bytes is None else logical_bytes * fraction)
        return self._call(kind, dist.all_to_all_single, output, input, group=self.group, async_op=async_op)

    def gather_to(self, tensor: torch.Tensor, dst: int = 0) -> Optional[list[torch.Tensor]]:
        """Collect every rank's `tensor` (same shape everywhere) on `dst`; None elsewhere."""
        if self.size == 1:
            return [tensor]
        self.counters.add("gather", _nbytes(tensor) if self.rank != dst else 0)
        gathered = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == dst else None
        dst_global = dist.get_global_rank(self.group, dst) if self.group is not None else dst
        self._call("gather", dist.gather, tensor, gathered, dst=dst_global, group=self.group)
        return gathered

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.size == 1:
            return
        self.counters.add("broadcast", _nbytes(tensor) if self.rank == src else 0)
        src_global = dist.get_global_rank(self.group, src) if self.group is not None else src
        self._call("broadcast", dist.broadcast, tensor, src=src_global, group=self.group)

    def any_true(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when `flag` is true on at least one (used for overflow agreement)."""
        value = torch.tensor([1.0 if flag else 0.0], device=device)
        self.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item() > 0)

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a one-element tensor over ranks (e.g. squared gradient norms of the shards)."""
        self.all_reduce(value)
        return value

    # --- checkpoint I/O (used by zerotrain.checkpoint) --------------------------------------------
    def new_cpu_comm(self, timeout_seconds: Optional[float] = None) -> "Comm":
        """A Comm over the same ranks on a new gloo group, with its own counters.

        Checkpoint writers exchange host tensors and status through it, from a background
        thread while training keeps using this Comm. Collective: every rank of the default
        group must call it, in the same order as any other group creation.
        """
        if self.size == 1:
            return Comm(None, self.rank, 1, CommCounters())
        ranks = None if self.group in (None, dist.group.WORLD) else dist.get_process_group_ranks(self.group)
        timeout = None if timeout_seconds is None else datetime.timedelta(seconds=timeout_seconds)
        group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        return Comm(group, self.rank, self.size, CommCounters())

    def all_gather_object(self, obj) -> list:
        """Every rank's picklable `obj`, in rank order (small metadata only)."""
        if self.size == 1:
            return [obj]
        gathered: list = [None] * self.size
        self.counters.add("all_gather_object", 0)
        self._call("all_gather_object", lambda out, o, async_op=False, **kw: dist.all_gather_object(out, o, **kw),
                   gathered, obj, group=self.group)
        return gathered

    def all_to_all_bytes(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                         input_splits: list[int]) -> None:
        """Uneven all-to-all of 1-D uint8 tensors: chunk r of `input` goes to rank r (sizes by the splits)."""
        if self.size == 1:
            if output.numel():
                output.copy_(input)
            return
        self.counters.add("all_to_all", sum(input_splits) - input_splits[self.rank])
        self._call("all_to_all", dist.all_to_all_single, output, input, output_splits, input_splits,
                   group=self.group)
