"""Plots of training runs from their `metrics.jsonl` files (one JSON record per step, docs/metrics.md).

`plot_pngs([run_dir_or_file, ...], out_dir)` (what `zerotrain plot` runs) writes one PNG per panel: the
training loss with the held-out loss, the learning rate, the throughput, and the memory of every rank,
each with the runs overlaid, and for a run directory holding memory timelines (`train --memory-timeline`,
`zerotrain.monitor.MemoryTimeline`) one `memory_timeline_rank{R}.png` per rank
(`plot_memory_timelines`). `plot_runs([...], out_png)` draws loss, learning rate and throughput side by
side in one figure. A resumed run, or two configs, can be compared at a glance. matplotlib is optional
(`pip install 'zerotrain[plot]'`); without it a clear error says so.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Sequence, Union

__all__ = ["read_metrics", "plot_runs", "plot_pngs", "PNG_PANELS", "read_memory_timeline", "plot_memory_timelines"]

PathLike = Union[str, os.PathLike]
PANELS = (("loss", "loss (nats/token)"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"))


def _json_lines(path: Path):
    """(line number, record) of each non-blank line of a JSON-lines file; a bad line names the file and line."""
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield line_number, json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not a JSON record ({error.msg})") from None


def read_metrics(source: PathLike) -> list[dict]:
    """The records of a run: `source` is a metrics.jsonl file or a directory holding one.
    Later records for a step replace earlier ones (a resumed run re-logs from its checkpoint)."""
    path = Path(source)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path} (train with --log-dir to write one)")
    by_step: dict[int, dict] = {}
    for _, record in _json_lines(path):
        if "step" in record:
            by_step[int(record["step"])] = record
    if not by_step:
        raise ValueError(f"{path}: no step records")
    return [by_step[step] for step in sorted(by_step)]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], float(r[key])) for r in records
              if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))]
    return [p[0] for p in points], [p[1] for p in points]


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install 'zerotrain[plot]'") from None
    return plt


def _runs(sources: Sequence[PathLike], labels: Sequence[str]) -> tuple[list[list[dict]], list[str]]:
    runs = [read_metrics(source) for source in sources]
    names = list(labels) or [Path(source).name or str(source) for source in sources]
    if len(names) != len(runs):
        raise ValueError(f"{len(names)} labels for {len(runs)} runs")
    return runs, names


def plot_runs(sources: Sequence[PathLike], out: PathLike, labels: Sequence[str] = ()) -> Path:
    """Write a PNG comparing the runs in `sources`; returns its path."""
    plt = _pyplot()
    runs, names = _runs(sources, labels)
    figure, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for records, name in zip(runs, names):
        for axis, (key, title) in zip(axes, PANELS):
            steps, values = _series(records, key)
            line, = axis.plot(steps, values, label=name if key != "loss" else f"{name} train")
            if key == "loss":
                eval_steps, eval_values = _series(records, "eval_loss")
                if eval_steps:
                    axis.plot(eval_steps, eval_values, "o--", color=line.get_color(), label=f"{name} held-out")
    for axis, (_, title) in zip(axes, PANELS):
        axis.set_title(title)
        axis.set_xlabel("optimizer step")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


# file stem -> (title, y label); "memory" draws every rank's memory_bytes
PNG_PANELS = {
    "loss": ("training and held-out loss", "loss (nats/token)"),
    "lr": ("learning rate", "learning rate"),
    "tokens_per_s": ("throughput", "tokens/s"),
    "memory": ("memory per rank", "GiB"),
}
# panels only some runs have data for: written when one of the runs does
OPTIONAL_PNG_PANELS = {"retrieval": ("held-out retrieval", "fraction")}
# the fields the "retrieval" panel draws (train-embedding's evaluations), one line each per run
RETRIEVAL = ("recall_at_1", "recall_at_10", "mrr_at_10")


def _memory_series(records: list[dict]) -> dict[int, tuple[list[int], list[float]]]:
    """rank -> (steps, GiB) from the records' `memory_bytes` lists."""
    series: dict[int, tuple[list[int], list[float]]] = {}
    for record in records:
        for rank, nbytes in enumerate(record.get("memory_bytes") or ()):
            if isinstance(nbytes, (int, float)):
                steps, values = series.setdefault(rank, ([], []))
                steps.append(record["step"])
                values.append(nbytes / 2**30)
    return series


