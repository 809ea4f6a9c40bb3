"""A ready-made training loop over the engine's public API.

:class:`Trainer` drives ``engine(x, y) -> (logits, loss)``, ``engine.backward(loss)`` and
``engine.step()`` for a fixed number of optimizer steps, and reports progress: a ``rich``
progress bar on rank 0 (plain lines when stdout is not a terminal), a ``metrics.jsonl``
file with one record per step (the schema: ``zerotrain.monitor.schema``, docs/metrics.md), the same
records to the monitors the config enables (DeepSpeed's ``tensorboard``, ``csv_monitor``, ``wandb``
blocks, under DeepSpeed's event names), and a closing summary that says where they all are. With ``save_dir`` it saves a
checkpoint every ``save_every`` steps and after the last one (``engine.save_checkpoint``;
the config's ``checkpoint`` block decides async saving and rotation). A resumed engine
(``engine.load_checkpoint`` before ``train()``) continues at its step and at its exact data
position: the batches already consumed (``engine.global_samples``) are skipped. It uses
nothing the engine does not offer to any user (the `zerotrain.training_engine.TrainingEngine` Protocol:
no probing, no reading the engine's parts), so everything it does can also be done in a hand-written loop.

The step contract: every kind of step (the language-model step here, `train.pipeline`'s, `embedding`'s
contrastive step) returns this rank's local sums (`StepResult`: its loss and how many losses that is, its
share of the input tokens); the Trainer makes ONE all-reduce per step (`reduce_step`) of those, the stop
flag and every rank's memory high-water mark. Every kind of step that reads a dataloader reads it through
one `Batches` (epochs with ``sampler.set_epoch``, the resume seek).

Signals: by default the Trainer turns SIGTERM, SIGINT, SIGHUP and SIGUSR1 into a stop request
(`zerotrain.lifecycle`). The flag travels in that one all-reduce, so all ranks stop after the same
step without an extra collective, whatever the step; the Trainer then saves a committed
checkpoint (with ``save_dir``) and returns a summary whose ``stopped_by`` names the signal.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol, Union

import threading

import torch

from . import dist
from .lifecycle import StopRequest
from .monitor import Monitors, TIMER_FIELDS, check_monitor_libraries
from .monitor.memory_timeline import MemoryTimeline
from .monitor.measure import memory_bytes, memory_kind, parameter_count, peak_flops
from .training_engine import TrainingEngine

__all__ = ["Trainer", "TrainSummary", "TrainStep", "StepResult", "StepTotals", "Batches", "reduce_step", "MetricsLog"]


@dataclass
class TrainSummary:
    """What a :meth:`Trainer.train` run did."""

    steps: int
    final_loss: float
    mean_tokens_per_s: float
    total_time_s: float
    tokens: int
    final_eval_loss: Optional[float] = None
    checkpoint: Optional[str] = None
    stopped_by: Optional[str] = None  # the signal that stopped training early (e.g. "SIGTERM"), if any
    outputs: Optional[dict] = None  # where rank 0 wrote: "metrics" file, monitor name -> directory
    epochs: Optional[float] = None  # passes over the training data at the end (with the loop's steps_per_epoch)

    def format(self) -> str:
        text = (
            f"trained {self.steps} steps in {self.total_time_s:.1f}s: "
            f"final loss {self.final_loss:.4f}, {self.mean_tokens_per_s:,.0f} tokens/s"
        )
        if self.epochs is not None:
            text = text.replace(" steps in ", f" steps ({self.epochs:.2f} epochs) in ", 1)
        if self.final_eval_loss is not None:
            text += f", eval loss {self.final_eval_loss:.4f}"
        if self.stopped_by is not None:
            text = f"stopped by {self.stopped_by}: " + text
        for name, path in (self.outputs or {}).items():
            text += f"\n  {name}: {path}"
        return text


@dataclass
class StepResult:
    """What one optimizer step of a `TrainStep` reports to the loop: this rank's LOCAL sums, no collective
    made; the Trainer reduces them over every rank (`reduce_step`, once per step)."""

    loss: Union[float, torch.Tensor]  # this rank's loss (the step's: the sum over ranks / the sum of loss_weight)
    lr: float  # the learning rate the update applied
    tokens: Union[float, torch.Tensor]  # this rank's share of the step's input tokens (the step's: the sum over ranks)
    loss_weight: float = 1.0  # how many losses `loss` sums (0: a rank that computes none, a pipeline's first stages)


@dataclass
class StepTotals:
    """A step's `StepResult`s reduced over every rank, with the stop flag and each rank's memory."""

    loss: float  # the step's loss (the mean over the ranks that computed one)
    tokens: int  # the step's input tokens over every rank
    stop_signal: int  # the stop signal the flagged ranks saw (0: none; -1: they saw different ones)
    memory: list  # every rank's memory high-water mark in bytes, in rank order


def reduce_step(result: StepResult, *, stop_signal: int = 0, memory: int = 0,
                device: Optional[torch.device] = None) -> StepTotals:
    """`result` of this rank reduced over every rank in ONE all-reduce (through `zerotrain.dist`, so `comm`):
    ``[loss, loss weight, tokens, ranks flagged, sum of their signals, memory of rank 0, 1, ...]`` (each rank
    fills only its own memory slot; float64 holds byte and token counts exactly). `stop_signal`: the signal this
    rank saw (0: none); `memory`: its high-water mark. The value itself without torch.distributed."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    values = torch.zeros(5 + world, dtype=torch.float64, device=device)
    for slot, value in ((0, result.loss), (2, result.tokens)):  # tensors copied on their device: no sync
        values[slot] = (value.detach().to(device=values.device, dtype=torch.float64).reshape(())
                        if isinstance(value, torch.Tensor) else float(value))
    values[1] = float(result.loss_weight)
    values[3] = float(stop_signal > 0)
    values[4] = float(stop_signal)
    values[5 + rank] = float(memory)
    if world > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    values = values.cpu()
    weight = float(values[1].item())
    count = int(values[3].item())
    mean = values[4].item() / count if count else 0.0  # the signal every flagged rank saw (they normally agree)
    return StepTotals(loss=float(values[0].item()) / weight if weight else float("nan"),
                      tokens=int(round(float(values[2].item()))),
                      stop_signal=int(mean) if count and mean == int(mean) else (-1 if count else 0),
                      memory=[int(v) for v in values[5:].tolist()])


