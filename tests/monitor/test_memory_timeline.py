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
