"""`RepeatingLoader`: DeepSpeed's wrapper that restarts an iterable when it is exhausted."""
from __future__ import annotations

from typing import Any, Iterable, Iterator

__all__ = ["RepeatingLoader"]


class RepeatingLoader:
    """Iterate `loader` forever: at its end, start it again (a DistributedSampler reshuffles if its epoch is set)."""

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader
        self.data_iter: Iterator = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
