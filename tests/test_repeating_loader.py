"""`zerotrain.utils.RepeatingLoader` against DeepSpeed's own (in-process, issue #48): the same items in the same
order across restarts, a fresh pass of the underlying loader at each (a sampler's new epoch shows)."""
from __future__ import annotations

import importlib.util

import pytest


class Epochs:
    """An iterable whose every pass yields (pass number, item): a restart must call `iter` again."""

    def __init__(self, items: int) -> None:
        self.items, self.passes = items, 0

    def __iter__(self):
        self.passes += 1
        return iter([(self.passes, i) for i in range(self.items)])


def test_repeats_forever_starting_a_new_pass_at_each_end():
    from zerotrain.utils.repeating import RepeatingLoader

    loader = RepeatingLoader(Epochs(3))
    assert iter(loader) is loader
    assert [next(loader) for _ in range(7)] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2), (3, 0)]
    assert loader.loader.passes == 3


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_the_same_items_as_deepspeeds_repeating_loader():
    from deepspeed.runtime.dataloader import RepeatingLoader as DeepSpeeds

    from zerotrain.utils.repeating import RepeatingLoader

    ours, theirs = RepeatingLoader(Epochs(2)), DeepSpeeds(Epochs(2))
    assert [next(ours) for _ in range(5)] == [next(theirs) for _ in range(5)]
