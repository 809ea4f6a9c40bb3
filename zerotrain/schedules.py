"""DeepSpeed's LR schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle) as torch LR schedulers.

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
import warnings
from typing import Optional

import torch
from torch.optim.lr_scheduler import LRScheduler

from .config import ConfigError, SchedulerConfig

__all__ = ["build_scheduler", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"]


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


class OneCycle(LRScheduler):
    """DeepSpeed's OneCycle: lr from cycle_min_lr up to cycle_max_lr and back over one cycle (optionally
    in stairs), then decaying; with `cycle_momentum`, Adam's beta1 moves the opposite way.

    The lr used by optimizer step t, with F / S the first / second step sizes and C = F + S:

        t <= C   x = t / C - floor(t / C); scale = x / r if x <= r else (x - 1) / (r - 1), r = F / C
                 (with a stair count N for that half: scale = floor(position * N) / N, position from the
                 integer step within the cycle); lr = min_lr + (max_lr - min_lr) * scale
        t >  C   lr = min_lr / (1 + decay_lr_rate * (t - C) / decay_step_size)   (min_lr when either is 0)

    beta1 = max_mom - (max_mom - min_mom) * scale in the cycle, then max_mom * (1 + decay_mom_rate *
    (t - C) / decay_step_size). As in DeepSpeed: step 0 runs with beta1 = cycle_min_mom, the betas
    become (beta1, 0.99) (the optimizer's own beta2 is replaced; a warning says so when it differs),
    and optimizers without betas (SGD) keep their momentum, with a warning.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: Optional[int] = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: Optional[int] = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom=0.8, cycle_max_mom=0.9,
                 decay_mom_rate: float = 0.0, last_epoch: int = -1):
        self.first = int(cycle_first_step_size)
        self.second = self.first if cycle_second_step_size is None else int(cycle_second_step_size)
        if self.first <= 0:
            raise ConfigError("scheduler.params.cycle_first_step_size: must be positive",
                              key="scheduler.params.cycle_first_step_size")
        self.total = self.first + self.second
        self.first_stairs = int(cycle_first_stair_count)
        self.second_stairs = self.first_stairs if cycle_second_stair_count is None else int(cycle_second_stair_count)
        self.min_lrs = _per_group(cycle_min_lr, optimizer, "scheduler.params.cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, optimizer, "scheduler.params.cycle_max_lr")
        self.decay_step_size, self.decay_lr_rate, self.decay_mom_rate = int(decay_step_size), float(decay_lr_rate), \
            float(decay_mom_rate)
        self.min_moms = _per_group(cycle_min_mom, optimizer, "scheduler.params.cycle_min_mom")
        self.max_moms = _per_group(cycle_max_mom, optimizer, "scheduler.params.cycle_max_mom")
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in optimizer.defaults:
            warnings.warn(f"scheduler OneCycle: cycle_momentum has no effect: {type(optimizer).__name__} has no "
                          f"betas (as in DeepSpeed, its momentum is left as it is)", UserWarning, stacklevel=2)
            self.cycle_momentum = False
        if self.cycle_momentum and any(g["betas"][1] != 0.99 for g in optimizer.param_groups):
            warnings.warn("scheduler OneCycle with cycle_momentum sets each group's betas to (momentum, 0.99), as "
                          "DeepSpeed does, replacing the optimizer's beta2; set cycle_momentum false to keep it",
                          UserWarning, stacklevel=2)
        super().__init__(optimizer, last_epoch)

    def _scale(self, t: int) -> float:
        cycles = math.floor(1 + t / self.total)
        x = 1.0 + t / self.total - cycles
        ratio = self.first / self.total
        if x <= ratio:
            scale, stairs = x / ratio, self.first_stairs
        else:
            scale, stairs = (x - 1) / (ratio - 1), self.second_stairs
        if stairs > 0:  # from the integer step: a float scale just under a stair would drop a whole stair
            within = t % self.total
            position = within * stairs / self.first if within <= self.first \
                else (self.total - within) * stairs / self.second
            scale = math.floor(position) / stairs
        return scale

    def _decay_interval(self, t: int, rate: float) -> Optional[float]:
        if self.decay_step_size == 0 or rate == 0:
            return None
        return (t - self.total) / self.decay_step_size

    def get_lr(self) -> list[float]:
        t = max(self.last_epoch, 0)
        if t <= self.total:
            scale = self._scale(t)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        interval = self._decay_interval(t, self.decay_lr_rate)
        return list(self.min_lrs) if interval is None else [lo / (1 + self.decay_lr_rate * interval)
                                                            for lo in self.min_lrs]

    def momenta(self, t: int) -> list[float]:
        """beta1 of each group for optimizer step t."""
        if t == 0:
            return list(self.min_moms)
        if t <= self.total:
            scale = self._scale(t)
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        interval = self._decay_interval(t, self.decay_mom_rate)
        return list(self.max_moms) if interval is None else [hi * (1 + self.decay_mom_rate * interval)
                                                             for hi in self.max_moms]

    def step(self, epoch=None) -> None:
        super().step(epoch)
        if self.cycle_momentum:
            for group, beta1 in zip(self.optimizer.param_groups, self.momenta(max(self.last_epoch, 0))):
                group["betas"] = (beta1, 0.99)


_BUILDERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
             "OneCycle": OneCycle}


def build_scheduler(sched_cfg: Optional[SchedulerConfig], optimizer: torch.optim.Optimizer) -> Optional[LRScheduler]:
    """The scheduler the config names, driving `optimizer`; None when the config has none."""
    if sched_cfg is None:
        return None
    if sched_cfg.type not in _BUILDERS:
        raise ConfigError(f"scheduler.type: cannot build {sched_cfg.type!r}", key="scheduler.type")
    return _BUILDERS[sched_cfg.type](optimizer, **sched_cfg.params)
