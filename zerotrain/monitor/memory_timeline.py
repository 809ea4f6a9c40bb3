"""A per-rank memory timeline: host RSS (and CUDA allocated / reserved on a GPU) over time, with phases.

`MemoryTimeline(directory, rank)` writes `directory/memory_timeline.rank{rank}.jsonl` (docs/metrics.md):
a background thread samples every `interval_s` seconds, and every phase boundary samples too, so a phase
shorter than the interval still shows. Phases are named regions (`with timeline.phase("forward"): ...`);
they nest, and a sample belongs to the innermost one. An engine reports its own phases once told of the
timeline (`engine.watch_memory(timeline)`): forward, backward, gather (waiting for a stage-3 parameter
gather), reduce (waiting for gradient reductions after autograd), optimizer step, save, the same
boundaries as its `wall_clock_breakdown` timers. `zerotrain plot RUN_DIR` draws one PNG per rank.

Standalone (a benchmark script)::

    from zerotrain.monitor import MemoryTimeline
    with MemoryTimeline(out_dir, rank=rank, device=engine.device) as timeline:
        engine.watch_memory(timeline)
        ...train...
        with timeline.phase("my phase"):
            ...
    # later: zerotrain.plots.plot_memory_timelines(out_dir, out_dir / "plots")

Why our own sampler: torch's memory snapshot (`torch.cuda.memory._record_memory_history`) sees only the
CUDA caching allocator, not host memory (where offloaded states and NVMe buffers live), and
`torch.profiler` is far too heavy to leave on for a whole run; psutil is not a dependency, and reading
/proc/self/statm costs microseconds.
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional, Union

import torch

__all__ = ["MemoryTimeline", "timeline_file", "TIMELINE_GLOB", "PHASE_OF_TIMER", "host_rss"]

TIMELINE_GLOB = "memory_timeline.rank*.jsonl"

# The engine's timer names (monitor.timers) -> the timeline's phase names.
PHASE_OF_TIMER = {"fwd": "forward", "bwd": "backward", "bwd_inner": "backward", "bwd_allreduce": "reduce",
                  "step": "optimizer step", "gather": "gather", "save": "save"}

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def timeline_file(directory: Union[str, os.PathLike], rank: int) -> Path:
    """Where rank `rank`'s timeline is written under `directory`."""
    return Path(directory) / f"memory_timeline.rank{rank}.jsonl"


def host_rss() -> int:
    """This process's resident set size now, in bytes (Linux: /proc/self/statm; elsewhere the peak)."""
    try:
        with open("/proc/self/statm", "rb") as handle:
            return int(handle.read().split()[1]) * _PAGE
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


class MemoryTimeline:
    """Samples this rank's memory into a JSON-lines file until `close()` (also a context manager).

    Each line is a sample: `t` (seconds since the start), `rss` (bytes), `cuda_allocated` and
    `cuda_reserved` (bytes, on a CUDA device only), `phase` (the innermost open phase, or null), `step`
    (optimizer steps finished since the timeline started, `step_done()` counts them), and at a phase
    boundary `event` ("begin" / "end") with `boundary` (the phase that begins or ends). The first line
    is a header: `rank`, `device`, `interval_s`, `start_unix`.
    """

    def __init__(self, directory: Union[str, os.PathLike], rank: int = 0,
                 device: Optional[torch.device] = None, interval_s: float = 0.05, step: int = 0):
        if interval_s <= 0:
            raise ValueError(f"MemoryTimeline: interval_s must be > 0, got {interval_s}")
        self.path = timeline_file(directory, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        self.interval_s = float(interval_s)
        self.step = int(step)
        self._stack: list[str] = []
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._start = time.perf_counter()
        self._file = open(self.path, "w", encoding="utf-8")
        self._file.write(json.dumps({"rank": rank, "device": str(self.device), "interval_s": self.interval_s,
                                     "start_unix": time.time()}) + "\n")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"zerotrain-memory-timeline-r{rank}", daemon=True)
        self._thread.start()

    # --- phases ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a region: a sample at its start and at its end, and every sample in between carries `name`."""
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)

    def begin(self, name: str) -> None:
        with self._lock:
            self._stack.append(name)
            self._sample_locked("begin", name)

    def end(self, name: str) -> None:
        with self._lock:
            self._sample_locked("end", name)
            if name in self._stack:  # the innermost one of that name
                del self._stack[len(self._stack) - 1 - self._stack[::-1].index(name)]

    def step_done(self) -> None:
        """An optimizer step finished (the engine calls it at each accumulation boundary)."""
        with self._lock:
            self.step += 1

    # --- sampling ------------------------------------------------------------------------------
    def sample(self) -> None:
        """Take one sample now (the thread does this every `interval_s`)."""
        with self._lock:
            self._sample_locked(None, None)

    def _sample_locked(self, event: Optional[str], boundary: Optional[str]) -> None:
        record = {"t": round(time.perf_counter() - self._start, 6), "rss": host_rss(),
                  "phase": self._stack[-1] if self._stack else None, "step": self.step}
        if self._cuda:
            record["cuda_allocated"] = int(torch.cuda.memory_allocated(self.device))
            record["cuda_reserved"] = int(torch.cuda.memory_reserved(self.device))
        if event is not None:
            record["event"], record["boundary"] = event, boundary
        self._lines.append(json.dumps(record))

    def _run(self) -> None:
        last_flush = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            self.sample()
            if time.perf_counter() - last_flush >= 1.0:  # a run that dies keeps all but the last second
                self.flush()
                last_flush = time.perf_counter()

    def flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
            if lines and not self._file.closed:
                self._file.write("\n".join(lines) + "\n")
                self._file.flush()

    def close(self) -> None:
        """Stop sampling and write what is left (idempotent)."""
        if self._file.closed:
            return
        self._stop.set()
        self._thread.join()
        self.sample()
        self.flush()
        with self._lock:
            self._file.close()

    def __enter__(self) -> "MemoryTimeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
