"""`ThroughputTimer`: DeepSpeed's `engine.tput_timer` (samples per second over timed micro-steps).

DeepSpeed-Chat calls `engine.tput_timer.update_epoch_count()` at each epoch; other programs call
`start()` / `stop(global_step=...)` around their own steps and read `avg_samples_per_sec()`. The engine
holds one and drives it as DeepSpeed's does (each training forward starts a span, each `step()` ends it), without
DeepSpeed's every-`steps_per_print` line: the engine's own line and the metrics records carry the speed
(docs/metrics.md).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

__all__ = ["ThroughputTimer"]


class ThroughputTimer:
    """Counts epochs, micro-steps and global steps; times the spans between `start()` and `stop()` after the
    first `start_step` global steps (warm-up) and reports samples per second of `batch_size` per global step."""

    def __init__(self, batch_size: int, start_step: int = 2, steps_per_output: Optional[int] = None,
                 logging_fn: Optional[Callable[[str], None]] = None) -> None:
        self.batch_size = max(1, int(batch_size or 1))
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.logging = logging_fn or print
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self.started = False
        self._start_time = 0.0

    def update_epoch_count(self) -> None:
        """A new epoch begins (the micro-step count restarts)."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        self.started = True
        if self.global_step_count >= self.start_step:
            self._start_time = time.perf_counter()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End a timed span; `global_step`: it ended an optimizer step (every `steps_per_output` of them one
        line through `logging_fn` when `report_speed`)."""
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self._start_time:
            elapsed = time.perf_counter() - self._start_time
            self._start_time = 0.0
            self.total_elapsed_time += elapsed
            self.step_elapsed_time += elapsed
            if global_step and report_speed and self.steps_per_output and \
                    self.global_step_count % self.steps_per_output == 0:
                self.logging(f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                             f"global_step={self.global_step_count}, RunningAvgSamplesPerSec="
                             f"{self.avg_samples_per_sec():.3f}, CurrSamplesPerSec="
                             f"{self.batch_size / max(self.step_elapsed_time, 1e-12):.3f}")
            if global_step:
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed global steps (after the warm-up); 0 before any."""
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time <= 0:
            return 0.0
        return self.batch_size * timed_steps / self.total_elapsed_time
