"""A deterministic, resumable sampler whose only state is the number of samples consumed.

The job sees ONE global stream of sample indices, independent of the world size: epoch ``e`` is
a permutation of ``range(num_samples)`` drawn from ``seed + e`` (or the identity with
``shuffle=False``), and the epochs follow one another. Training consumes that stream in global
batches of ``global_batch_size`` samples (DeepSpeed's ``train_batch_size`` = micro batch x
gradient accumulation x data-parallel size); within a global batch, data-parallel rank ``r``
takes the ``r``-th contiguous share. Since the stream does not depend on the world size, resuming
from ``consumed_samples`` (kept in ``trainer_state.json``) continues at exactly the next sample, at
the same or another data-parallel size, as long as the global batch size is the same.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch.utils.data import Sampler

__all__ = ["ResumableSampler"]


class ResumableSampler(Sampler[int]):
    """This rank's sample indices, from ``consumed_samples`` on.

    ``num_epochs=None`` makes the stream endless (stop by step count); otherwise it ends after
    the last *full* global batch of the last epoch. Iterating yields ``global_batch_size //
    dp_size`` indices per global batch; feed it to a ``DataLoader`` with ``batch_size`` = the
    micro batch (so one global batch = ``gradient_accumulation`` micro batches on each rank).
    The trainer, not the sampler, keeps the authoritative count (a ``DataLoader`` prefetches
    ahead of training): pass it back as ``consumed_samples`` / :meth:`load_state_dict` on resume.
    """

    def __init__(self, num_samples: int, *, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, shuffle: bool = True, consumed_samples: int = 0,
                 num_epochs: Optional[int] = None) -> None:
        if num_samples <= 0:
            raise ValueError("the dataset is empty: no samples to draw")
        if global_batch_size <= 0 or global_batch_size % dp_size:
            raise ValueError(f"global_batch_size {global_batch_size} must be a positive multiple of the "
                             f"data-parallel size {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        if consumed_samples % global_batch_size:
            raise ValueError(f"consumed_samples {consumed_samples} is not a multiple of the global batch size "
                             f"{global_batch_size}: resume needs the same global batch size as the saved run")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.num_epochs = num_epochs
        self.consumed_samples = consumed_samples
        self._perm_epoch: Optional[int] = None
        self._perm: Optional[torch.Tensor] = None

    # --- the global stream ------------------------------------------------------------------------------
    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm_epoch != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._perm = torch.randperm(self.num_samples, generator=g)
            else:
                self._perm = torch.arange(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def global_index(self, position: int) -> int:
        """The sample at ``position`` of the global stream."""
        epoch, offset = divmod(position, self.num_samples)
        return int(self._order(epoch)[offset])

    @property
    def total_samples(self) -> Optional[int]:
        """Stream length (full global batches only), None when endless."""
        if self.num_epochs is None:
            return None
        return (self.num_epochs * self.num_samples) // self.global_batch_size * self.global_batch_size

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.num_samples

    # --- this rank's share -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        share = self.global_batch_size // self.dp_size
        total = self.total_samples
        start = self.consumed_samples
        while total is None or start + self.global_batch_size <= total:
            first = start + self.dp_rank * share
            for pos in range(first, first + share):
                yield self.global_index(pos)
            start += self.global_batch_size
            self.consumed_samples = start  # advanced once this rank has handed out its whole share

    def __len__(self) -> int:
        total = self.total_samples
        if total is None:
            raise TypeError("an endless ResumableSampler (num_epochs=None) has no length")
        return max(0, total - self.consumed_samples) // self.dp_size

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the saved ``consumed_samples`` (``seed``/``num_samples`` are checked if present)."""
        for key in ("seed", "num_samples"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]} but this run has {getattr(self, key)}: "
                                 "the data or seed changed, so the saved position means another sample")
        consumed = int(state["consumed_samples"])
        if consumed % self.global_batch_size:
            raise ValueError(f"consumed_samples {consumed} is not a multiple of the global batch size "
                             f"{self.global_batch_size}: resume needs the same global batch size")
        self.consumed_samples = consumed
