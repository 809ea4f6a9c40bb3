"""Reusable flat buffers for stage-3 gathers, so the same memory serves every layer.

A transformer asks for buffers of the same few sizes in every layer, forward and
backward. Allocating each one afresh costs a page fault per 4 KiB on first touch (large
CPU allocations are fresh mappings), which on a CPU run is a visible share of the step.
The pool keeps released buffers by (numel, dtype, device) and hands them out again.

A buffer goes back to the pool only when nothing else still references its storage
(no parameter view, no tensor autograd saved); otherwise it is simply dropped. The pool
keeps at most `limit_bytes` of idle buffers (the largest are dropped first), and
`clear()` empties it — the fetcher does so at the end of every micro-step, so idle
buffers never outlive the backward that used them.
"""
from __future__ import annotations

import torch


def _use_count(tensor: torch.Tensor) -> int:
    """References to the tensor's storage (the temporary storage object counts one)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


_ALONE = _use_count(torch.empty(1))  # the count of a storage held by a single tensor


class BufferPool:
    """Idle 1-D buffers by size, dtype and device."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = max(0, int(limit_bytes))
        self.idle: dict[tuple, list[torch.Tensor]] = {}
        self.idle_bytes = 0
        self.stats = {"reused": 0, "allocated": 0}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized buffer of `numel` elements: an idle one when the pool has it."""
        free = self.idle.get((numel, dtype, device))
        if free:
            buffer = free.pop()
            self.idle_bytes -= _nbytes(buffer)
            self.stats["reused"] += 1
            return buffer
        self.stats["allocated"] += 1
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer whose user is done with it (kept only if nothing else references it)."""
        if buffer._base is not None or buffer.storage_offset() or _use_count(buffer) != _ALONE:
            return
        size = _nbytes(buffer)
        if size > self.limit_bytes:
            return
        while self.idle_bytes + size > self.limit_bytes:
            self._drop_largest()
        self.idle.setdefault((buffer.numel(), buffer.dtype, buffer.device), []).append(buffer)
        self.idle_bytes += size

    def clear(self) -> None:
        self.idle.clear()
        self.idle_bytes = 0

    def _drop_largest(self) -> None:
        key = max((k for k, v in self.idle.items() if v), key=lambda k: k[0] * k[1].itemsize)
        buffer = self.idle[key].pop()
        self.idle_bytes -= _nbytes(buffer)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
