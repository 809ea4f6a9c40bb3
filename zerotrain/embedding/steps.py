"""The contrastive step as the training loop's pluggable step (`zerotrain.trainer.TrainStep`).

`zerotrain train-embedding` runs the one training loop every zerotrain run uses (`zerotrain.trainer.Trainer`:
counting, metrics, evaluation, checkpoints, progress, the summary); what differs is the step, this one:
the next global batch of pairs in data order (no text twice in a batch, `global_batches`), this rank's
micro-batches of it, one GradCache step over them (`ContrastiveStep`), and the data position that goes into
every checkpoint so `--resume` continues at the exact next batch at any world size.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from zerotrain.trainer import StepResult
from zerotrain.training_engine import TrainingEngine

from .data import DataPosition, PairData, global_batches, rank_micro_batches, tokenize_micro_batch
from .gradcache import ContrastiveStep

__all__ = ["PairSteps", "epoch_batches", "steps_in_epochs"]


def epoch_batches(data: PairData, position: DataPosition) -> list[list[int]]:
    """The global batches of the position's epoch; an error when the data cannot fill one."""
    batches = list(global_batches(data, position.global_batch, seed=position.seed, epoch=position.epoch))
    if not batches:
        raise ValueError(f"{len(data)} pairs cannot fill one batch of {position.global_batch} queries without "
                         "duplicate texts: use a smaller batch or more data")
    return batches


def steps_in_epochs(data: PairData, position: DataPosition, epochs: int) -> int:
    """Optimizer steps from `position` to the end of epoch `epochs - 1` (each epoch's batches counted, as
    duplicate texts may leave an epoch fewer)."""
    steps = 0
    for epoch in range(position.epoch, epochs):
        count = len(epoch_batches(data, dataclasses.replace(position, epoch=epoch, batch=0)))
        steps += count - (position.batch if epoch == position.epoch else 0)
    return max(steps, 0)


class PairSteps:
    """Optimizer steps over pair data from `position` on: each `run()` one contrastive step over the next
    global batch (this rank's micro-batches of it), the position advanced past it."""

    def __init__(self, engine: TrainingEngine, step: ContrastiveStep, data: PairData, position: DataPosition,
                 tokenizer: Any, max_length: int, rank: int, world: int, accumulation: int,
                 extra_state: Optional[dict] = None):
        self.engine, self.contrastive, self.data, self.position = engine, step, data, position
        self.tokenizer, self.max_length = tokenizer, max_length
        self.rank, self.world, self.accumulation = rank, world, accumulation
        self.extra_state = dict(extra_state or {})
        self._batches: Optional[list[list[int]]] = None

    def run(self) -> StepResult:
        position = self.position
        if self._batches is None:
            self._batches = epoch_batches(self.data, position)
        if position.batch >= len(self._batches):  # the epoch is done: the next one's order
            position.epoch, position.batch = position.epoch + 1, 0
            self._batches = epoch_batches(self.data, position)
        device = self.engine.device
        micro_batches = [tokenize_micro_batch(self.data, part, self.tokenizer, self.max_length, device)
                         for part in rank_micro_batches(self._batches[position.batch], self.rank, self.world,
                                                        self.accumulation)]
        lr = float(self.engine.get_lr()[0])  # the rate this update applies
        loss = self.contrastive.step(micro_batches)
        position.batch += 1
        position.consumed_samples += position.global_batch
        if position.batch >= len(self._batches):  # a checkpoint here resumes at the next epoch's start
            position.epoch, position.batch = position.epoch + 1, 0
            self._batches = None
        return StepResult(loss=loss, lr=lr, tokens=self.contrastive.tokens)

    def seek(self, samples: int) -> None:
        """Nothing to seek: the data position comes from the checkpoint's client state (`position`)."""

    def client_state(self) -> Optional[dict]:
        """The data position (and what the command adds, the pooling) under "embedding"."""
        return {"embedding": {**self.extra_state, "data": self.position.to_dict()}}
