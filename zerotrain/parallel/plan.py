"""Turn an ordinary model into a tensor-parallel one by a plan: module name pattern → style.

`apply_tensor_parallel(model, plan, comm)` replaces each matching `nn.Linear` /
`nn.Embedding` by its parallel counterpart, built from the module's current (full) weights,
so a model initialised as usual and then split computes what the unsplit model computes.
A weight shared by two modules (a tied embedding and output head) stays shared: both get
the same split parameter, provided they split it the same way.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Union

import torch.nn as nn

from ..comm import Comm
from .tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

__all__ = ["Column", "Row", "Vocab", "Style", "apply_tensor_parallel", "default_plan", "GPT_PLAN"]


@dataclass(frozen=True)
class Column:
    """Split output features; `parts` for fused projections, `gather_output` to return the whole output."""
    parts: int = 1
    gather_output: bool = False


@dataclass(frozen=True)
class Row:
    """Split input features; the input must be the split output of a Column layer."""


@dataclass(frozen=True)
class Vocab:
    """Split an embedding table's rows."""


Style = Union[Column, Row, Vocab]

# zerotrain.models.GPT: attention heads and MLP width split, vocabulary split in the tied
# embedding / head (the logits are gathered whole for the loss).
GPT_PLAN: dict[str, Style] = {
    "transformer.wte": Vocab(),
    "transformer.h.*.attn.c_attn": Column(parts=3),
    "transformer.h.*.attn.c_proj": Row(),
    "transformer.h.*.mlp.c_fc": Column(),
    "transformer.h.*.mlp.c_proj": Row(),
    "lm_head": Column(gather_output=True),
}


def _build(name: str, module: nn.Module, style: Style, comm: Comm) -> nn.Module:
    if isinstance(style, Vocab):
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"tensor-parallel plan: {name} is {type(module).__name__}, Vocab needs nn.Embedding")
        return VocabParallelEmbedding(module.weight, comm, name=name)
    if not isinstance(module, nn.Linear):
        raise TypeError(f"tensor-parallel plan: {name} is {type(module).__name__}, {type(style).__name__} "
                        f"needs nn.Linear")
    if isinstance(style, Column):
        return ColumnParallelLinear(module.weight, module.bias, comm, parts=style.parts,
                                    gather_output=style.gather_output, name=name)
    return RowParallelLinear(module.weight, module.bias, comm, name=name)


def apply_tensor_parallel(model: nn.Module, plan: dict[str, Style], comm: Comm) -> nn.Module:
    """Replace, in place, every module whose qualified name matches a pattern of `plan`."""
    matched = {pattern: 0 for pattern in plan}
    replaced: dict[int, nn.Module] = {}  # id(original weight) -> first parallel module built from it
    for name, module in list(model.named_modules()):
        patterns = [p for p in plan if fnmatch.fnmatchcase(name, p)]
        if not patterns:
            continue
        if len(patterns) > 1:
            raise ValueError(f"tensor-parallel plan: {name} matches several patterns {patterns}")
        matched[patterns[0]] += 1
        new = _build(name, module, plan[patterns[0]], comm)
        first = replaced.get(id(module.weight))
        if first is not None:
            if first.weight.tp_slice != new.weight.tp_slice:
                raise ValueError(f"tensor-parallel plan: {name} shares its weight with another module "
                                 f"but splits it differently")
            new.weight = first.weight
        else:
            replaced[id(module.weight)] = new
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    unused = [pattern for pattern, count in matched.items() if count == 0]
    if unused:
        raise ValueError(f"tensor-parallel plan: patterns {unused} match no module of {type(model).__name__}")
    return model


def default_plan(model: nn.Module) -> dict[str, Style]:
    """The built-in plan for a model zerotrain knows (its GPT); anything else needs one passed in."""
    from ..models import GPT
    if isinstance(model, GPT):
        return GPT_PLAN
    raise ValueError(f"tensor_parallel.autotp_size > 1 needs a plan for {type(model).__name__}: pass "
                     f"zerotrain.initialize(..., tensor_parallel_plan={{'layers.*.fc1': Column(), ...}})")
