"""`split_params_into_different_moe_groups_for_optimizer` and `is_moe_param`, with DeepSpeed's meaning.

DeepSpeed keeps expert parameters in optimizer groups of their own (`moe: True`), because it reduces
their gradients over the expert-data-parallel group. zerotrain's engine finds expert parameters itself
(their `ep_slice`, `zerotrain.sharding`), so the split is not needed for correctness; it is provided so
that programs calling it (DeepSpeedExamples' cifar) run unchanged and get the same group structure.
"""
from __future__ import annotations

from typing import Any, Union

import torch

from ..sharding import expert_slice_of

__all__ = ["split_params_into_different_moe_groups_for_optimizer", "is_moe_param"]


def is_moe_param(param: torch.Tensor) -> bool:
    """True for an expert parameter of a zerotrain expert-parallel layer."""
    return expert_slice_of(param) is not None


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: Union[dict, tuple, list], max_group_size: Union[int, float, None] = 178956971) -> list[dict]:
    """Each group's expert parameters move to a new group with the same hyperparameters, `name` "moe" and
    `moe: True` (DeepSpeed's layout); groups without experts come back unchanged. A dict is one group.
    `max_group_size` (DeepSpeed splits large expert groups for its fused kernels) changes nothing here."""
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (tuple, list)):
        groups = list(param_groups)
    else:
        raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: unknown param group type "
                         f"{type(param_groups).__name__} (a dict, or a list or tuple of dicts)")
    dense: list[dict] = []
    experts: list[dict] = []
    for group in groups:
        params: list[Any] = list(group["params"])
        moe = [p for p in params if is_moe_param(p)]
        dense.append(dict(group, params=[p for p in params if not is_moe_param(p)]))
        if moe:
            experts.append(dict(group, params=moe, name="moe", moe=True))
    return dense + experts
