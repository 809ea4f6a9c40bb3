"""Run a torch optimizer's update on a subset of its parameters.

Offloaded steps update one bucket (SuperOffload, during backward) or one chunk of a
bucket (NVMe, between reads and writes) at a time. `SubsetStepper` does that with a
"shadow" optimizer of the same class over just those tensors: before each step its
groups take the hyperparameters of the matching groups of the real optimizer (so LR
schedules apply), and its state is the real optimizer's state (or a state dict the
caller builds, e.g. views into I/O buffers). Any element-wise torch optimizer works,
and the fused CPU Adam(W) kernel runs unchanged, on exactly the same numbers as a step
of the whole optimizer would.

The real optimizer's `param_groups` are never modified, so the engine's scheduler and
checkpoint code can read them at any time; the shadow's cost is O(subset), not O(all
parameters). `probe_state_layout` tells which per-element states an optimizer keeps
(the NVMe swapper sizes its files and buffers from it).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence

import torch


class SubsetStepper:
    """Steps chosen parameters of `optimizer` (found in its groups by `group_index`)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._shadows: dict[tuple, tuple[torch.optim.Optimizer, list[int]]] = {}

    def _shadow(self, params: Sequence[torch.Tensor], groups: Sequence[int]):
        key = tuple(id(p) for p in params)
        found = self._shadows.get(key)
        if found is not None:
            return found
        by_group: dict[int, list[torch.Tensor]] = {}
        for param, group in zip(params, groups):
            by_group.setdefault(group, []).append(param)
        order = sorted(by_group)
        specs = [dict(self._hyper(g), params=by_group[g]) for g in order]
        try:
            shadow = type(self.optimizer)(specs, **self.optimizer.defaults)
        except TypeError:  # a custom optimizer whose defaults are not its constructor's keywords
            shadow = type(self.optimizer)(specs)
        self._shadows[key] = (shadow, order)
        return shadow, order

    def _hyper(self, group_index: int) -> dict:
        return {k: v for k, v in self.optimizer.param_groups[group_index].items() if k != "params"}

    def step(self, params: Sequence[torch.Tensor], groups: Sequence[int], state: Optional[dict] = None) -> None:
        """Update `params` (their `.grad` set by the caller) with the current hyperparameters.

        `state` maps each param to its state dict; by default the real optimizer's state.
        """
        if not params:
            return
        shadow, order = self._shadow(params, groups)
        for shadow_group, group_index in zip(shadow.param_groups, order):
            shadow_group.update(self._hyper(group_index))
        if state is None:
            shadow.state = self.optimizer.state
        else:
            shadow.state = state if isinstance(state, defaultdict) else defaultdict(dict, state)
        try:
            shadow.step()
        finally:
            shadow.state = defaultdict(dict)  # hold no reference to the caller's tensors


def probe_state_layout(optimizer: torch.optim.Optimizer, group_index: int) -> list[tuple[str, torch.dtype]]:
    """The per-element state keys (and dtypes) `optimizer` keeps for group `group_index`, by a trial step."""
    hyper = {k: v for k, v in optimizer.param_groups[group_index].items() if k != "params"}
    dummy = torch.zeros(2, requires_grad=True)
    probe = type(optimizer)([dict(hyper, params=[dummy])])
    dummy.grad = torch.zeros(2)
    probe.step()
    state = probe.state.get(dummy, {})
    return sorted((k, v.dtype) for k, v in state.items() if torch.is_tensor(v) and tuple(v.shape) == (2,))
