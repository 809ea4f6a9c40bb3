"""Tensor parallelism for a PEFT LoRA-wrapped model: the base model's plan, with the adapters split along.

peft wraps each adapted layer (`q_proj` becomes a `lora.Linear` holding `base_layer`, `lora_A`, `lora_B`),
so a plan written for the base model names modules that are no longer linear layers. `lora_plan` resolves
the base model's plan as `resolve_plan` would (with each wrapper shown as its base layer) and rewrites it
onto the wrapped model's names, splitting each adapter the way its base layer is split, so the adapted
layer computes exactly what it computes unsplit:

* column-split base (output features): `lora_B` is column-split the same way and `lora_A` stays whole;
  `lora_B`'s column layer sums the gradient of its (whole) input over the group, so `lora_A`'s gradient
  is the whole one on every rank;
* row-split base (input features, the input a split activation): `lora_A` is row-split the same way, its
  partial products summed by its all-reduce, and `lora_B` stays whole; the adapter's output is then whole,
  as the base layer's is after its all-reduce.

Every name in the rewritten plan is exact (no patterns), so no plan entry can reach into a wrapper.

An embedding or head whose new tokens' rows train (peft's trainable tokens, `train --add-tokens --lora-r`)
stays whole on every rank: peft's wrapper writes the trained rows into the whole weight (`index_copy`) and
calls the layer's function itself, which a vocabulary split would have to redo; the layer is frozen, so
keeping it whole costs its weights only (no gradients or optimizer state), and its trained rows get the same
whole gradient on every rank (its input, and its output's gradient, are whole).
"""
from __future__ import annotations

import contextlib
import fnmatch
from typing import Callable, Iterator, Optional

import torch.nn as nn

from .plan import Column, Row, Style, SumGrad, Vocab

__all__ = ["is_lora_wrapped", "lora_plan"]


def _wrappers(model: nn.Module) -> dict[str, nn.Module]:
    """{name in the base model: LoRA wrapper module} (a module with `base_layer`, `lora_A` and `lora_B`)."""
    base = model.get_base_model()
    return {name: module for name, module in base.named_modules()
            if isinstance(getattr(module, "base_layer", None), nn.Module)
            and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)}


def _token_wrappers(model: nn.Module) -> dict[str, nn.Module]:
    """{name in the base model: peft trainable-tokens wrapper} (a module with `token_adapter` and the layer as
    `original_module`)."""
    return {name: module for name, module in model.get_base_model().named_modules()
            if isinstance(getattr(module, "token_adapter", None), nn.Module)
            and isinstance(getattr(module, "original_module", None), nn.Module)}


def is_lora_wrapped(model: nn.Module) -> bool:
    """A peft `PeftModel` (duck-typed: `get_base_model` and `peft_config`) with LoRA layers."""
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config") and bool(_wrappers(model))


@contextlib.contextmanager
def _unwrapped(base: nn.Module, wrappers: dict[str, nn.Module]) -> Iterator[None]:
    """Each wrapper replaced by its base layer inside the block (the base model as the plan was written for)."""
    def put(name: str, module: nn.Module) -> None:
        parent_name, _, child = name.rpartition(".")
        setattr(base.get_submodule(parent_name) if parent_name else base, child, module)

    for name, wrapper in wrappers.items():
        put(name, wrapper.original_module if hasattr(wrapper, "token_adapter") else wrapper.base_layer)
    try:
        yield
    finally:
        for name, wrapper in wrappers.items():
            put(name, wrapper)


def lora_plan(model: nn.Module, tp_size: int, plan: Optional[dict],
              resolve_plan: Callable[[nn.Module, int, Optional[dict]], dict[str, Style]]) -> dict[str, Style]:
    """The plan for a LoRA-wrapped `model`: its base model's (given, its own, or inferred by `resolve_plan`,
    `autotp`'s, which calls this one: handed in, so neither module imports the other), on the wrapped names."""
    base = model.get_base_model()
    wrappers, tokens = _wrappers(model), _token_wrappers(model)
    with _unwrapped(base, {**wrappers, **tokens}):
        base_plan = resolve_plan(base, tp_size, plan)
        modules = [name for name, _ in base.named_modules() if name]
    prefix = next(name for name, module in model.named_modules() if module is base)
    prefix = f"{prefix}." if prefix else ""
    out: dict[str, Style] = {}
    for pattern, style in base_plan.items():
        for name in (n for n in modules if fnmatch.fnmatchcase(n, pattern)):
            if name in tokens:
                continue  # trainable tokens: the layer stays whole (module docstring)
            wrapper = wrappers.get(name)
            if wrapper is None:
                out[prefix + name] = style
                continue
            if isinstance(style, (Vocab, SumGrad)):
                raise ValueError(f"tensor-parallel plan: LoRA on {name} ({type(style).__name__}) is not supported "
                                 f"with tensor parallelism; leave it out of --lora-target-modules")
            out[f"{prefix}{name}.base_layer"] = style
            for key in wrapper.lora_A:
                if isinstance(style, Column):
                    out[f"{prefix}{name}.lora_B.{key}"] = Column(parts=style.parts, gather_output=style.gather_output)
                elif isinstance(style, Row):
                    out[f"{prefix}{name}.lora_A.{key}"] = Row(parts=style.parts, split_input=style.split_input)
    return out
