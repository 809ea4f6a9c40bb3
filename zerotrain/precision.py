"""Mixed-precision policy and fp16 loss scaling.

bf16 and fp32 need no scaling (the scale stays 1). fp16 uses either a static
scale (`fp16.loss_scale` > 0) or DeepSpeed's dynamic rule: start at
2**initial_scale_power; on an overflow skip the step and, once `hysteresis`
overflows have been absorbed, halve the scale (never below min_loss_scale);
after `loss_scale_window` clean steps since the last overflow, double it. An
overflow that would lower the scale while it already is `min_loss_scale` raises
:class:`LossScaleError`, as DeepSpeed's DynamicLossScaler does (`raise_error_at_min_scale`,
always on in its engine): the run cannot make progress any more.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def training_dtype(precision: str) -> torch.dtype:
    """The dtype model weights and activations use for a precision name."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


class LossScaleError(RuntimeError):
    """An fp16 gradient overflow with the loss scale already at `fp16.min_loss_scale`."""


@dataclass
class LossScaler:
    """Loss scale state; `dynamic=False` keeps `scale` fixed."""

    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    factor: float = 2.0
    iteration: int = 0
    last_overflow_iteration: int = -1
    hysteresis_left: int = 2

    @classmethod
    def from_config(cls, fp16_config) -> "LossScaler":
        """Build from the config's `fp16` block (disabled block: a fixed scale of 1)."""
        if fp16_config is None or not fp16_config.enabled:
            return cls()
        if fp16_config.loss_scale and fp16_config.loss_scale > 0:
            return cls(scale=float(fp16_config.loss_scale))
        return cls(scale=float(2 ** fp16_config.initial_scale_power), dynamic=True,
                   window=fp16_config.loss_scale_window, hysteresis=fp16_config.hysteresis,
                   consecutive_hysteresis=fp16_config.consecutive_hysteresis,
                   min_scale=float(fp16_config.min_loss_scale), hysteresis_left=fp16_config.hysteresis)

    def update(self, overflow: bool) -> None:
        """Advance one optimizer step, given whether its gradients overflowed."""
        if not self.dynamic:
            self.iteration += 1
            return
        if overflow:
            if self.hysteresis <= 1 or self.hysteresis_left <= 1:
                if self.scale <= self.min_scale:
                    raise LossScaleError(
                        f"fp16 gradient overflow at optimizer step {self.iteration} with the loss scale already at "
                        f"fp16.min_loss_scale ({self.min_scale:g}): it cannot be lowered further, so every later "
                        "step would be skipped too (DeepSpeed stops here as well). Lower fp16.min_loss_scale, lower "
                        "the learning rate or clip gradients, or train in bf16")
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            # DeepSpeed's rule: double once `window` clean steps have passed BEFORE this one since the last
            # overflow (or the start), i.e. on the (window + 1)-th clean step, then every `window` steps.
            stable = self.iteration - self.last_overflow_iteration - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= self.factor
        self.iteration += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "iteration": self.iteration,
                "last_overflow_iteration": self.last_overflow_iteration, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
        self.hysteresis_left = int(state["hysteresis_left"])
