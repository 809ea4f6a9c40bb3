"""`engine.tput_timer` (zerotrain.monitor.ThroughputTimer) counts and times as DeepSpeed 0.19's ThroughputTimer.

Both timers run the same calls on one fake clock (each reads its own module's `time`), so every counter, the
average and the logged line can be compared exactly. In-process, milliseconds.
"""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from zerotrain.monitor import ThroughputTimer


class Clock:
    """A clock that moves only when told: `now` seconds."""

    def __init__(self) -> None:
        self.now = 1000.0


def _numbers(line: str) -> dict[str, float]:
    """The `key=value` numbers of a throughput line (DeepSpeed prints raw floats, zerotrain 3 decimals)."""
    return {key: float(value) for key, value in re.findall(r"(\w+)=([-0-9.e+inf]+)", line)}


@pytest.mark.parametrize("batch_size, start_step, steps_per_output", [(8, 2, 2), (3, 1, 3)])
def test_counts_average_and_log_lines_are_deepspeeds(monkeypatch, batch_size, start_step, steps_per_output):
    from deepspeed.utils import timer as ds_timer

    import zerotrain.monitor.throughput as ours_module

    clock = Clock()
    monkeypatch.setattr(ds_timer, "time", SimpleNamespace(time=lambda: clock.now))
    monkeypatch.setattr(ours_module, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    ds_lines, our_lines = [], []
    ds = ds_timer.ThroughputTimer(SimpleNamespace(enabled=True, synchronized=False), batch_size,
                                  start_step=start_step, steps_per_output=steps_per_output, logging_fn=ds_lines.append)
    ours = ThroughputTimer(batch_size, start_step=start_step, steps_per_output=steps_per_output,
                           logging_fn=our_lines.append)
    # Two epochs of 4 optimizer steps, 2 micro-steps each (the second micro-step ends the step); the micro-steps
    # take different times, and a stop() without its start() is ignored by both.
    durations = iter([0.5, 1.5, 0.25, 0.75, 2.0, 1.0, 0.125, 0.375, 1.25, 0.5, 3.0, 1.0, 0.5, 0.5, 0.25, 2.75])
    averages = []
    for epoch in range(2):
        if epoch:  # a program that never calls update_epoch_count counts the first epoch's micro-steps from zero
            for timer in (ds, ours):
                timer.update_epoch_count()
        for step in range(4):
            for micro in range(2):
                for timer in (ds, ours):
                    timer.start()
                clock.now += next(durations)
                for timer in (ds, ours):  # DeepSpeed's engine: stop() after a micro-step, stop(global_step=True)
                    timer.stop(global_step=True) if micro == 1 else timer.stop()  # after the optimizer step
                clock.now += 10.0  # time between spans is never counted
                fields = ("epoch_count", "micro_step_count", "global_step_count", "total_elapsed_time",
                          "step_elapsed_time")
                assert [getattr(ours, f) for f in fields] == pytest.approx([getattr(ds, f) for f in fields]), \
                    (epoch, step, micro)
            if ds.global_step_count > start_step:
                assert ours.avg_samples_per_sec() == pytest.approx(ds.avg_samples_per_sec(), rel=1e-12)
                averages.append(ours.avg_samples_per_sec())
            else:  # DeepSpeed divides by zero (or a negative count) here; zerotrain says 0
                assert ours.avg_samples_per_sec() == 0.0
        ours.stop(global_step=True)  # no span open: nothing counted
        ds.stop(global_step=True)
        assert ours.global_step_count == ds.global_step_count == 4 * (epoch + 1)
    assert len(set(averages)) > 1, "the average moved as the steps took different times"
    assert len(our_lines) == len(ds_lines) == 8 // steps_per_output - (start_step >= steps_per_output)
    for got, want in zip(our_lines, ds_lines):
        got_numbers, want_numbers = _numbers(got), _numbers(want)
        for key in ("epoch", "micro_step", "global_step", "RunningAvgSamplesPerSec", "CurrSamplesPerSec"):
            assert got_numbers[key] == pytest.approx(want_numbers[key], abs=5e-4), (key, got, want)
    # without steps_per_output (the engine's own timer) nothing is logged, and report_speed=False silences it too
    quiet = ThroughputTimer(batch_size, start_step=0, steps_per_output=None, logging_fn=our_lines.append)
    muted = ThroughputTimer(batch_size, start_step=0, steps_per_output=1, logging_fn=our_lines.append)
    before = len(our_lines)
    for timer in (quiet, muted):
        timer.start()
        clock.now += 1.0
        timer.stop(global_step=True, report_speed=False if timer is muted else True)
    assert len(our_lines) == before
    assert quiet.avg_samples_per_sec() == muted.avg_samples_per_sec() == batch_size  # 1 step of 1 s


def test_batch_size_none_or_zero_counts_one_sample_per_step():
    from deepspeed.utils.timer import ThroughputTimer as DeepSpeedTimer

    assert ThroughputTimer(None).batch_size == DeepSpeedTimer(SimpleNamespace(), None).batch_size == 1
    assert ThroughputTimer(0).batch_size == 1
    assert ThroughputTimer(12).batch_size == 12
    assert (ThroughputTimer(4).start_step, ThroughputTimer(4).steps_per_output) == (2, None)  # DeepSpeed's defaults