class Batches:
    """The micro-batches of a dataloader, one after the other, epoch after epoch: re-iterated (with
    ``sampler.set_epoch``) when exhausted; `seek` continues a resumed run at its exact data position. The one
    batch iterator of every kind of step that reads a dataloader (the Trainer's language-model step, the
    pipeline's)."""

    def __init__(self, dataloader: Iterable) -> None:
        self.dataloader = dataloader
        self.epoch = 0
        self._batches: Optional[Iterator] = None

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> Any:
        for _ in range(2):
            if self._batches is None:
                sampler = getattr(self.dataloader, "sampler", None)
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(self.epoch)
                self._batches = iter(self.dataloader)
            try:
                return next(self._batches)
            except StopIteration:
                self._batches = None
                self.epoch += 1
        raise RuntimeError("the training dataloader yields no batches")

    def seek(self, samples: int, samples_per_batch: int) -> None:
        """Skip the micro-batches a resumed run consumed: `samples` drawn so far by the data-parallel group
        (``engine.global_samples``), `samples_per_batch` of them per micro-batch of each rank (micro-batch size x
        data-parallel ranks). Nothing to skip for a resumable sampler (``consumed_samples``: zerotrain.data's, built
        at its position)."""
        if samples == 0:
            return
        if getattr(getattr(self.dataloader, "sampler", None), "consumed_samples", None) is not None:
            return
        consumed = samples // samples_per_batch  # micro-batches each rank has drawn
        try:
            per_epoch = len(self.dataloader)  # type: ignore[arg-type]
        except TypeError:  # no length (a DataLoader over an IterableDataset, a stream): skipped batch by batch
            per_epoch = 0
        self.epoch = 0
        if per_epoch > 0:
            self.epoch, consumed = divmod(consumed, per_epoch)
        self._batches = None
        for _ in range(consumed):
            next(self)


