"""The memory timeline (`zerotrain.monitor.MemoryTimeline`) on its own, as a benchmark script uses it: samples
every interval and at every phase boundary, nested phases, the step count, the engine's timers as the source of
phase markers, and the plot of a directory holding timelines alone."""
from __future__ import annotations

import json
import mmap
import time

import torch

from zerotrain.monitor import MemoryTimeline, WallClockTimers
from zerotrain.plots import plot_memory_timelines, read_memory_timeline


def test_phases_nest_steps_count_and_a_plot_per_rank(tmp_path):
    timers = WallClockTimers(enabled=False, device=torch.device("cpu"))
    with MemoryTimeline(tmp_path, rank=3, interval_s=0.005) as timeline:
        timers.listener = timeline
        with timers("fwd"):
            with timers.phase("gather"):
                # 64 MiB of fresh pages while gathered: an anonymous mapping written through, so RSS grows whatever
                # the allocator holds already (a torch tensor may reuse resident heap pages late in a test run)
                held = mmap.mmap(-1, 64 << 20)
                held.write(b"\x01" * (64 << 20))
                time.sleep(0.03)
            held.close()
        with timers("step"):
            pass
        timers.close_step()
        with timeline.phase("custom"):
            time.sleep(0.02)
    timeline.close()  # idempotent
    header, samples = read_memory_timeline(tmp_path / "memory_timeline.rank3.jsonl")
    assert header["rank"] == 3 and header["device"] == "cpu"
    marks = [(s["event"], s["boundary"], s["phase"]) for s in samples if "event" in s]
    assert marks == [("begin", "forward", "forward"), ("begin", "gather", "gather"), ("end", "gather", "gather"),
                     ("end", "forward", "forward"), ("begin", "optimizer step", "optimizer step"),
                     ("end", "optimizer step", "optimizer step"), ("begin", "custom", "custom"),
                     ("end", "custom", "custom")]
    inside = [s for s in samples if "event" not in s and s["phase"] == "gather"]
    assert inside, "the sampler thread ran during the 30 ms gather"
    ends = {s["boundary"]: s for s in samples if s.get("event") == "end"}
    assert ends["gather"]["rss"] - samples[0]["rss"] > 32 << 20, "the 64 MiB held in the gather shows in RSS"
    assert ends["forward"]["step"] == 0 and ends["custom"]["step"] == 1
    assert plot_memory_timelines(tmp_path, tmp_path / "plots") == [tmp_path / "plots" / "memory_timeline_rank3.png"]
    assert json.loads((tmp_path / "memory_timeline.rank3.jsonl").read_text().splitlines()[0])["interval_s"] == 0.005


def test_a_sample_carries_the_innermost_open_phase_whatever_order_phases_end_in(tmp_path):
    """Explicit samples (the thread's interval is far away): the phase of each is the innermost still open; an end
    closes the innermost phase of that name, also when phases end out of order or a name is open twice."""
    with MemoryTimeline(tmp_path, interval_s=600) as timeline:
        phases = []

        def sample_phase():
            timeline.sample()
            phases.append(json.loads(timeline._lines[-1])["phase"])

        timeline.begin("forward")
        timeline.begin("gather")
        timeline.end("gather")
        sample_phase()  # forward
        timeline.begin("gather")
        timeline.end("forward")  # out of order: gather stays open
        sample_phase()  # gather
        timeline.begin("save")
        timeline.begin("gather")
        timeline.end("gather")  # the inner gather: save is innermost again
        sample_phase()  # save
        timeline.end("save")
        timeline.end("gather")
        timeline.end("never begun")  # nothing to close
        sample_phase()  # None
        timeline.flush()
        timeline.flush()  # nothing new: nothing written
    assert phases == ["forward", "gather", "save", None]
    lines = (tmp_path / "memory_timeline.rank0.jsonl").read_text().splitlines()
    assert all(json.loads(line) for line in lines) and len(lines) == 1 + 11 + 4 + 1  # header, 11 marks, 4 samples, close


def test_times_are_microseconds_since_the_start_and_the_file_is_written_each_second(tmp_path, monkeypatch):
    """One clock the test moves: `t` is rounded to the microsecond; the sampler thread writes its samples to the
    file once a second (a run that dies keeps all but the last second), not at every sample."""
    from types import SimpleNamespace

    import zerotrain.monitor.memory_timeline as module

    now = [100.0]
    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: now[0], time=time.time))
    timeline = MemoryTimeline(tmp_path, interval_s=0.002)
    try:
        path = tmp_path / "memory_timeline.rank0.jsonl"
        now[0] = 100.0 + 0.23456789  # under a second: the thread (its own start read 100.0 or this) waits
        timeline.sample()
        assert json.loads(timeline._lines[-1])["t"] == 0.234568
        time.sleep(0.2)  # about a hundred samples of the thread, all within the same second of the clock
        assert path.read_text() == "", "nothing written (not even the buffered header) before a second passed"
        now[0] += 1.0
        deadline = time.monotonic() + 30
        while len(path.read_text().splitlines()) <= 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(path.read_text().splitlines()) > 2, "a second later the thread wrote its samples"
    finally:
        timeline.close()


def test_host_rss_is_the_processes_resident_memory_and_the_peak_without_proc(monkeypatch):
    import resource

    import psutil

    import zerotrain.monitor.memory_timeline as module

    rss = module.host_rss()
    assert abs(rss - psutil.Process().memory_info().rss) < 16 << 20  # /proc/self/statm's resident pages

    def no_proc(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(module, "open", no_proc, raising=False)  # a system without /proc: the peak (ru_maxrss, KiB)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = module.host_rss()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert before <= peak <= after and peak % 1024 == 0
