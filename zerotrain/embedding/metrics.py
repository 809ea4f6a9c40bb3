"""The metrics of `zerotrain train-embedding`: one record per optimizer step in the schema every zerotrain
run writes (`zerotrain.monitor.schema`, docs/metrics.md), to `LOG_DIR/metrics.jsonl` and the monitors
the config enables (DeepSpeed's `tensorboard`, `csv_monitor`, `wandb` blocks), so `zerotrain plot` and
TensorBoard show an embedding run as they show `zerotrain train`'s.

Training fields are the Trainer's (`loss` is the global contrastive batch's InfoNCE, per query;
`samples_per_s` is examples, i.e. queries, per second). The held-out retrieval evaluation adds
`recall_at_1`, `recall_at_10`, `mrr_at_10` to the record of the step it follows (the evaluation
before training is a record of step 0, samples 0, when the run starts from scratch).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Optional, Union

import torch

from zerotrain.monitor import TIMER_FIELDS, Monitors, check_monitor_libraries
from zerotrain.monitor.measure import memory_kind
from zerotrain.training_engine import TrainingEngine

__all__ = ["RETRIEVAL_FIELDS", "RunLog", "step_record"]

# `retrieval_metrics` keys -> the schema's field names (plain names: they become event and CSV file names)
RETRIEVAL_FIELDS = {"recall@1": "recall_at_1", "recall@10": "recall_at_10", "mrr@10": "mrr_at_10"}


def _finite(record: dict) -> dict:
    """JSON has no NaN/Infinity: written as null (as the Trainer does)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def step_record(engine: TrainingEngine, step: Any, loss: float, lr: float, seconds: float, started: float) -> dict:
    """The record of the optimizer step `step` (a `ContrastiveStep`) just ran on `engine` in `seconds`."""
    batch = int(engine.train_batch_size())
    record: dict[str, Any] = {"step": int(engine.global_steps), "samples": int(engine.global_samples),
                              "loss": loss, "lr": lr, "next_lr": float(engine.get_lr()[0])}
    norm = engine.get_global_grad_norm()
    if norm is not None:
        record["grad_norm"] = float(norm)
    record["tokens_per_s"] = step.tokens / seconds if seconds > 0 else float("nan")
    record["samples_per_s"] = batch / seconds if seconds > 0 else float("nan")
    if step.memory:
        record["memory_bytes"] = list(step.memory)
        record["memory_kind"] = memory_kind(torch.device(engine.device))
    record["elapsed_s"] = time.perf_counter() - started
    timers = engine.get_wall_clock_timers()
    record.update({TIMER_FIELDS[name]: ms for name, ms in timers.items() if name in TIMER_FIELDS})
    return record


class RunLog:
    """Rank 0's writer: `metrics.jsonl` under `log_dir` (if given) and the config's monitors.

    `write(record)` holds the newest record back until the next one (or `close`), so an evaluation that
    follows the last step lands in that step's record (`zerotrain plot` keeps one record per step)."""

    def __init__(self, config: Any, log_dir: Optional[Union[str, Path]], is_main: bool):
        check_monitor_libraries(config)  # every rank: a missing library stops all ranks alike
        self.is_main = is_main
        self.path = Path(log_dir) / "metrics.jsonl" if log_dir is not None else None
        self.monitors = Monitors.build(config, Path(log_dir) if log_dir else None) if is_main else None
        self._file = None
        if is_main and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        self._pending: Optional[dict] = None

    def write(self, record: dict) -> None:
        self.flush()
        self._pending = record

    def add_to_last(self, fields: dict) -> None:
        """Merge `fields` (an evaluation) into the record not yet written."""
        if self._pending is not None:
            self._pending.update(fields)

    def flush(self) -> None:
        record, self._pending = self._pending, None
        if record is None or not self.is_main:
            return
        record = _finite(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self.monitors:
            self.monitors.write(record)

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
        if self.monitors is not None:
            self.monitors.close()
