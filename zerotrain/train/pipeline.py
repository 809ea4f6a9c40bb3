"""`zerotrain train --pipeline-parallel-size N`: the language-model step over a pipeline engine.

The Trainer's own step calls `engine(**batch)` / `backward` / `step` per micro-batch; a pipeline engine runs a
whole batch in `train_batch(data_iter)` (torch's schedule), so `PipelineLMStep` is plugged into the Trainer
(`step=`): per optimizer step it hands the engine `gradient_accumulation_steps` micro-batches of the run's loader,
each padded on the right to the sequence length (a `PipelineStage` exchanges fixed shapes: label -100 and mask 0
on the padding) and made the split model's inputs (`zerotrain.pipe.hf.pipeline_inputs`). Only the ranks of the
first and last stage are given a loader; the others never build one.

`PipelineEvaluator` is the Trainer's `evaluator` with a pipeline: the evaluation micro-batches (the eval loader's
first `batches`, rounded down to whole batches of `gradient_accumulation_steps`: the schedule runs a fixed number
of micro-batches) go through the engine's `eval_batch` (every stage runs its forwards, the loss is the last
stage's, averaged over the data-parallel ranks and broadcast); the mean over those batches is the mean of the
micro-batch losses, the `eval_loss` the Trainer's own evaluation reports without a pipeline.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch

from zerotrain.pipe.hf import pipeline_inputs
from zerotrain.trainer import StepResult

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
        self._batches: Optional[Iterator] = None
        self._epoch = 0

    def _next(self) -> dict:
        assert self.loader is not None
        for _ in range(2):
            if self._batches is None:
                self._batches = iter(self.loader)
            try:
                return next(self._batches)
            except StopIteration:
                self._batches, self._epoch = None, self._epoch + 1
        raise RuntimeError("the training dataloader yields no batches")

    def _micro_batches(self) -> Iterator:
        while True:
            yield _micro_batch(self._next(), self.seq_len, self.engine.device)

    def run(self) -> StepResult:
        engine = self.engine
        lr = float(engine.get_lr()[0])  # the rate this update applies
        reads = self.loader is not None and (engine.is_first_stage() or engine.is_last_stage())
        loss = engine.train_batch(self._micro_batches() if reads else None)
        tokens = engine.train_batch_size() * self.seq_len  # every micro-batch is padded to seq_len
        return StepResult(loss=float(loss), lr=lr, tokens=int(tokens), memory=[])

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
        total = 0.0
        for _ in range(calls):  # each the mean of its micro-batches, the same count each: their mean is the mean
            total += float(engine.eval_batch(micro))
        return {"eval_loss": total / calls}
