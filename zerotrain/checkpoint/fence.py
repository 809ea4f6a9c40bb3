"""The fence between a deferred snapshot copy and anything that writes the engine's slots.

An asynchronous save on the CPU copies this rank's slots (masters, model shards,
optimizer states) into host buffers in the background writer, after the save call
has returned (see `checkpointer`). Until that copy is done nothing may write those
tensors. The fence is an object, `SnapshotFences`, that the engine owns (one per
engine, no process-wide state) and hands to everything that writes its slots:
its checkpointer opens one `SnapshotFence` per deferred copy; `engine.step()` waits
through the checkpointer; stage 3's partitioned parameters
(`zero.GatheredParameters(modifier_rank=...)`, in-place initializers) and
SuperOffload's in-place speculative step call `wait()` on the fence they were handed
(zero/ and offload/ get the object; they never import this package).
"""
from __future__ import annotations

import threading
import time
from typing import Optional


class SnapshotFence:
    """One pending snapshot copy: `done()` by the writer, `wait()` by whoever writes the slots next."""

    def __init__(self, owner: Optional["SnapshotFences"] = None) -> None:
        self._copied = threading.Event()
        self._owner = owner
        self.waited_seconds: Optional[float] = None  # how long the first wait blocked (0.0: the copy was done)

    def done(self) -> None:
        self._copied.set()
        if self._owner is not None:
            self._owner._closed(self)

    def wait(self) -> float:
        """Block until the copy is done; returns the seconds this call blocked."""
        started = time.perf_counter()
        self._copied.wait()
        waited = time.perf_counter() - started
        if self.waited_seconds is None:
            self.waited_seconds = waited
        return waited


class SnapshotFences:
    """The pending snapshot copies of one engine's slots (what writers of those slots wait for)."""

    def __init__(self) -> None:
        self._pending: set[SnapshotFence] = set()
        self._lock = threading.Lock()

    def open(self) -> SnapshotFence:
        """A new pending copy, done by the writer once its snapshot is taken."""
        fence = SnapshotFence(self)
        with self._lock:
            self._pending.add(fence)
        return fence

    def _closed(self, fence: SnapshotFence) -> None:
        with self._lock:
            self._pending.discard(fence)

    def wait(self) -> None:
        """Wait for every pending copy (call before writing shards, masters or optimizer states)."""
        with self._lock:
            pending = list(self._pending)
        for fence in pending:
            fence.wait()
