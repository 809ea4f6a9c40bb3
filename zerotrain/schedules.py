"""DeepSpeed's LR schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR) as torch LR schedulers.

Call `step()` once after every optimizer step, as DeepSpeed's engine does. The lr used by
optimizer step t (t = 0, 1, ...; the scheduler's `last_epoch`) is, with W the warmup steps
and T = total_num_steps:

    warmup fraction  g(t) = log(t + 1) / log(W)   ("log", the default)   for t < W
                     g(t) = t / W                 ("linear")             for t < W
    WarmupLR         lr = min_lr + (max_lr - min_lr) * g(t), max_lr after warmup
    WarmupDecayLR    as WarmupLR, then lr = min_lr + (max_lr - min_lr) * d(t),
                     d(t) = max(0, (T - t) / max(1, T - W)): linear decay to min_lr at T
    WarmupCosineLR   ratio = min_ratio + (1 - min_ratio) * g(t) during warmup, then
                     ratio = cos_min + (1 - cos_min) * (1 + cos(pi * p)) / 2,
                     p = min(1, (t - W + 1) / max(1, T - W)); lr = ratio * group's initial lr

WarmupLR/WarmupDecayLR set absolute lrs: the same for every group (or one per group when
the config gives a list). WarmupCosineLR scales each group's own initial lr.

Differences from DeepSpeed, on purpose: `warmup_num_steps: 0` means no warmup (DeepSpeed
raises it to 2, as it does for 1, which we keep); the cosine stays at `cos_min_ratio`
after T instead of rising again; the lr is set at construction to the step-0 value
(DeepSpeed sets 0 there, which is the same value whenever the warmup starts at 0).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.optim.lr_scheduler import LRScheduler

from .config import ConfigError, SchedulerConfig

__all__ = ["build_scheduler", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]


def _effective_warmup(steps: int) -> int:
    return 0 if steps == 0 else max(2, steps)


def _warmup_fraction(t: int, warmup: int, kind: str) -> Optional[float]:
    """g(t) during warmup, None once it is over."""
    if t >= warmup:
        return None
    if kind == "linear":
        return t / warmup
    return math.log(t + 1) / math.log(warmup)


def _per_group(value, optimizer: torch.optim.Optimizer, key: str) -> list[float]:
    count = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ConfigError(f"{key}: {len(value)} values given for {count} parameter groups", key=key)
        return [float(v) for v in value]
    return [float(value)] * count


class WarmupLR(LRScheduler):
    """min_lr -> max_lr over `warmup_num_steps` (log or linear), then max_lr."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_epoch: int = -1):
        self.min_lrs = _per_group(warmup_min_lr, optimizer, "scheduler.params.warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, optimizer, "scheduler.params.warmup_max_lr")
        self.warmup_num_steps = _effective_warmup(int(warmup_num_steps))
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def _after_warmup(self, t: int) -> float:
        return 1.0

    def get_lr(self) -> list[float]:
        t = max(self.last_epoch, 0)
        gamma = _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
        if gamma is None:
            gamma = self._after_warmup(t)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to warmup_min_lr (0 by default) at `total_num_steps`."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr=0.0,
                 warmup_max_lr=0.001, warmup_num_steps: int = 1000, warmup_type: str = "log", last_epoch: int = -1):
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch)

    def _after_warmup(self, t: int) -> float:
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - t) / span)


class WarmupCosineLR(LRScheduler):
    """Ratio of each group's initial lr: warmup_min_ratio -> 1 over the warmup, cosine down to cos_min_ratio."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_epoch: int = -1):
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = _effective_warmup(int(warmup_num_steps))
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def lr_ratio(self, t: int) -> float:
        gamma = _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
        if gamma is not None:
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (t - self.warmup_num_steps + 1) / span)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.lr_ratio(max(self.last_epoch, 0))
        return [base * ratio for base in self.base_lrs]


_BUILDERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


def build_scheduler(sched_cfg: Optional[SchedulerConfig], optimizer: torch.optim.Optimizer) -> Optional[LRScheduler]:
    """The scheduler the config names, driving `optimizer`; None when the config has none."""
    if sched_cfg is None:
        return None
    if sched_cfg.type not in _BUILDERS:
        raise ConfigError(f"scheduler.type: cannot build {sched_cfg.type!r}", key="scheduler.type")
    return _BUILDERS[sched_cfg.type](optimizer, **sched_cfg.params)