def plot_pngs(sources: Sequence[PathLike], out_dir: PathLike, labels: Sequence[str] = ()) -> list[Path]:
    """Write `loss.png`, `lr.png`, `tokens_per_s.png`, `memory.png` (and `retrieval.png` for runs with
    retrieval evaluations) into `out_dir`, the runs overlaid.

    A panel no run has data for (e.g. memory in metrics written before it was recorded) is not written.
    Returns the paths written.
    """
    plt = _pyplot()
    names = list(labels) or [Path(source).name or str(source) for source in sources]
    if len(names) != len(sources):
        raise ValueError(f"{len(names)} labels for {len(sources)} runs")
    # A directory with memory timelines and no metrics.jsonl (a benchmark's) draws its timelines alone.
    timelines_only = [Path(source).is_dir() and not (Path(source) / "metrics.jsonl").exists()
                      and bool(_timeline_files(source)) for source in sources]
    with_metrics = [(source, name) for source, name, alone in zip(sources, names, timelines_only) if not alone]
    runs, names = _runs([s for s, _ in with_metrics], [n for _, n in with_metrics]) if with_metrics else ([], [])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for index, source in enumerate(sources):
        if Path(source).is_dir():
            prefix = "" if len(sources) == 1 else f"{(list(labels) or [Path(s).name for s in sources])[index]}_"
            written += plot_memory_timelines(source, out_dir, prefix=prefix)
    for stem, (title, ylabel) in {**PNG_PANELS, **OPTIONAL_PNG_PANELS}.items():
        if not runs:
            break
        figure, axis = plt.subplots(figsize=(6.4, 4.0))
        drawn = False
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for index, (records, name) in enumerate(zip(runs, names)):
            if stem == "memory":  # a colour per run, a line style per rank
                kind = next((r.get("memory_kind") for r in records if r.get("memory_kind")), None)
                for rank, (steps, values) in sorted(_memory_series(records).items()):
                    axis.plot(steps, values, color=colors[index % len(colors)], linestyle=("-", "--", ":", "-.")[rank % 4],
                              label=f"{name} rank {rank}" + (f" ({kind})" if kind else ""))
                    drawn = True
                continue
            if stem == "retrieval":  # a colour per run, a line style per metric
                for style, key in zip(("-", "--", ":"), RETRIEVAL):
                    steps, values = _series(records, key)
                    if steps:
                        axis.plot(steps, values, "o" + style, color=colors[index % len(colors)], label=f"{name} {key}")
                        drawn = True
                continue
            steps, values = _series(records, stem)
            if not steps:
                continue
            line, = axis.plot(steps, values, label=f"{name} train" if stem == "loss" else name)
            drawn = True
            if stem == "loss":
                eval_steps, eval_values = _series(records, "eval_loss")
                if eval_steps:
                    axis.plot(eval_steps, eval_values, "o--", color=line.get_color(), label=f"{name} held-out")
        if drawn:
            axis.set_title(title)
            axis.set_xlabel("optimizer step")
            axis.set_ylabel(ylabel)
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
            figure.tight_layout()
            path = out_dir / f"{stem}.png"
            figure.savefig(path, dpi=110)
            written.append(path)
        plt.close(figure)
    return written


# --- memory timelines (zerotrain.monitor.memory_timeline writes them; read here without importing it) -----
_TIMELINE_GLOB = "memory_timeline.rank*.jsonl"
_PHASE_ORDER = ("forward", "backward", "gather", "reduce", "optimizer step", "save")


def _timeline_files(directory: PathLike) -> list[Path]:
    def rank_of(path: Path) -> int:
        digits = path.name[len("memory_timeline.rank"):-len(".jsonl")]
        return int(digits) if digits.isdigit() else 1 << 30
    return sorted(Path(directory).glob(_TIMELINE_GLOB), key=rank_of)


def read_memory_timeline(path: PathLike) -> tuple[dict, list[dict]]:
    """(header, samples) of one rank's `memory_timeline.rank{R}.jsonl`; a bad line names the file and line."""
    path = Path(path)
    header: dict = {}
    samples: list[dict] = []
    for line_number, record in _json_lines(path):
        if "t" in record:
            samples.append(record)
        elif line_number == 1:
            header = record
    if not samples:
        raise ValueError(f"{path}: no memory samples")
    return header, samples


def _phase_spans(samples: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """phase -> [(start, width)] from the begin/end boundaries (nested phases each get their own spans)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    open_at: dict[str, list[float]] = {}
    for sample in samples:
        name, event = sample.get("boundary"), sample.get("event")
        if name is None:
            continue
        if event == "begin":
            open_at.setdefault(name, []).append(sample["t"])
        elif event == "end" and open_at.get(name):
            start = open_at[name].pop()
            spans.setdefault(name, []).append((start, max(sample["t"] - start, 1e-6)))
    return spans


def plot_memory_timelines(directory: PathLike, out_dir: PathLike, prefix: str = "") -> list[Path]:
    """Write `{prefix}memory_timeline_rank{R}.png` for each rank's timeline in `directory`: memory over time
    (host RSS; CUDA allocated and reserved when recorded) above a band per phase showing when it ran.
    Returns the paths written ([] when the directory holds no timeline)."""
    files = _timeline_files(directory)
    if not files:
        return []
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in files:
        header, samples = read_memory_timeline(path)
        rank = header.get("rank", path.name[len("memory_timeline.rank"):-len(".jsonl")])
        figure, (memory, phases) = plt.subplots(2, 1, figsize=(9, 5), sharex=True,
                                                gridspec_kw={"height_ratios": [3, 1]})
        times = [s["t"] for s in samples]
        for key, label in (("rss", "host RSS"), ("cuda_allocated", "CUDA allocated"),
                           ("cuda_reserved", "CUDA reserved")):
            points = [(s["t"], s[key] / 2**30) for s in samples if isinstance(s.get(key), (int, float))]
            if points:
                memory.plot([p[0] for p in points], [p[1] for p in points], label=label, linewidth=1)
        memory.set_ylabel("GiB")
        memory.set_title(f"memory timeline, rank {rank} ({header.get('device', '?')})")
        memory.grid(alpha=0.3)
        memory.legend(fontsize=8, loc="upper left")
        spans = _phase_spans(samples)
        names = [n for n in _PHASE_ORDER if n in spans] + sorted(n for n in spans if n not in _PHASE_ORDER)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for row, name in enumerate(names):  # one broken_barh per phase: thousands of spans stay one artist
            phases.broken_barh(spans[name], (row + 0.1, 0.8), facecolors=colors[row % len(colors)])
        phases.set_yticks([row + 0.5 for row in range(len(names))], labels=names, fontsize=8)
        phases.set_ylim(0, max(len(names), 1))
        phases.set_xlabel("seconds since the timeline started")
        phases.set_xlim(0, max(times) if times else 1)
        figure.tight_layout()
        out = out_dir / f"{prefix}memory_timeline_rank{rank}.png"
        figure.savefig(out, dpi=110)
        plt.close(figure)
        written.append(out)
    return written
