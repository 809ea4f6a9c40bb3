"""Plots of training runs from their `metrics.jsonl` files (one JSON record per step).

`plot_runs([run_dir_or_file, ...], out_png)` draws the training loss (and held-out loss where
recorded), the learning rate and the throughput of one or several runs side by side, so a
resumed run, or two configs, can be compared at a glance. matplotlib is optional
(`pip install 'zerotrain[plot]'`); without it a clear error says so.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Sequence, Union

__all__ = ["read_metrics", "plot_runs"]

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


def plot_runs(sources: Sequence[PathLike], out: PathLike, labels: Sequence[str] = ()) -> Path:
    """Write a PNG comparing the runs in `sources`; returns its path."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install 'zerotrain[plot]'") from None
    runs = [read_metrics(source) for source in sources]
    names = list(labels) or [Path(source).name or str(source) for source in sources]
    if len(names) != len(runs):
        raise ValueError(f"{len(names)} labels for {len(runs)} runs")
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
