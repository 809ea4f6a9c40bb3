"""The `optimizer` and `scheduler` blocks and their per-type `params`.

`type` is matched case-insensitively. `params` is validated against the model of its
type; the block keeps only the params the config gave (validated); `optim.py` fills the
others from the defaults the model declares (DeepSpeed 0.19's), `schedules.py` its own. DeepSpeed's "Adam" is AdamW unless
`params.adam_w_mode` is false (`OptimizerConfig.resolved_type`).
"""
from __future__ import annotations

import difflib
from typing import Annotated, Any, ClassVar, Optional

from pydantic import BeforeValidator, Field, ValidationError, ValidationInfo, model_validator

from .base import (Block, Bool, ConfigError, NonNegFloat, NonNegInt, PosFloat, PosInt, choice,
                   error_from_validation)

__all__ = ["OptimizerConfig", "SchedulerConfig", "AdamParams", "SGDParams", "WarmupLRParams",
           "WarmupDecayLRParams", "WarmupCosineLRParams", "OneCycleParams", "HFScheduleParams", "HF_SCHEDULES"]


def _betas(value: Any) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"expected two numbers [beta1, beta2], got {value!r}")
    out = []
    for beta in value:
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f"each beta must be a number in [0, 1), got {value!r}")
        out.append(float(beta))
    return out[0], out[1]


def _lr_spec(value: Any) -> Any:
    """A learning rate >= 0, or a list of them (one per parameter group), as DeepSpeed allows."""
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ValueError("expected a learning rate or a non-empty list of them, got []")
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not 0.0 <= item < float("inf"):
            raise ValueError(f"expected a learning rate >= 0 (or a list of them), got {value!r}")
    return [float(v) for v in items] if isinstance(value, (list, tuple)) else float(value)


Betas = Annotated[tuple[float, float], BeforeValidator(_betas)]
LrSpec = Annotated[Any, BeforeValidator(_lr_spec)]
WarmupType = choice("log", "linear")


class AdamParams(Block):
    """`optimizer.params` of Adam / AdamW. Unset keys take DeepSpeed's defaults (`zerotrain.optim`): weight_decay 0,
    or torch's own (0.01 AdamW, 0 Adam) with `torch_adam: true`."""

    PATH = "optimizer.params"
    # What DeepSpeed 0.19.8's engine pops or passes to its Adam kernels besides the fields below
    # (runtime/engine.py get_optimizer_configuration, ops/adam/fused_adam.py)
    DEEPSPEED_ONLY = frozenset({"fp32_optimizer_states", "foreach", "set_grad_none"})

    lr: NonNegFloat = 1e-3
    betas: Betas = (0.9, 0.999)
    eps: PosFloat = 1e-8
    weight_decay: Optional[NonNegFloat] = None
    amsgrad: Bool = False
    adam_w_mode: Bool = True
    torch_adam: Bool = False
    fused: Optional[Bool] = None
    bias_correction: Bool = True

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Old apex-style configs clip inside Adam (`max_grad_norm`); DeepSpeed refuses it too, naming
        `gradient_clipping`, and so do we."""
        if "max_grad_norm" in data:
            key = cls.key_path("max_grad_norm")
            raise ConfigError(f"{key} is not an optimizer parameter (DeepSpeed refuses it too); set the top-level "
                              f"gradient_clipping instead", key=key)
        return data

    @model_validator(mode="after")
    def _only_bias_corrected(self):
        if not self.bias_correction:
            raise ConfigError(f"{self.key_path('bias_correction')}: false is not supported (torch's Adam always "
                              f"corrects the bias)", key=self.key_path("bias_correction"))
        return self


class SGDParams(Block):
    """`optimizer.params` of SGD."""

    PATH = "optimizer.params"

    lr: NonNegFloat = 1e-3
    momentum: NonNegFloat = 0.0
    dampening: NonNegFloat = 0.0
    weight_decay: NonNegFloat = 0.0
    nesterov: Bool = False

    @model_validator(mode="after")
    def _nesterov(self):
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError(f"{self.key_path('nesterov')}: needs momentum > 0 and dampening 0",
                              key=self.key_path("nesterov"))
        return self


class WarmupLRParams(Block):
    """`scheduler.params` of WarmupLR: min -> max lr over `warmup_num_steps`, then constant."""

    PATH = "scheduler.params"
    DEEPSPEED_ONLY = frozenset({"last_batch_iteration"})

    warmup_min_lr: LrSpec = 0.0
    warmup_max_lr: Optional[LrSpec] = None  # DeepSpeed's default: each group's own lr
    warmup_num_steps: PosInt = 1000  # DeepSpeed refuses 0 too; 1 is raised to 2
    warmup_type: WarmupType = "log"


class WarmupDecayLRParams(WarmupLRParams):
    """`scheduler.params` of WarmupDecayLR: WarmupLR, then linear decay to 0 at `total_num_steps`."""

    warmup_max_lr: LrSpec = 0.001  # DeepSpeed's default here (WarmupLR's is the group's lr)
    total_num_steps: PosInt


class WarmupCosineLRParams(Block):
    """`scheduler.params` of WarmupCosineLR: ratios of each group's base lr."""

    PATH = "scheduler.params"
    DEEPSPEED_ONLY = frozenset({"last_batch_iteration"})

    total_num_steps: PosInt
    warmup_min_ratio: NonNegFloat = 0.0
    warmup_num_steps: PosInt = 1000
    cos_min_ratio: NonNegFloat = 0.0001
    warmup_type: WarmupType = "log"