class TrainStep(Protocol):
    """One optimizer step, plugged into `Trainer` (`step=`) in place of its language-model step over a
    dataloader: the contrastive step of `zerotrain.embedding` and the pipeline step of `zerotrain.train.pipeline`
    are ones. The loop around it (the step's one reduction, counting, metrics, evaluation, checkpoints, stop
    signals, progress, the summary) is the Trainer's, the same for every kind of training."""

    def run(self) -> StepResult:
        """Run one optimizer step of the engine (every micro-batch of it); this rank's local sums, no collective
        of its own for what it reports."""
        ...

    def seek(self, samples: int) -> None:
        """Before the first step: continue at a resumed engine's data position (``engine.global_samples``)."""
        ...

    def client_state(self) -> Optional[dict]:
        """Saved with each checkpoint (`engine.save_checkpoint(client_state=...)`), e.g. the data position."""
        return None


class MetricsLog:
    """Rank 0's metrics writer: one record per step to ``log_dir/metrics.jsonl`` (appended: a resumed run
    continues the file) and to the monitors the config enables (DeepSpeed's ``tensorboard``, ``csv_monitor``,
    ``wandb`` blocks); every run writes through it (the schema: ``zerotrain.monitor.schema``)."""

    def __init__(self, config: Any, log_dir: Optional[Path]) -> None:
        self.monitors = Monitors.build(config, log_dir)
        self._file = None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(log_dir / "metrics.jsonl", "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        """One record; NaN and infinities are written as null (JSON has none)."""
        record = _finite(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self.monitors:
            self.monitors.write(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self.monitors is not None:
            self.monitors.close()


class Trainer:
    """Runs ``total_steps`` optimizer steps of ``engine`` over ``dataloader``.

    Args:
        engine: the object returned first by ``zerotrain.initialize``, or anything else with the members of
            ``zerotrain.training_engine.TrainingEngine``.
        dataloader: yields ``(x, y)`` micro-batches (``engine(x, y) -> (logits, loss)``) or dicts of
            tensors (``engine(**batch).loss``, a Hugging Face model: ``zerotrain.data``'s batches);
            re-iterated (with ``sampler.set_epoch``) when exhausted. A resumed run skips the batches
            already consumed, unless the sampler has a ``consumed_samples`` attribute (built at its
            position, as ``zerotrain.data``'s ``ResumableSampler`` is).
        total_steps: optimizer steps to reach. A resumed engine (``engine.global_steps > 0``)
            continues from where it is.
        eval_data: optional iterable of ``(x, y)`` batches; evaluated every
            ``eval_interval`` steps (0: only after the last step), at most ``eval_batches``
            batches each time (None: all).
        log_dir: where rank 0 writes ``metrics.jsonl`` and ``summary.json``; none if None.
        steps_per_print: how often a plain progress line is printed when stdout is not a
            terminal (default: the engine config's ``steps_per_print``).
        console: a ``rich.console.Console`` for rank 0's output (default: stdout).
        save_dir: where checkpoints go (``save_dir/global_step{N}``, ``save_dir/latest``);
            none are saved if None.
        save_every: also save every this many steps (0: only after the last step).
        stop_signals: signals that stop training at the next step boundary (names, e.g.
            ``"SIGTERM,SIGUSR1"``; default SIGTERM, SIGINT, SIGHUP, SIGUSR1); ``()`` handles none.
            Handlers are installed for the duration of ``train()``, from the main thread only.
        memory_timeline: > 0: every rank samples its memory every this many seconds (and at each of the
            engine's phase boundaries) into ``log_dir/memory_timeline.rank{R}.jsonl`` during ``train()``
            (``zerotrain.monitor.MemoryTimeline``; needs ``log_dir``); 0: off.
        step: a `TrainStep` run for each optimizer step instead of the language-model step over
            ``dataloader`` (then None): e.g. the contrastive step of ``zerotrain train-embedding``.
        evaluator: ``evaluator(when) -> fields`` ("before" / "after" training, or "step"), merged into the
            record of the step it follows, instead of the mean loss over ``eval_data``.
        eval_before: also evaluate before the first step (a record of step 0 when starting from scratch).
        steps_per_epoch: optimizer steps in one pass over the data: each record, progress line and the
            summary then say the epoch (step / steps_per_epoch); None: not said.
    """

    def __init__(
        self,
        engine: TrainingEngine,
        dataloader: Optional[Iterable],
        total_steps: int,
        eval_data: Optional[Iterable] = None,
        log_dir: Optional[Union[str, os.PathLike]] = None,
        steps_per_print: Optional[int] = None,
        eval_interval: int = 0,
        eval_batches: Optional[int] = None,
        console: Optional[Any] = None,
        save_dir: Optional[Union[str, os.PathLike]] = None,
        save_every: int = 0,
        stop_signals: Any = None,
        memory_timeline: float = 0.0,
        step: Optional[TrainStep] = None,
        evaluator: Optional[Callable[[str], Optional[dict]]] = None,
        eval_before: bool = False,
        steps_per_epoch: Optional[int] = None,
    ) -> None:
        if total_steps < 0:
            raise ValueError(f"total_steps must be >= 0, got {total_steps}")
        if save_every < 0:
            raise ValueError(f"save_every must be >= 0, got {save_every}")
        if (step is None) == (dataloader is None):
            raise ValueError("give either a dataloader (the language-model step) or a step, not both")
        # An enabled monitor whose library is missing stops every rank here, not only rank 0 later.
        self.config = engine.config
        check_monitor_libraries(self.config)
        self.engine = engine
        self.dataloader = dataloader
        self.total_steps = int(total_steps)
        self.eval_data = eval_data
        self.log_dir = Path(log_dir) if log_dir is not None else None
        if steps_per_print is None:
            steps_per_print = self.config.steps_per_print or 10
        self.steps_per_print = max(1, int(steps_per_print))
        self.eval_interval = max(0, int(eval_interval))
        self.eval_batches = eval_batches
        self._console = console
        self.save_dir = Path(save_dir) if save_dir is not None else None
        self.save_every = int(save_every)
        if memory_timeline and self.log_dir is None:
            raise ValueError("memory_timeline needs a log_dir (its files go next to metrics.jsonl)")
        self.memory_timeline = float(memory_timeline or 0.0)
        self.last_checkpoint: Optional[str] = None
        self.steps_per_epoch = int(steps_per_epoch) if steps_per_epoch else None
        self.batches = Batches(dataloader) if dataloader is not None else None

        topology = engine.topology
        self.rank = int(topology.rank)
        self.dp_size = int(topology.data_parallel_size)  # ranks that see different samples (not sequence peers)
        self.dp_group = topology.dp_group
        self.device = engine.device
        self.history: list[dict] = []
        self.stop_signals = stop_signals
        self.stop_request = StopRequest()
        self.step = step
        self.evaluator = evaluator
        self.eval_before = bool(eval_before)
        self.monitors: Optional[Monitors] = None
        self._memory: list[int] = []
        self._flops_per_token: Optional[float] = None

    # -- data ---------------------------------------------------------------------------

    def _next_batch(self):
        assert self.batches is not None
        return next(self.batches)

    def _seek(self) -> None:
        """Continue at a resumed engine's data position (``engine.global_samples``): the step's, or the batches
        the language-model step already consumed skipped."""
        samples = int(self.engine.global_samples)
        if self.step is not None:
            self.step.seek(samples)
        elif self.batches is not None and samples > 0:
            self.batches.seek(samples, int(self.engine.train_micro_batch_size_per_gpu()) * self.dp_size)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device is None or not isinstance(tensor, torch.Tensor):
            return tensor
        return tensor.to(self.device, non_blocking=True)

    def _forward(self, batch) -> tuple[torch.Tensor, int]:
        """(loss, input tokens) of one micro-batch: ``(x, y)`` for ``engine(x, y) -> (logits, loss)``, or a
        dict of tensors (``zerotrain.data``'s batches) for a Hugging Face model, ``engine(**batch).loss``.
        Under sequence parallelism (``engine.sequence_parallel``) each rank runs its slice of the batch; the
        token count is the whole batch's."""
        sp = self.engine.sequence_parallel
        if isinstance(batch, dict):
            batch = {key: self._to_device(value) for key, value in batch.items()}
            tokens = int(batch["input_ids"].numel())
            if sp is not None:
                batch = sp.shard(batch)
            return self.engine(**batch).loss, tokens
        x, y = batch
        if sp is not None:
            shard = sp.shard({"input_ids": self._to_device(x), "labels": self._to_device(y)}, shift_labels=False)
            _, loss = self.engine(shard["input_ids"], shard["labels"], position_ids=shard["position_ids"])
            return loss, int(x.numel())
        _, loss = self.engine(self._to_device(x), self._to_device(y))
        return loss, int(x.numel())

    # -- one step -----------------------------------------------------------------------

    def train_step(self) -> tuple[float, float, int]:
        """One optimizer step of the language-model step: ``(loss averaged over micro-steps and ranks, lr,
        tokens)``; ``tokens`` counts the whole data-parallel group's input tokens."""
        result = self._language_model_step()
        loss, tokens = self._reduce(result)
        return loss, result.lr, tokens

    def _language_model_step(self) -> StepResult:
        """The language-model step over the dataloader: `accumulation` micro-batches, this rank's local sums."""
        engine = self.engine
        accumulation = int(engine.gradient_accumulation_steps())
        loss_sum: Optional[torch.Tensor] = None
        tokens = 0
        lr = float("nan")
        for micro in range(accumulation):
            loss, count = self._forward(self._next_batch())
            engine.backward(loss)
            if micro == accumulation - 1:
                lr = self._current_lr()  # the rate this update applies
            engine.step()
            detached = loss.detach().float()
            loss_sum = detached if loss_sum is None else loss_sum + detached
            tokens += count
        assert loss_sum is not None
        # Every rank holds a loss (tensor- and sequence-parallel peers the same one, so the mean over every rank is
        # the data-parallel mean); the peers that share a batch each report their share of its tokens.
        world = dist.get_world_size() if dist.is_initialized() else 1
        return StepResult(loss=loss_sum / accumulation, lr=lr, tokens=tokens * self.dp_size / world)

    def _reduce(self, result: StepResult) -> tuple[float, int]:
        """(loss, tokens) of the step over every rank, in the step's one all-reduce with the stop flag and the
        memory (`reduce_step`): a signal seen by any one rank stops all of them after this step."""
        signum = int(self.stop_request.signal) if self.stop_request.requested else 0
        loss = result.loss
        device = torch.device(self.device) if self.device is not None else (
            loss.device if isinstance(loss, torch.Tensor) else torch.device("cpu"))
        totals = reduce_step(result, stop_signal=signum, memory=memory_bytes(device), device=device)
        self._memory, self._stop_signal = totals.memory, totals.stop_signal
        return totals.loss, totals.tokens

    def _one_step(self) -> tuple[float, float, int]:
        """(loss, lr, tokens) of the next optimizer step, the language-model step or the pluggable one, reduced."""
        result = self._language_model_step() if self.step is None else self.step.run()
        loss, tokens = self._reduce(result)
        return loss, result.lr, tokens

    def _evaluate(self, when: str) -> Optional[dict]:
        """The evaluation's fields for the step record: the evaluator's, or the mean loss over eval_data; None
        without either."""
        if self.evaluator is not None:
            return self.evaluator(when)
        if self.eval_data is None or when == "before":
            return None
        return {"eval_loss": self.evaluate()}

    def _current_lr(self) -> float:
        lrs = self.engine.get_lr()
        return float(lrs[0]) if lrs else float("nan")

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        """Mean loss over the eval data's micro-batches, every rank's (this rank's sum and count reduced in the
        step's one reduction, `reduce_step`: a rank that evaluated more batches weighs more); None without eval
        data."""
        if self.eval_data is None:
            return None
        was_training = self.engine.training
        self.engine.eval()
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        try:
            for i, batch in enumerate(self.eval_data):
                if self.eval_batches is not None and i >= self.eval_batches:
                    break
                loss, _ = self._forward(batch)
                total += loss.detach().to("cpu", torch.float64)
                count += 1
        finally:
            if was_training:
                self.engine.train()
        return reduce_step(StepResult(loss=total, lr=float("nan"), tokens=0, loss_weight=float(count)),
                           device=self.device).loss

    # -- checkpoints --------------------------------------------------------------------

    def save_checkpoint(self, step: int, console: Optional[Any]) -> Optional[str]:
        """Save the engine into ``save_dir`` (every rank) and report where on rank 0."""
        assert self.save_dir is not None
        state = self.step.client_state() if self.step is not None else None
        path = (self.engine.save_checkpoint(str(self.save_dir), client_state=state) if state is not None
                else self.engine.save_checkpoint(str(self.save_dir)))
        if path is None:  # failed, and checkpoint.on_save_error is "warn": training goes on
            if console is not None:
                console.print(f"checkpoint of step {step} failed (see the warning); training goes on; the "
                              f"latest checkpoint is still {self.last_checkpoint}", highlight=False, soft_wrap=True)
            return None
        self.last_checkpoint = path
        if console is not None:
            pending, stall = self.engine.last_save()
            how = "being written in the background" if pending else "saved"
            took = f", training paused {stall:.2f}s" if stall is not None else ""
            console.print(f"checkpoint of step {step} {how}: {path}{took}", highlight=False, soft_wrap=True)
        return path

    # -- the loop -----------------------------------------------------------------------

    def train(self) -> TrainSummary:
        """Run to ``total_steps`` and return the summary (the same on every rank)."""
        if not self.memory_timeline:
            return self._train()
        timeline = MemoryTimeline(self.log_dir, rank=self.rank, device=self.device, interval_s=self.memory_timeline,
                                  step=int(self.engine.global_steps))
        self.engine.watch_memory(timeline)
        try:
            return self._train()
        finally:
            self.engine.watch_memory(None)
            timeline.close()

    def _train(self) -> TrainSummary:
        start_step = int(self.engine.global_steps)
        is_main = self.rank == 0
        console = self._get_console() if is_main else None
        live = bool(console is not None and console.is_terminal)
        metrics = MetricsLog(self.config, self.log_dir) if is_main else None
        if metrics is not None:
            self.monitors = metrics.monitors
        comm_before = self._comm_bytes()

        progress = task = None
        if live:
            progress, task = self._make_progress(console, start_step)
            progress.start()

        t0 = time.perf_counter()
        train_time = 0.0
        total_tokens = 0
        last_loss = float("nan")
        eval_loss: Optional[float] = None
        step = start_step
        self._seek()
        if self.eval_before:
            fields = self._evaluate("before")
            if fields and start_step == 0 and metrics is not None:  # from scratch: the untrained model's record
                metrics.write({"step": 0, "samples": 0, **fields})
        saved_step = start_step if start_step > 0 else None
        # The engine's own steps_per_print line would repeat what this loop reports: off while it runs.
        quiet = self.engine.progress_printing(False)
        quiet.__enter__()
        self._stop_signal = 0
        stopped_by: Optional[str] = None
        handling = self.stop_signals != () and threading.current_thread() is threading.main_thread()
        if handling:
            self.stop_request.install(self.stop_signals)
        try:
            for step in range(start_step + 1, self.total_steps + 1):
                t_step = time.perf_counter()
                loss, lr, tokens = self._one_step()
                dt = time.perf_counter() - t_step
                train_time += dt
                total_tokens += tokens
                last_loss = loss
                record, comm_before = self._record(step, loss, lr, tokens, dt, t0, comm_before)
                # speculative steps, rollbacks, redone steps, NVMe bytes (none without offload)
                record.update({f"offload_{k}": v for k, v in self.engine.offload_stats().items()})
                due = self.eval_interval and step % self.eval_interval == 0
                if due or step == self.total_steps:
                    fields = self._evaluate("after" if step == self.total_steps else "step")
                    if fields is not None:
                        record.update(fields)
                        eval_loss = fields.get("eval_loss", eval_loss)
                self.history.append(record)
                if metrics is not None:
                    metrics.write(record)
                if progress is not None:
                    progress.update(task, completed=step, **_fields(record))
                elif console is not None and (
                    step % self.steps_per_print == 0 or step == self.total_steps
                ):
                    console.print(_plain_line(record, self.total_steps), highlight=False)
                if self._stop_signal:  # every rank saw the flag in the same reduction: all stop here
                    stopped_by = _signal_name(self._stop_signal)
                    if console is not None and progress is None:
                        console.print(f"stop requested ({stopped_by}): stopping after step {step}",
                                      highlight=False)
                    break
                if self.save_dir is not None and self.save_every and step % self.save_every == 0:
                    self.save_checkpoint(step, console)
                    saved_step = step
        except BaseException:
            if handling:
                self.stop_request.uninstall()
            raise
        finally:
            quiet.__exit__(None, None, None)
            if progress is not None:
                progress.stop()
            if metrics is not None:
                metrics.close()

        # The stop handlers stay until the last checkpoint is committed: a rank that learned of a stop from its
        # peers' flag may get its own signal only now (another node's scheduler, a slower forwarder), and that
        # must be a (first) request, not the signal's default action killing the rank in the middle of the save.
        try:
            if step == start_step and stopped_by is None:  # nothing left to train: still report the evaluation
                fields = self._evaluate("after")
                if fields is not None:
                    eval_loss = fields.get("eval_loss", eval_loss)
            if self.save_dir is not None:
                if saved_step != step:
                    self.save_checkpoint(step, console)
                pending, _ = self.engine.last_save()
                self.engine.wait_checkpoint()  # an asynchronous save commits (or raises) before we return
                if pending and console is not None:
                    console.print(f"checkpoint committed: {self.last_checkpoint}", highlight=False, soft_wrap=True)
        finally:
            if handling:
                self.stop_request.uninstall()
        summary = TrainSummary(
            steps=step - start_step,
            final_loss=last_loss,
            mean_tokens_per_s=total_tokens / train_time if train_time > 0 else 0.0,
            total_time_s=time.perf_counter() - t0,
            tokens=total_tokens,
            final_eval_loss=eval_loss,
            checkpoint=self.last_checkpoint,
            stopped_by=stopped_by,
            outputs=self._outputs() if is_main else None,
            epochs=step / self.steps_per_epoch if self.steps_per_epoch else None,
        )
        if is_main:
            if self.log_dir is not None:
                (self.log_dir / "summary.json").write_text(
                    json.dumps(_finite(asdict(summary)), indent=2) + "\n"
                )
            console.print(summary.format(), highlight=False, soft_wrap=True)  # paths stay whole
        return summary

    # -- the metrics record (zerotrain.monitor.schema, docs/metrics.md) -----------------------

    def _record(self, step: int, loss: float, lr: float, tokens: int, dt: float, t0: float,
                comm_before: Optional[int]) -> tuple[dict, Optional[int]]:
        """The step's metrics record, and the communication counter to measure the next step from."""
        engine = self.engine
        batch = int(engine.train_batch_size())
        record: dict[str, Any] = {
            "step": step,
            "samples": int(engine.global_samples),
            **({"epoch": step / self.steps_per_epoch} if self.steps_per_epoch else {}),
            "loss": loss,
            "lr": lr,
            "next_lr": self._current_lr(),
        }
        if self.config.precision == "fp16":
            record["loss_scale"] = float(engine.loss_scale)
        norm = engine.get_global_grad_norm()
        if norm is not None:
            record["grad_norm"] = float(norm)
        tokens_per_s = tokens / dt if dt > 0 else float("nan")
        record["tokens_per_s"] = tokens_per_s
        record["samples_per_s"] = batch / dt if dt > 0 and batch else float("nan")
        mfu = self._mfu(tokens_per_s)
        if mfu is not None:
            record["mfu"] = mfu
        record["memory_bytes"] = list(self._memory)
        record["memory_kind"] = memory_kind(torch.device(self.device or "cpu"))
        comm_now = self._comm_bytes()
        if comm_now is not None:
            record["comm_bytes"] = comm_now - (comm_before or 0)
            record["comm_bytes_total"] = comm_now
        record["elapsed_s"] = time.perf_counter() - t0
        timers = engine.get_wall_clock_timers()
        record.update({TIMER_FIELDS[name]: ms for name, ms in timers.items() if name in TIMER_FIELDS})
        return record, comm_now

    def _comm_bytes(self) -> Optional[int]:
        """Bytes this rank sent in the library's collectives since the engine was built (None: not counted)."""
        counters = self.engine.counters
        return sum(counters.bytes.values()) if counters is not None else None

    def _mfu(self, tokens_per_s: float) -> Optional[float]:
        """Model FLOPs utilisation (6 x parameters FLOPs per token) where the device's peak is known.

        Not with tensor parallelism (each rank's module holds slices) and not on CPUs (no known peak)."""
        topology = self.engine.topology
        if self.device is None or int(topology.tp_size) != 1 or not math.isfinite(tokens_per_s):
            return None
        peak = peak_flops(torch.device(self.device), self.config.precision)
        module = self.engine.module
        if peak is None or module is None:
            return None
        if self._flops_per_token is None:
            self._flops_per_token = 6.0 * parameter_count(module)
        devices = int(topology.world_size)
        return self._flops_per_token * tokens_per_s / (peak * devices)

    def _outputs(self) -> dict:
        """Where rank 0 writes: for the summary line and summary.json."""
        outputs = {}
        if self.log_dir is not None:
            outputs["metrics"] = str(self.log_dir / "metrics.jsonl")
            outputs["plots"] = f"`zerotrain plot {self.log_dir}` writes {self.log_dir / 'plots'}/*.png"
        if self.monitors is not None:
            outputs.update(self.monitors.paths())
        return outputs

    # -- output helpers -----------------------------------------------------------------

    def _get_console(self):
        if self._console is None:
            from rich.console import Console

            self._console = Console(file=sys.stdout)
            if not self._console.is_terminal:  # a log file or pipe: one record, one line (grep finds it whole)
                self._console.soft_wrap = True
        return self._console

    def _make_progress(self, console, start_step: int):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  lr {task.fields[lr]}  {task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        task = progress.add_task(
            "train", total=self.total_steps, completed=start_step, loss="-", lr="-", tps="-"
        )
        return progress, task


def _signal_name(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return "a stop signal"


def _fields(record: dict) -> dict:
    return {
        "loss": f"{record['loss']:.4f}",
        "lr": f"{record['lr']:.3g}",
        "tps": f"{record['tokens_per_s']:,.0f}",
    }


def _plain_line(record: dict, total_steps: int) -> str:
    f = _fields(record)
    line = (
        f"step {record['step']}/{total_steps}" + (f"  epoch {record['epoch']:.2f}" if "epoch" in record else "")
        + f"  loss {f['loss']}  lr {f['lr']}  "
        f"{f['tps']} tok/s  {record['elapsed_s']:.1f}s"
    )
    if record.get("eval_loss") is not None:
        line += f"  eval_loss {record['eval_loss']:.4f}"
    return line


def _finite(record: dict) -> dict:
    """JSON has no NaN/Infinity: write them as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
