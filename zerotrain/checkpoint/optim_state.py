"""The optimizer's state as a checkpoint sees it: per-element tensors, scalars, group hyperparameters.

A torch optimizer keeps, for each master tensor, per-element tensors laid out like the
master (AdamW: exp_avg, exp_avg_sq; amsgrad adds max_exp_avg_sq; SGD with momentum:
momentum_buffer) and scalars (step). Per-element states are saved like parameters,
as whole tensors `name/exp_avg` assembled from every rank's pieces; scalars are saved
per parameter as 0-d tensors (`name/step`).

An optimizer that has not stepped yet has no state. To load into it, the keys,
dtypes and devices its state would have are found by stepping a throwaway copy of it
(same class, same group hyperparameters) over a one-element tensor on the master's
device: this works for any element-wise torch optimizer, and follows torch's own
choices (fused Adam keeps `step` on the device, foreach keeps it on the CPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .format import CheckpointError
from .state import decode, encode

# Group keys that choose an implementation rather than the math: kept from the running optimizer.
_IMPLEMENTATION_KEYS = {"params", "fused", "foreach", "capturable", "differentiable"}


@dataclass(frozen=True)
class StateTemplate:
    """The state one master tensor gets from its optimizer: per-element and scalar keys."""

    elementwise: dict  # key -> dtype
    scalars: dict      # key -> (dtype or None for a Python number, device)


def split_state(state: dict, master: torch.Tensor) -> tuple[dict, dict]:
    """(per-element tensors, scalars) of one master's optimizer state."""
    elementwise, scalars = {}, {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() == 1 and value.numel() == master.numel():
            elementwise[key] = value
        elif torch.is_tensor(value) and value.numel() == 1:
            scalars[key] = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            scalars[key] = value
        elif value is not None:
            raise CheckpointError(f"optimizer state {key!r} ({type(value).__name__}"
                                  f"{tuple(value.shape) if torch.is_tensor(value) else ''}) is neither "
                                  f"per-element nor a scalar; zerotrain cannot checkpoint it")
    return elementwise, scalars


def scalar_value(value) -> float:
    return float(value.item()) if torch.is_tensor(value) else float(value)


def probe_template(optimizer: torch.optim.Optimizer, group_index: int, master: torch.Tensor) -> StateTemplate:
    """The state keys `optimizer` creates for a master of group `group_index`, found by a throwaway step."""
    group = optimizer.param_groups[group_index]
    existing = optimizer.state.get(master)
    if existing:
        elementwise, scalars = split_state(existing, master)
        return StateTemplate({k: v.dtype for k, v in elementwise.items()},
                             {k: (v.dtype, v.device) if torch.is_tensor(v) else (None, None)
                              for k, v in scalars.items()})
    dummy = torch.zeros(1, dtype=master.dtype, device=master.device, requires_grad=True)
    hyper = {k: v for k, v in group.items() if k != "params"}
    try:
        probe = type(optimizer)([{"params": [dummy], **hyper}])
        dummy.grad = torch.zeros_like(dummy)
        probe.step()
    except Exception as error:  # noqa: BLE001 - any failure means we cannot know the layout
        raise CheckpointError(f"cannot tell which state {type(optimizer).__name__} keeps (a trial step "
                              f"failed: {error}); load its states after a first step") from error
    elementwise, scalars = split_state(probe.state.get(dummy, {}), dummy)
    return StateTemplate({k: v.dtype for k, v in elementwise.items()},
                         {k: (v.dtype, v.device) if torch.is_tensor(v) else (None, None)
                          for k, v in scalars.items()})


def make_scalar(template: StateTemplate, key: str, value: float):
    dtype, device = template.scalars.get(key, (torch.float32, torch.device("cpu")))
    if dtype is None:
        return int(value) if float(value).is_integer() else value
    return torch.tensor(value, dtype=dtype, device=device)


def group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's hyperparameters (no tensors), JSON-ready."""
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        hyper = {}
        for key, value in group.items():
            if key == "params":
                continue
            if torch.is_tensor(value):
                value = value.item() if value.numel() == 1 else value
            hyper[key] = encode(value, f"optimizer.param_groups[{index}][{key!r}]")
        groups.append(hyper)
    return groups


def check_groups(saved: list, optimizer: torch.optim.Optimizer) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved)} parameter groups, this engine's has "
                              f"{len(optimizer.param_groups)}")


def restore_hyperparameters(saved: list, optimizer: torch.optim.Optimizer) -> None:
    """Set each group's hyperparameters (lr, betas, weight_decay, ...) as saved; keep implementation flags."""
    for group, hyper in zip(optimizer.param_groups, saved):
        for key, value in hyper.items():
            if key in _IMPLEMENTATION_KEYS:
                continue
            value = decode(value)
            current = group.get(key)
            if torch.is_tensor(current) and not torch.is_tensor(value):
                current.fill_(value)
                continue
            if isinstance(current, tuple) and isinstance(value, list):
                value = tuple(value)
            group[key] = value
