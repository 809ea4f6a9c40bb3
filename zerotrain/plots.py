"""Plots of training runs from their `metrics.jsonl` files (one JSON record per step, docs/metrics.md).

`plot_pngs([run_dir_or_file, ...], out_dir)` (what `zerotrain plot` runs) writes one PNG per panel: the
training loss with the held-out loss, the learning rate, the throughput, and the memory of every rank,
each with the runs overlaid. `plot_runs([...], out_png)` draws loss, learning rate and throughput side by
side in one figure. A resumed run, or two configs, can be compared at a glance. matplotlib is optional
(`pip install 'zerotrain[plot]'`); without it a clear error says so.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Sequence, Union

__all__ = ["read_metrics", "plot_runs", "plot_pngs", "PNG_PANELS"]

PathLike = Union[str, os.PathLike]
PANELS = (("loss", "loss (nats/token)"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"))


def read_metrics(source: PathLike) -> list[dict]:
    """The records of a run: `source` is a metrics.jsonl file or a directory holding one.
    Later records for a step replace earlier ones (a resumed run re-logs from its checkpoint)."""
    path = Path(source)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path} (train with --log-dir to write one)")
    by_step: dict[int, dict] = {}
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not a JSON record ({error.msg})") from None
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
    runs, names = _runs(sources, labels)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, (title, ylabel) in {**PNG_PANELS, **OPTIONAL_PNG_PANELS}.items():
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
