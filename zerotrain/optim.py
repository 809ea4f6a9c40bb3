"""A torch optimizer from the config's `optimizer` block, with DeepSpeed 0.19's defaults.

* "adamw" (also DeepSpeed's "Adam", unless `adam_w_mode` is false) -> `torch.optim.AdamW`
* "adam" with `adam_w_mode: false` -> `torch.optim.Adam` (L2 penalty added to the gradient)
* "sgd" -> `torch.optim.SGD`

Params left out take the defaults of the optimizer DeepSpeed's engine builds from the same block
(runtime/engine.py `_configure_basic_optimizer`): its FusedAdam / DeepSpeedCPUAdam for Adam and AdamW
(lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0, amsgrad false, bias correction on), or with
`torch_adam: true` torch's own class and defaults (AdamW's weight_decay is then torch's 0.01); SGD is
torch's SGD in both (lr 1e-3, momentum, dampening and weight_decay 0). Per-group keys in
`param_groups` (lr, weight_decay, ...) override the config, as in torch.

Adam/AdamW run torch's fused kernel whenever every parameter is a floating tensor on a
device that has it (CPU and CUDA do), unless `params.fused` is false; `fused: true` on
parameters that cannot use it is a ConfigError. Whatever `torch_adam` says, the arithmetic is
torch's (or zerotrain's CPU kernel, element for element the same); it only picks the defaults.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from .config import ConfigError, OptimizerConfig

__all__ = ["build_optimizer", "fused_supported", "DEEPSPEED_ADAM_WEIGHT_DECAY"]

# The weight decay of DeepSpeed's FusedAdam and DeepSpeedCPUAdam (ops/adam/fused_adam.py, cpu_adam.py), which its
# engine builds for an Adam/AdamW block unless `torch_adam` is true: what an unset `weight_decay` means.
DEEPSPEED_ADAM_WEIGHT_DECAY = 0.0

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fused_devices() -> set[str]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        return set(_get_fused_kernels_supported_devices())
    except (ImportError, AttributeError):  # private helper moved: fall back to what torch 2.4+ supports
        return {"cpu", "cuda"}


def fused_supported(param_groups: list[dict]) -> bool:
    """True when torch's fused Adam(W) can take every parameter of `param_groups` (and there is one)."""
    devices = _fused_devices()
    params = [p for group in param_groups for p in group["params"]]
    return bool(params) and all(
        isinstance(p, torch.Tensor) and p.dtype in _FUSED_DTYPES and p.device.type in devices and not p.is_sparse
        for p in params)


def _as_groups(param_groups: Iterable[Any]) -> list[dict]:
    items = list(param_groups)
    if items and isinstance(items[0], dict):
        return [dict(group, params=list(group["params"])) for group in items]
    return [{"params": items}]


def _with_defaults(opt_cfg: OptimizerConfig) -> dict[str, Any]:
    """The block's params: those the config gave, and the defaults its `params` model declares for the others."""
    fields = OptimizerConfig.TYPES[opt_cfg.type].model_fields
    return {name: opt_cfg.params.get(name, field.default) for name, field in fields.items()}


def build_optimizer(opt_cfg: Optional[OptimizerConfig], param_groups: Iterable[Any]) -> torch.optim.Optimizer:
    """Build the optimizer the config names over `param_groups` (group dicts, or plain tensors)."""
    if opt_cfg is None:
        raise ConfigError("optimizer: no optimizer given in the config and none passed to initialize",
                          key="optimizer")
    groups = _as_groups(param_groups)
    kind = opt_cfg.resolved_type
    if kind not in ("adam", "adamw", "sgd"):
        raise ConfigError(f"optimizer.type: cannot build {opt_cfg.type!r}", key="optimizer.type")
    params = _with_defaults(opt_cfg)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=params["lr"], momentum=params["momentum"], dampening=params["dampening"],
                               weight_decay=params["weight_decay"], nesterov=params["nesterov"])
    kwargs: dict[str, Any] = {"lr": params["lr"], "betas": tuple(params["betas"]), "eps": params["eps"],
                              "amsgrad": params["amsgrad"]}
    if params["weight_decay"] is not None:
        kwargs["weight_decay"] = params["weight_decay"]
    elif not params["torch_adam"]:  # torch_adam: torch's own default (AdamW 0.01, Adam 0)
        kwargs["weight_decay"] = DEEPSPEED_ADAM_WEIGHT_DECAY
    fused = params["fused"]
    can_fuse = fused_supported(groups)
    if fused and not can_fuse:
        raise ConfigError("optimizer.params.fused: true, but torch's fused Adam needs every parameter to be a "
                          f"floating tensor on one of {sorted(_fused_devices())}", key="optimizer.params.fused")
    if fused is None:
        fused = can_fuse
    if fused:
        kwargs["fused"] = True
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    return cls(groups, **kwargs)
