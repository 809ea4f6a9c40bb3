"""The engine's wall-clock timers (`"wall_clock_breakdown": true`), named as DeepSpeed names its global ones.

`fwd` (forward), `bwd` (backward, all of it), `bwd_inner` (the autograd backward), `bwd_allreduce` (the
gradient reduction finished after it), `step` (`engine.step()`). Each accumulates over the micro-steps of
one optimizer step; at the step's end the engine calls `close_step()`, which keeps the totals in ms for
`engine.get_wall_clock_timers()` and starts the next step at zero (DeepSpeed logs and resets them there
too). On CUDA the device is synchronized at each start and stop, so a timer measures the work and not the
launch; disabled timers cost nothing.

A `listener` (a `MemoryTimeline`, `engine.watch_memory`) is told where each timed region begins and ends,
timers enabled or not, under its phase name (`memory_timeline.PHASE_OF_TIMER`); `phase(name)` marks a
region for the listener alone (a stage-3 gather, a save), untimed.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

from .memory_timeline import PHASE_OF_TIMER

__all__ = ["WallClockTimers", "TIMER_NAMES"]

TIMER_NAMES = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")


class WallClockTimers:
    """Accumulating timers by name; `last` holds the previous optimizer step's totals in milliseconds."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = bool(enabled)
        self._sync = device.type == "cuda"
        self._device = device
        self._running: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.listener = None  # told of every region's begin and end (a MemoryTimeline); None: nobody

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        listener = self.listener
        if listener is not None:
            listener.begin(PHASE_OF_TIMER.get(name, name))
        try:
            if not self.enabled:
                yield
                return
            self._synchronize()
            start = time.perf_counter()
            try:
                yield
            finally:
                self._synchronize()
                self._running[name] = self._running.get(name, 0.0) + (time.perf_counter() - start) * 1000.0
        finally:
            if listener is not None:
                listener.end(PHASE_OF_TIMER.get(name, name))

    def phase(self, name: str):
        """A region the listener is told of (untimed); a no-op context without a listener."""
        listener = self.listener
        if listener is None:
            return contextlib.nullcontext()
        return listener.phase(PHASE_OF_TIMER.get(name, name))

    def close_step(self) -> None:
        """An optimizer step ended: its totals become `last` (every timer present, 0 if unused)."""
        if self.enabled:
            self.last = {name: self._running.get(name, 0.0) for name in TIMER_NAMES}
            self._running = {}
        if self.listener is not None:
            self.listener.step_done()

    def _synchronize(self) -> None:
        if self._sync:
            torch.cuda.synchronize(self._device)