# transformers' schedule names `HFSchedule` builds (`transformers.get_scheduler`), and whether each needs the
# run's number of steps (it decays over them).
HF_SCHEDULES: dict[str, bool] = {"linear": True, "cosine": True, "constant": False, "constant_with_warmup": False}


class HFScheduleParams(Block):
    """`scheduler.params` of HFSchedule (zerotrain's, not DeepSpeed's): transformers' schedule `name`, the HF
    Trainer's curve for `lr_scheduler_type` (no warmup: step 1 at the full lr)."""

    PATH = "scheduler.params"

    name: choice(*HF_SCHEDULES) = "linear"
    num_warmup_steps: NonNegInt = 0
    num_training_steps: Optional[PosInt] = None

    @classmethod
    def _drop_auto(cls, name: str) -> None:
        """"auto" here comes from the HF arguments (`hf_arguments.auto_values`: `zerotrain train`'s flags,
        `zerotrain.hf.Trainer`), which fill it before the config is read; one left in has nothing to come from, and
        a default would silently change the curve: refused, naming the key."""
        key = cls.key_path(name)
        raise ConfigError(f"{key} is 'auto', which only the Hugging Face training arguments fill (lr_scheduler_type, "
                          f"warmup_steps and the run's steps, in zerotrain train and zerotrain.hf.Trainer); "
                          f"set a value", key=key)

    @model_validator(mode="after")
    def _needs_steps(self):
        if HF_SCHEDULES[self.name] and self.num_training_steps is None:
            key = self.key_path("num_training_steps")
            raise ConfigError(f"{key}: required by {self.name!r} (it decays over the run's steps)", key=key)
        return self


class OneCycleParams(Block):
    """`scheduler.params` of OneCycle (DeepSpeed's 1Cycle policy): lr up and down one cycle, then decay."""

    PATH = "scheduler.params"
    DEEPSPEED_ONLY = frozenset({"last_batch_iteration"})

    cycle_min_lr: LrSpec
    cycle_max_lr: LrSpec
    decay_lr_rate: NonNegFloat = 0.0
    cycle_first_step_size: PosInt = 2000
    cycle_second_step_size: Optional[NonNegInt] = None
    cycle_first_stair_count: NonNegInt = 0
    cycle_second_stair_count: Optional[NonNegInt] = None
    decay_step_size: NonNegInt = 0
    cycle_momentum: Bool = True
    cycle_min_mom: LrSpec = 0.8
    cycle_max_mom: LrSpec = 0.9
    decay_mom_rate: NonNegFloat = 0.0


