"""`checkpoint.fence` in-process (issue #48): a writer of the slots waits for every pending snapshot copy and no
longer than the last one; a fence records its first wait only; a done copy leaves the pending set."""
from __future__ import annotations

import threading

from zerotrain.checkpoint.fence import SnapshotFence, SnapshotFences


def _waiter(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_the_engines_wait_blocks_until_every_pending_copy_is_done():
    fences = SnapshotFences()
    first, second = fences.open(), fences.open()
    waiting = _waiter(fences.wait)
    waiting.join(0.5)
    assert waiting.is_alive()  # both copies pending
    first.done()
    waiting.join(0.5)
    assert waiting.is_alive()  # one still pending
    second.done()
    waiting.join(10)
    assert not waiting.is_alive()
    assert fences._pending == set()  # done copies leave the set: the next wait has nothing to wait for
    later = fences.open()
    assert fences._pending == {later}
    later.done()
    fences.wait()


def test_a_fence_records_its_first_wait_and_returns_each():
    fence = SnapshotFence()
    assert fence.waited_seconds is None
    results = []
    waiting = _waiter(lambda: results.append(fence.wait()))
    waiting.join(0.3)
    assert waiting.is_alive()
    fence.done()
    waiting.join(10)
    first = results[0]
    assert first > 0 and fence.waited_seconds == first
    again = fence.wait()  # the copy is done: no block, and the record stays the first wait's
    assert 0 <= again < first and fence.waited_seconds == first
