"""`zerotrain train --pipeline-parallel-size N`: the language-model step over a pipeline engine.

The Trainer's own step calls `engine(**batch)` / `backward` / `step` per micro-batch; a pipeline engine runs a
whole batch in `train_batch(data_iter)` (torch's schedule), so `PipelineLMStep` is plugged into the Trainer
(`step=`): per optimizer step it hands the engine `gradient_accumulation_steps` micro-batches of the run's loader,
each padded on the right to the sequence length (a `PipelineStage` exchanges fixed shapes: label -100 and mask 0
on the padding) and made the split model's inputs (`zerotrain.pipe.hf.pipeline_inputs`). Only the ranks of the
first and last stage are given a loader; the others never build one. The loader is read through the Trainer's
own batch iterator (`zerotrain.trainer.Batches`: epochs with `set_epoch`, a resumed run's seek), and the step
reports its local sums (the last stage's loss, the first stage's tokens) for the Trainer's one reduction per step,
the one that carries the stop flag: a stop signal ends a pipeline run at the next step boundary as any other.

`PipelineEvaluator` is the Trainer's `evaluator` with a pipeline: the evaluation micro-batches (the eval loader's
first `batches`, rounded down to whole batches of `gradient_accumulation_steps`: the schedule runs a fixed number
of micro-batches) go through the engine's `eval_batch(aggregate=False)` (every stage runs its forwards, the loss
is the last stage's, kept local), and the sums go through the Trainer's one reduction (`reduce_step`, as its own
evaluation's): the mean over every data-parallel rank's batches is the mean of the micro-batch losses, the
`eval_loss` the Trainer's own evaluation reports without a pipeline.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch

from zerotrain.pipe.hf import pipeline_inputs
from zerotrain.trainer import Batches, StepResult, reduce_step

__all__ = ["PipelineEvaluator", "PipelineLMStep", "eval_micro_batches", "pad_batch"]


def pad_batch(batch: dict, seq_len: int) -> dict:
    """`batch` (input_ids, labels, optional attention_mask / position_ids) padded on the right to `seq_len`."""
    ids = batch["input_ids"]
    extra = seq_len - ids.shape[1]
    if extra < 0:
        raise ValueError(f"a batch of {ids.shape[1]} tokens is longer than the sequence length {seq_len}")
    if extra == 0:
        return batch
    pad = torch.nn.functional.pad
    out = {"input_ids": pad(ids, (0, extra)), "labels": pad(batch["labels"], (0, extra), value=-100),
           "attention_mask": pad(batch.get("attention_mask", torch.ones_like(ids)), (0, extra))}
    if batch.get("position_ids") is not None:
        positions = batch["position_ids"]
        tail = positions[:, -1:] + torch.arange(1, extra + 1)
        out["position_ids"] = torch.cat([positions, tail], dim=1)
    return out


def _micro_batch(batch: dict, seq_len: int, device: torch.device) -> tuple[tuple, torch.Tensor]:
    """A loader's batch as the pipeline's `(inputs, labels)` micro-batch on `device`, padded to `seq_len`."""
    inputs, labels = pipeline_inputs(pad_batch(batch, seq_len))
    return tuple(t.to(device) for t in inputs), labels.to(device)


def eval_micro_batches(batches: int, accumulation: int) -> int:
    """The evaluation micro-batches a pipeline runs of `batches`: whole batches of `accumulation` (each
    `eval_batch` runs the schedule's fixed count); ValueError when not even one batch fits."""
    if batches < accumulation:
        raise ValueError(f"{batches} evaluation micro-batch(es) per rank, fewer than the {accumulation} "
                         "(gradient_accumulation_steps) a pipeline's eval_batch runs at once")
    return batches - batches % accumulation


class PipelineLMStep:
    """One optimizer step of a causal LM split over pipeline stages (see the module docstring)."""

    def __init__(self, engine: Any, loader: Optional[Iterable], seq_len: int) -> None:
        self.engine, self.loader, self.seq_len = engine, loader, int(seq_len)
        self.batches = Batches(loader) if loader is not None else None

    def _micro_batches(self) -> Iterator:
        assert self.batches is not None
        for batch in self.batches:
            yield _micro_batch(batch, self.seq_len, self.engine.device)

    def seek(self, samples: int) -> None:
        """Continue at a resumed run's data position: the micro-batches the data-parallel group consumed skipped."""
        if self.batches is not None and samples > 0:
            engine = self.engine
            self.batches.seek(samples, int(engine.train_micro_batch_size_per_gpu()) * int(engine.dp_world_size))

    def run(self) -> StepResult:
        engine = self.engine
        lr = float(engine.get_lr()[0])  # the rate this update applies
        reads = self.batches is not None and (engine.is_first_stage() or engine.is_last_stage())
        loss = engine.train_batch(self._micro_batches() if reads else None, aggregate=False)
        # the first stage's ranks count the batch's tokens (every micro-batch is padded to seq_len), the last
        # stage's hold its loss: the Trainer sums them over every rank
        tokens = (engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps() * self.seq_len
                  if engine.is_first_stage() else 0)
        return StepResult(loss=loss, lr=lr, tokens=tokens, loss_weight=1.0 if engine.is_last_stage() else 0.0)

    def client_state(self) -> Optional[dict]:
        return None


class PipelineEvaluator:
    """The Trainer's `evaluator` over a pipeline engine's `eval_batch` (see the module docstring)."""

    def __init__(self, engine: Any, loader: Iterable, batches: int, seq_len: int) -> None:
        self.engine, self.loader, self.seq_len = engine, loader, int(seq_len)
        self.batches = eval_micro_batches(int(batches), int(engine.gradient_accumulation_steps()))

    def __call__(self, when: str) -> Optional[dict]:
        """`{"eval_loss": mean loss}` after a step or training ("before": None, as the Trainer's own)."""
        if when == "before":
            return None
        engine = self.engine
        micro = None  # a middle stage reads nothing: its inputs come from the previous stage
        if engine.is_first_stage() or engine.is_last_stage():
            batches = iter(self.loader)
            micro = (_micro_batch(next(batches), self.seq_len, engine.device) for _ in range(self.batches))
        calls = self.batches // int(engine.gradient_accumulation_steps())
        total = torch.zeros((), dtype=torch.float64, device=engine.device)
        for _ in range(calls):  # each the mean of its micro-batches, the same count each: their mean is the mean
            total += engine.eval_batch(micro, aggregate=False).detach().to(torch.float64)
        # the one reduction path (the Trainer's evaluation's too): the last stage's ranks hold the sums of their
        # batches' means, weighed by their count; the other stages add nothing
        weight = float(calls) if engine.is_last_stage() else 0.0
        reduced = reduce_step(StepResult(loss=total, lr=float("nan"), tokens=0, loss_weight=weight), device=engine.device)
        return {"eval_loss": reduced.loss}
