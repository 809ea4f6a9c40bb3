"""The fence between a deferred snapshot copy and anything that writes the engine's slots.

An asynchronous save on the CPU copies this rank's slots (masters, model shards,
optimizer states) into host buffers in the background writer, after the save call
has returned (see `checkpointer`). Until that copy is done nothing may write those
tensors. `engine.step()` fences through its checkpointer; code outside the engine
that writes shards or masters (`zero.GatheredParameters(modifier_rank=...)`) calls
`fence_snapshots()`, which waits for every pending copy in this process: such code
does not know which engine owns a parameter, and waiting for another engine's copy
only costs the rest of that copy.
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import Optional

_pending: "weakref.WeakSet[SnapshotFence]" = weakref.WeakSet()
_lock = threading.Lock()


class SnapshotFence:
    """One pending snapshot copy: `done()` by the writer, `wait()` by whoever writes the slots next."""

    def __init__(self) -> None:
        self._copied = threading.Event()
        self.waited_seconds: Optional[float] = None  # how long the first wait blocked (0.0: the copy was done)
        with _lock:
            _pending.add(self)

    def done(self) -> None:
        self._copied.set()
        with _lock:
            _pending.discard(self)

    def wait(self) -> float:
        """Block until the copy is done; returns the seconds this call blocked."""
        started = time.perf_counter()
        self._copied.wait()
        waited = time.perf_counter() - started
        if self.waited_seconds is None:
            self.waited_seconds = waited
        return waited


def fence_snapshots() -> None:
    """Wait for every pending deferred snapshot copy in this process (call before writing shards or masters)."""
    with _lock:
        pending = list(_pending)
    for fence in pending:
        fence.wait()
