"""The recorded order of stage-3 gather requests, and what it says about the future.

The first micro-step records every gather request (one entry per module forward, per
parameter unpacked in backward, per access outside a module), keyed by the parameters
it names. Later micro-steps follow the record with a cursor; a request that does not
match turns the record off until the next micro-step, so a dynamic model only loses
prefetching and reuse, never correctness; `mismatches` counts such micro-steps.

From the record the fetcher asks two questions:

- what comes next (prefetch): the entries from the cursor on;
- how soon a parameter is used again (`stage3_max_reuse_distance`, DeepSpeed's
  semantics): the number of parameter elements requested between now and its next
  use. A parameter whose reuse distance is below the limit is not released after use.
"""
from __future__ import annotations

import bisect
from typing import Optional


class FetchTrace:
    """Gather requests of one micro-step: recorded once, then followed."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, ...]] = []  # the id(part) of each request's parameters
        self.reasons: list[str] = []  # "forward" / "backward" / "recompute" / "access" / "user", per entry
        self.recording = True
        self.cursor = 0  # entries [0, cursor) have been requested this micro-step
        self.in_order = True
        self.mismatches = 0  # micro-steps whose requests left the record (each counted once)
        self._sizes: list[int] = []  # elements requested by each entry
        self._prefix: list[int] = [0]  # elements requested before entry i
        self._uses: dict[int, list[int]] = {}  # id(part) -> entry positions that request it

    @property
    def usable(self) -> bool:
        """True while this micro-step follows the record (prefetch and reuse may rely on it)."""
        return not self.recording and self.in_order

    def begin_micro_step(self) -> None:
        self.cursor = 0
        self.in_order = True

    def end_micro_step(self) -> None:
        """Close the recording after the first micro-step and index it."""
        if not self.recording:
            return
        self.recording = False
        for position, (key, size) in enumerate(zip(self.entries, self._sizes)):
            self._prefix.append(self._prefix[-1] + size)
            for part_id in key:
                self._uses.setdefault(part_id, []).append(position)

    def follow(self, key: tuple[int, ...], reason: str, numel: int) -> None:
        """Record a request (first micro-step) or check it against the record."""
        if self.recording:
            self.entries.append(key)
            self.reasons.append(reason)
            self._sizes.append(numel)
            return
        if self.in_order and self.cursor < len(self.entries) and self.entries[self.cursor] == key:
            self.cursor += 1
        elif self.in_order:
            self.in_order = False
            self.mismatches += 1

    def next_use(self, part_id: int, start: Optional[int] = None) -> Optional[int]:
        """The first entry at or after `start` (default: the cursor) that requests the parameter."""
        uses = self._uses.get(part_id)
        if not uses:
            return None
        start = self.cursor if start is None else start
        index = bisect.bisect_left(uses, start)
        return uses[index] if index < len(uses) else None

    def reuse_distance(self, part_id: int) -> Optional[int]:
        """Parameter elements requested from the cursor until the parameter's next use (None: no reuse)."""
        position = self.next_use(part_id)
        if position is None:
            return None
        return self._prefix[position] - self._prefix[self.cursor]
