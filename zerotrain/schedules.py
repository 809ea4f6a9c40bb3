"""DeepSpeed's LR schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle) as torch LR schedulers,
and `HFSchedule`: transformers' schedules (the HF Trainer's `lr_scheduler_type` curves).

Call `step()` once after every applied optimizer step, as DeepSpeed's engine does (an
overflow-skipped step does not advance the schedule). The lr each optimizer step uses is the
lr DeepSpeed's engine (0.19.8) uses at that step. DeepSpeed's schedulers start at
last_batch_iteration -1 and the engine calls their `step()` only after an optimizer step, so
optimizer step t runs with the schedule's value for index i = t - 1 (the scheduler's
`last_epoch` here counts the steps taken, t; i = last_epoch - 1). With W the warmup steps
(DeepSpeed raises 1 to 2; 0 is refused, as DeepSpeed refuses it) and T = total_num_steps:

    warmup fraction  g(i) = log(i + 1) / log(W)   ("log", the default)   for 0 <= i < W
                     g(i) = i / W                 ("linear")             for 0 <= i < W
    WarmupLR         lr = min_lr + (max_lr - min_lr) * g(i), max_lr after warmup; min_lr at t = 0
    WarmupDecayLR    as WarmupLR, then lr = min_lr + (max_lr - min_lr) * d(i),
                     d(i) = max(0, (T - i) / max(1, T - W)): linear decay to min_lr at T
    WarmupCosineLR   ratio = min_ratio + (1 - min_ratio) * g(i) during warmup, then
                     ratio = cos_min + (1 - cos_min) * (1 + cos(pi * p)) / 2,
                     p = min(1, (i - W + 1) / max(1, T - W)); lr = ratio * group's initial lr;
                     ratio 0 at t = 0 (DeepSpeed's first step runs at lr 0)

So with `warmup_num_steps: 2` the first two optimizer steps both run at warmup_min_lr.
WarmupLR/WarmupDecayLR set absolute lrs: the same for every group (or one per group when
the config gives a list). WarmupCosineLR scales each group's own initial lr. OneCycle
(DeepSpeed sets cycle_min_lr at construction and indexes its cycle by last_batch_iteration + 1)
uses index t directly.

A scheduler's state is its step count (`last_epoch`); its parameters come from the config, so a
state saved by an older zerotrain (which applied g(t) one step sooner) resumes under this rule.

HFSchedule (`{"type": "HFSchedule", "params": {"name": "linear", "num_warmup_steps": W,
"num_training_steps": T}}`, what `lr_scheduler_type` makes) is built by `transformers.get_scheduler`,
so optimizer step t (from 1) runs at lr * f(t - 1), f the schedule's factor: exactly the HF Trainer's
curve, which steps its scheduler after each optimizer step too (with W = 0, step 1 runs at the full lr).
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
from torch.optim.lr_scheduler import LRScheduler

from .config import ConfigError, SchedulerConfig

__all__ = ["build_scheduler", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "HFSchedule"]


def _effective_warmup(steps: int, key: str = "scheduler.params.warmup_num_steps") -> int:
    """DeepSpeed's rule: at least 2 warmup steps; 0 (or less) is refused, as DeepSpeed 0.19.6+ refuses it."""
    if steps <= 0:
        raise ConfigError(f"{key}: must be a positive integer, got {steps} (DeepSpeed refuses it too; 1 means "
                          f"the shortest warmup, which DeepSpeed and zerotrain raise to 2 steps)", key=key)
    return max(2, steps)


def _warmup_fraction(i: int, warmup: int, kind: str) -> Optional[float]:
    """g(i) during warmup, None once it is over (i: DeepSpeed's last_batch_iteration, >= 0)."""
    if i >= warmup:
        return None
    if kind == "linear":
        return i / warmup
    return math.log(i + 1) / math.log(warmup)


class _DeepSpeedIndexed(LRScheduler):
    """Common to the warmup schedules: the lr is a function of DeepSpeed's index i = last_epoch - 1, and
    the state that carries over a resume is the step count only."""

    _COUNTERS = ("last_epoch", "_step_count")

    def load_state_dict(self, state_dict: dict) -> None:
        """Take the step count from `state_dict` (also one saved by an older zerotrain, whose other entries
        are ignored: the parameters come from this run's config) and set the lr the next step uses."""
        for key in self._COUNTERS:
            if key in state_dict:
                setattr(self, key, state_dict[key])
        values = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values):
            group["lr"] = lr
        self._last_lr = list(values)


