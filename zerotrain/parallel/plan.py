"""Turn an ordinary model into a tensor-parallel one by a plan: module name pattern → style.

`apply_tensor_parallel(model, plan, comm)` replaces each matching `nn.Linear` (or
transformers' `Conv1D`, whose weight is stored `[in, out]`) / `nn.Embedding` by its parallel
counterpart, built from the module's current (full) weights, so a model initialised as usual
and then split computes what the unsplit model computes. A weight shared by two modules (a
tied embedding and output head) stays shared: both get the same split parameter, provided
they split it the same way, and a module left outside the plan that shares a split weight is
an error. Finding a plan for a model that brings none is `autotp`'s job.
"""
from __future__ import annotations

import contextlib
import fnmatch
import sys
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional, Union

import torch
import torch.nn as nn

from ..comm import Comm
from .tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

__all__ = ["Column", "Row", "Vocab", "SumGrad", "Style", "apply_tensor_parallel", "GPT_PLAN"]


@dataclass(frozen=True)
class Column:
    """Split output features; `parts` for fused projections, `gather_output` to return the whole output.
    `divide_parent` names attributes of the enclosing module that count the split features (GPT-2's
    attention reads `split_size` to cut its fused q/k/v output): each is divided by the tensor-parallel size."""
    parts: int = 1
    gather_output: bool = False
    divide_parent: tuple[str, ...] = ()


@dataclass(frozen=True)
class Row:
    """Split input features; the input must be the split output of a Column layer, or with `split_input`
    the whole input (each rank takes its slice). `parts` > 1: the input is that many packed blocks."""
    parts: int = 1
    split_input: bool = False


@dataclass(frozen=True)
class Vocab:
    """Split an embedding table's rows."""


@dataclass(frozen=True)
class SumGrad:
    """Keep the module whole on every rank, but sum its parameters' gradients over the tensor-parallel group:
    for a module that sees only this rank's slice of a split activation (Qwen3's per-head q/k norms between
    column-split projections), each rank's gradient covers only its own heads."""


Style = Union[Column, Row, Vocab, SumGrad]

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


def is_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D` (GPT-2): a linear layer whose weight is stored `[in, out]`. Checked without
    importing transformers: a model made of its modules has imported it already."""
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    return pytorch_utils is not None and isinstance(module, pytorch_utils.Conv1D)


def _build(name: str, module: nn.Module, style: Style, comm: Comm) -> nn.Module:
    if isinstance(style, Vocab):
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"tensor-parallel plan: {name} is {type(module).__name__}, Vocab needs nn.Embedding")
        return VocabParallelEmbedding(module.weight, comm, name=name)
    transposed = is_conv1d(module)
    if not (isinstance(module, nn.Linear) or transposed):
        raise TypeError(f"tensor-parallel plan: {name} is {type(module).__name__}, {type(style).__name__} "
                        f"needs nn.Linear (or transformers' Conv1D)")
    if isinstance(style, Column):
        return ColumnParallelLinear(module.weight, module.bias, comm, parts=style.parts,
                                    gather_output=style.gather_output, name=name, transposed=transposed)
    return RowParallelLinear(module.weight, module.bias, comm, name=name, transposed=transposed,
                             parts=style.parts, split_input=style.split_input)


def _divide_parent(parent: nn.Module, parent_name: str, names: tuple[str, ...], size: int) -> None:
    for attribute in names:
        value = getattr(parent, attribute, None)
        if not isinstance(value, int) or value % size:
            raise ValueError(f"tensor-parallel plan: {parent_name or type(parent).__name__}.{attribute} is "
                             f"{value!r}, not a whole number divisible by the tensor-parallel size {size}")
        setattr(parent, attribute, value // size)


def _sum_gradients(module: nn.Module, comm: Comm) -> None:
    """Hook each parameter of `module` (its own, not its children's) so that its gradient is summed over the
    group before it accumulates. The hooks go on at the module's first forward: by then ZeRO has put its
    parameter objects in place, and a hook on a parameter it replaced would never fire."""
    hooked: dict[int, torch.Tensor] = {}  # id -> the parameter itself (kept alive, so no id is reused)

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad)
        return grad

    def hook_parameters(mod: nn.Module, _args) -> None:
        for param in mod.parameters(recurse=False):
            if param.requires_grad and hooked.get(id(param)) is not param:
                param.register_hook(summed)
                hooked[id(param)] = param

    if comm.size > 1:
        module.register_forward_pre_hook(hook_parameters)


def apply_tensor_parallel(model: nn.Module, plan: dict[str, Style], comm: Comm,
                          whole: Optional[Callable[[list], ContextManager]] = None) -> nn.Module:
    """Replace, in place, every module whose qualified name matches a pattern of `plan`.

    `whole(params)`: a context in which `params` hold their full values (for a model built under
    `zero.Init`, `zero.GatheredParameters`): each split module is gathered alone, sliced, released."""
    matched = {pattern: 0 for pattern in plan}
    replaced: dict[int, nn.Module] = {}  # id(original weight) -> first parallel module built from it
    split_names: dict[int, str] = {}  # id(original weight) -> the name of the module that split it first
    for name, module in list(model.named_modules()):
        patterns = [p for p in plan if fnmatch.fnmatchcase(name, p)]
        if not patterns:
            continue
        if len(patterns) > 1:
            raise ValueError(f"tensor-parallel plan: {name} matches several patterns {patterns}")
        matched[patterns[0]] += 1
        if isinstance(plan[patterns[0]], SumGrad):
            _sum_gradients(module, comm)
            continue
        with (whole or _as_is)(list(module.parameters(recurse=False))):
            new = _build(name, module, plan[patterns[0]], comm)
        first = replaced.get(id(module.weight))
        if first is not None:
            if first.weight.tp_slice != new.weight.tp_slice:
                raise ValueError(f"tensor-parallel plan: {name} shares its weight with another module "
                                 f"but splits it differently")
            new.weight = first.weight
        else:
            replaced[id(module.weight)] = new
            split_names[id(module.weight)] = name
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        style = plan[patterns[0]]
        if isinstance(style, Column) and style.divide_parent:
            _divide_parent(parent, parent_name, style.divide_parent, comm.size)
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in split_names:  # still the whole original: its tied partner was split without it
            raise ValueError(f"tensor-parallel plan: {name} shares its weight with {split_names[id(param)]}, "
                             f"which the plan splits; add {name.rpartition('.')[0]} to the plan")
    unused = [pattern for pattern, count in matched.items() if count == 0]
    if unused:
        raise ValueError(f"tensor-parallel plan: patterns {unused} match no module of {type(model).__name__}")
    return model


def _as_is(params: list) -> ContextManager:
    return contextlib.nullcontext()
