"""`FusedAdam` and `DeepSpeedCPUAdam` with DeepSpeed's signatures, built as torch's AdamW (or Adam).

DeepSpeed-Chat picks `DeepSpeedCPUAdam if args.offload else FusedAdam` and passes the instance to
`initialize(optimizer=...)`; zerotrain reads its class and hyperparameters and steps the master shards
with it wherever the config's `offload_optimizer` says (CPU offload runs zerotrain's CPU Adam with the
same hyperparameters), so both names mean "Adam with these hyperparameters". `adam_w_mode` /
`adamw_mode` false gives torch's Adam (L2 penalty), as DeepSpeed's do; torch's fused kernel is used
where every parameter can take it. `bias_correction=False` has no torch counterpart and is refused.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from ..optim import fused_supported

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]


def _groups(params: Iterable[Any]) -> list[dict]:
    items = list(params)
    if items and isinstance(items[0], dict):
        return [dict(group, params=list(group["params"])) for group in items]
    return [{"params": items}]


def _adam(name: str, params: Iterable[Any], lr: float, bias_correction: bool, betas: tuple, eps: float,
          weight_decay: float, amsgrad: bool, adamw: bool) -> torch.optim.Optimizer:
    if not bias_correction:
        raise NotImplementedError(f"zerotrain.ops.adam.{name}(bias_correction=False): torch's Adam always "
                                  "corrects the moment estimates; leave bias_correction at True")
    groups = _groups(params)
    kwargs = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
    if fused_supported(groups):
        kwargs["fused"] = True
    return (torch.optim.AdamW if adamw else torch.optim.Adam)(groups, **kwargs)


# Functions, not subclasses: the engine's offload paths pick their kernels (and decoupled weight decay) by the
# optimizer's exact class, torch.optim.AdamW or torch.optim.Adam.
def FusedAdam(params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,  # noqa: N802 (DeepSpeed's name)
              betas: tuple = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0,
              amsgrad: bool = False, set_grad_none: bool = True) -> torch.optim.Optimizer:
    """DeepSpeed's `FusedAdam(...)`, same arguments and defaults: a torch.optim.AdamW (torch.optim.Adam when
    `adam_w_mode` is false). `set_grad_none` is what torch's `zero_grad` does anyway."""
    return _adam("FusedAdam", params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode)


def DeepSpeedCPUAdam(model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,  # noqa: N802
                     betas: tuple = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                     adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> torch.optim.Optimizer:
    """DeepSpeed's `DeepSpeedCPUAdam(...)`, same arguments and defaults: a torch.optim.AdamW (torch.optim.Adam
    when `adamw_mode` is false). Where it runs is the config's `offload_optimizer` (CPU: zerotrain's CPU Adam
    with these hyperparameters), as DeepSpeed requires that block for it; optimizer states are fp32 anyway."""
    return _adam("DeepSpeedCPUAdam", model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                 adamw_mode)