class _Typed(Block):
    """A block with a `type` picking the model of its `params`."""

    TYPES: ClassVar[dict[str, type[Block]]] = {}
    DEEPSPEED_TYPES: ClassVar[frozenset[str]] = frozenset()
    HINT: ClassVar[str] = ""
    SPELLING: ClassVar[str] = ""

    @classmethod
    def _finish(cls, data: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        key = cls.key_path("type")
        if "type" not in data:
            raise ConfigError(f"{key}: required key is missing; use {cls.SPELLING}", key=key)
        kind = data["type"]
        names = {name.lower(): name for name in cls.TYPES}
        if not isinstance(kind, str):
            raise ConfigError(f"{key}: expected a string, got {kind!r}", key=key)
        if kind.lower() not in names:
            if kind.lower() in cls.DEEPSPEED_TYPES:
                raise ConfigError(f"{key}: {kind!r} is a DeepSpeed type that zerotrain does not implement; "
                                  f"use {cls.SPELLING}{cls.HINT}", key=key)
            close = difflib.get_close_matches(kind.lower(), list(names), n=1, cutoff=0.6)
            hint = f"; did you mean {names[close[0]]!r}?" if close else f"; use {cls.SPELLING}"
            raise ConfigError(f"{key}: unknown type {kind!r}{hint}", key=key)
        kind = names[kind.lower()]
        params = data.get("params")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ConfigError(f"{cls.key_path('params')}: expected an object, got {params!r}",
                              key=cls.key_path("params"))
        try:
            validated = cls.TYPES[kind].model_validate(params, context=info.context)
        except ValidationError as err:
            raise error_from_validation(err, prefix=cls.key_path("params")) from None
        return dict(data, type=kind, params=validated.model_dump(exclude_unset=True))


class OptimizerConfig(_Typed):
    """`optimizer`: `type` is normalized to "adam", "adamw" or "sgd"; `params` holds the keys given."""

    PATH = "optimizer"
    DEEPSPEED_ONLY = frozenset({"legacy_fusion"})
    TYPES = {"adam": AdamParams, "adamw": AdamParams, "sgd": SGDParams}
    DEEPSPEED_TYPES = frozenset({"lamb", "onebitadam", "zerooneadam", "onebitlamb", "lion", "adagrad", "muon",
                                 "muadam", "muadamw", "musgd", "cpuadam", "fusedadam", "adam_w"})
    HINT = ", or pass a torch optimizer to zerotrain.initialize"
    SPELLING = "Adam, AdamW or SGD"

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @property
    def resolved_type(self) -> str:
        """"adamw", "adam" or "sgd": DeepSpeed's "Adam" means AdamW unless params.adam_w_mode is false."""
        if self.type == "adam" and self.params.get("adam_w_mode", True):
            return "adamw"
        return self.type


class SchedulerConfig(_Typed):
    """`scheduler`: `type` is "WarmupLR", "WarmupDecayLR", "WarmupCosineLR" or "OneCycle" (DeepSpeed's), or
    "HFSchedule" (transformers' schedules, what HF's `lr_scheduler_type` makes); `params` holds the keys given."""

    PATH = "scheduler"
    TYPES = {"WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
             "WarmupCosineLR": WarmupCosineLRParams, "OneCycle": OneCycleParams, "HFSchedule": HFScheduleParams}
    DEEPSPEED_TYPES = frozenset({"lrrangetest"})
    HINT = ", or pass a torch LR scheduler to zerotrain.initialize"
    SPELLING = "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or HFSchedule"

    type: str
    params: dict[str, Any] = Field(default_factory=dict)