def _per_group(value, optimizer: torch.optim.Optimizer, key: str) -> list[float]:
    count = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ConfigError(f"{key}: {len(value)} values given for {count} parameter groups", key=key)
        return [float(v) for v in value]
    return [float(value)] * count


class WarmupLR(_DeepSpeedIndexed):
    """min_lr -> max_lr over `warmup_num_steps` (log or linear), then max_lr (default: each group's lr)."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr=0.0, warmup_max_lr=None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_epoch: int = -1):
        if warmup_max_lr is None:  # DeepSpeed's default: each group's own lr
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(warmup_min_lr, optimizer, "scheduler.params.warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, optimizer, "scheduler.params.warmup_max_lr")
        self.warmup_num_steps = _effective_warmup(int(warmup_num_steps))
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def _after_warmup(self, i: int) -> float:
        return 1.0

    def get_lr(self) -> list[float]:
        i = self.last_epoch - 1
        if i < 0:  # DeepSpeed sets min_lr at construction
            return list(self.min_lrs)
        gamma = _warmup_fraction(i, self.warmup_num_steps, self.warmup_type)
        if gamma is None:
            gamma = self._after_warmup(i)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to warmup_min_lr (0 by default) at `total_num_steps`."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr=0.0,
                 warmup_max_lr=0.001, warmup_num_steps: int = 1000, warmup_type: str = "log", last_epoch: int = -1):
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch)

    def _after_warmup(self, i: int) -> float:
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - i) / span)


class WarmupCosineLR(_DeepSpeedIndexed):
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

    def lr_ratio(self, i: int) -> float:
        """Ratio of the initial lr at DeepSpeed's index i (optimizer step i + 1); 0 before the first step."""
        if i < 0:
            return 0.0
        gamma = _warmup_fraction(i, self.warmup_num_steps, self.warmup_type)
        if gamma is not None:
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (i - self.warmup_num_steps + 1) / span)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.lr_ratio(self.last_epoch - 1)
        return [base * ratio for base in self.base_lrs]


class OneCycle(_DeepSpeedIndexed):
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

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._set_momenta()

    def step(self, epoch=None) -> None:
        super().step(epoch)
        self._set_momenta()

    def _set_momenta(self) -> None:
        if self.cycle_momentum:
            for group, beta1 in zip(self.optimizer.param_groups, self.momenta(max(self.last_epoch, 0))):
                group["betas"] = (beta1, 0.99)


class HFSchedule(_DeepSpeedIndexed):
    """transformers' schedule `name` (`transformers.get_scheduler`: linear, cosine, constant,
    constant_with_warmup): each group's initial lr times the schedule's factor at the step count.

    transformers builds the factor functions (the field's library, and so the HF Trainer's curve exactly);
    this class only keeps them and, like the DeepSpeed schedules above, stores the step count alone (the
    functions are not checkpoint state: they come from the config again on resume)."""

    def __init__(self, optimizer: torch.optim.Optimizer, name: str = "linear", num_warmup_steps: int = 0,
                 num_training_steps: Optional[int] = None, last_epoch: int = -1):
        try:
            from transformers import get_scheduler  # lazy: only this scheduler type needs transformers
        except ImportError:
            raise ConfigError("scheduler.type: HFSchedule needs transformers (pip install 'zerotrain[hf]')",
                              key="scheduler.type") from None
        built = get_scheduler(name, optimizer, num_warmup_steps=int(num_warmup_steps),
                              num_training_steps=None if num_training_steps is None else int(num_training_steps))
        self.name = name
        self._factors = list(built.lr_lambdas)  # torch LambdaLR's documented per-group functions
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        step = max(self.last_epoch, 0)
        return [base * factor(step) for base, factor in zip(self.base_lrs, self._factors)]

    def state_dict(self) -> dict:
        """The step count and last lrs (JSON-ready; the factor functions are rebuilt from the config)."""
        return {key: value for key, value in super().state_dict().items() if key != "_factors"}


_BUILDERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
             "OneCycle": OneCycle, "HFSchedule": HFSchedule}


def build_scheduler(sched_cfg: Optional[SchedulerConfig], optimizer: torch.optim.Optimizer) -> Optional[LRScheduler]:
    """The scheduler the config names, driving `optimizer`; None when the config has none."""
    if sched_cfg is None:
        return None
    if sched_cfg.type not in _BUILDERS:
        raise ConfigError(f"scheduler.type: cannot build {sched_cfg.type!r}", key="scheduler.type")
    return _BUILDERS[sched_cfg.type](optimizer, **sched_cfg.params)
