"""FP8 training through torchao's float8 (docs/fp8.md): the config's `fp8` block applied to a model.

`convert_for_fp8` swaps the model's `torch.nn.Linear` layers for torchao's `Float8Linear`
(`torchao.float8.convert_to_float8_training`) before the engine places, flattens or partitions anything:
`Float8Linear.from_float` keeps the layer's own weight and bias `Parameter` objects, so ZeRO's buckets and
stage-3 partitions (and an optimizer built before) hold exactly the tensors the float8 layer computes with.
Weights, gradients, masters and checkpoints stay in the training dtype: float8 is a compute format here,
each matmul casting its inputs with dynamic scales (tensorwise: one scale per tensor; rowwise: one per row).

Which layers convert (`fp8_plan`, our own filter in the spirit of torchtitan's `module_filter_fn`):
exactly `nn.Linear` (not a subclass: a tensor-parallel slice or a layer someone already converted), both
dims multiples of 16 (the fp8 matmul's requirement), no forward hooks of its own (the swap would lose them), not the
model's head (`get_output_embeddings()`, a
Linear sharing its weight with an embedding, or one named `lm_head` / `output`), not matched by
`fp8.exclude_modules`. The estimate (`zerotrain.estimate`) reads the same plan.

What torchao lacks for us: its float8 weight all-gather (`enable_fsdp_float8_all_gather`,
`precompute_float8_dynamic_scale_for_fsdp`) is written for FSDP2's DTensor shards (the
`fsdp_pre_all_gather` / `fsdp_post_all_gather` extension of `WeightWithDynamicFloat8CastTensor`), so ZeRO-3's
float8 gathers are our own (`comm.compressed.Float8AllGather`: scales of all float8 weights in one all-reduce per
micro-step, as the precompute does; the arrived weight dequantized into the training dtype, since the layer
reads a plain parameter where FSDP2 hands it a `Float8TrainingTensor`); in eager mode `Float8Linear` saves its high-precision
input and weight for backward and casts them again there (no fp8 copy saved: only `torch.compile` of its
graph can choose to save the fp8 ones); its autocast branch reads the GPU's autocast dtype only; and
`Float8Linear` is not a public API of torchao (we only construct it through `convert_to_float8_training`).
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .config import ConfigError

__all__ = ["FP8Plan", "fp8_plan", "has_fp8_matmul", "torchao_config", "convert_for_fp8", "HEAD_NAMES",
           "fp8_layer_bytes", "fp8_transient_bytes", "float8_gathered_weights"]

HEAD_NAMES = ("lm_head", "output")  # a Linear whose last name is one of these is the head (torchtitan: "output")
FP8_DIM_MULTIPLE = 16


@dataclass(frozen=True)
class FP8Plan:
    """Which Linear layers compute in float8: `converted` names, `kept` name -> why it stays high precision."""

    converted: tuple[str, ...]
    kept: dict[str, str]
    shapes: dict[str, tuple[int, int]]  # every Linear's (out_features, in_features)


def _head_ids(model: torch.nn.Module) -> set[int]:
    """The modules that are the model's head: its output embeddings, and any Linear tied to an embedding."""
    heads: set[int] = set()
    get_output = getattr(model, "get_output_embeddings", None)  # transformers' (and peft's forwarded) method
    if callable(get_output):
        try:
            head = get_output()
        except (AttributeError, NotImplementedError):
            head = None
        if isinstance(head, torch.nn.Module):
            heads.add(id(head))
            heads.update(id(m) for m in head.modules())  # peft's ModulesToSaveWrapper and its copies
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) in embedding_weights:
            heads.add(id(module))
    return heads


def fp8_plan(model: torch.nn.Module, exclude_modules: tuple[str, ...] | list[str] = ()) -> FP8Plan:
    """The layers `convert_for_fp8` converts and the ones it keeps in high precision (with the reason)."""
    heads = _head_ids(model)
    converted, kept, shapes = [], {}, {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        out_f, in_f = int(module.out_features), int(module.in_features)  # not weight.shape: ZeRO-3 placeholders
        shapes[name] = (out_f, in_f)
        if type(module) is not torch.nn.Linear:
            kept[name] = f"a {type(module).__name__}, not a plain nn.Linear"
        elif id(module) in heads or name.rsplit(".", 1)[-1] in HEAD_NAMES:
            kept[name] = "the head"
        elif out_f % FP8_DIM_MULTIPLE or in_f % FP8_DIM_MULTIPLE:
            kept[name] = f"dims {out_f}x{in_f} not multiples of {FP8_DIM_MULTIPLE}"
        elif module._forward_hooks or module._forward_pre_hooks:
            kept[name] = "has forward hooks (the swap would drop them)"
        elif any(pattern in name for pattern in exclude_modules):
            kept[name] = "fp8.exclude_modules"
        else:
            converted.append(name)
    return FP8Plan(tuple(converted), kept, shapes)


def has_fp8_matmul(device: torch.device) -> bool:
    """Whether `device` multiplies float8 natively (`torch._scaled_mm`): CUDA capability 8.9 (Ada) or later."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def torchao_config(recipe: str, emulate: bool) -> Any:
    """torchao's `Float8LinearConfig` of a recipe name ("tensorwise" | "rowwise"), emulated or not."""
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=bool(emulate))


def _emulation(fp8, device: torch.device) -> tuple[bool, str]:
    native = has_fp8_matmul(device)
    if fp8.emulate is None:
        return (not native), ("" if native else f"emulated: the {torch.device(device).type} device has no fp8 matmul")
    if not fp8.emulate and not native:
        raise ConfigError(f"fp8.emulate: false, but the {torch.device(device)} device has no fp8 matmul (CUDA "
                          "capability 8.9 or later); leave it unset to emulate", key="fp8.emulate")
    return bool(fp8.emulate), ("emulated: fp8.emulate is true" if fp8.emulate else "")


def convert_for_fp8(model: torch.nn.Module, fp8, device: torch.device, rank: int = 0) -> Optional[FP8Plan]:
    """Apply the config's `fp8` block to `model` in place (nothing when it is not enabled): its Linear layers
    per `fp8_plan` become torchao `Float8Linear`s with the recipe's scaling, emulated where `device` has no fp8
    matmul. Rank 0 says once what it did (one line on stderr). Returns the plan, or None when disabled."""
    if not fp8.enabled:
        return None
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as err:
        raise ConfigError(f"fp8.enabled: FP8 training needs torchao (pip install 'zerotrain[fp8]'): {err}",
                          key="fp8.enabled") from None
    emulate, how = _emulation(fp8, device)
    plan = fp8_plan(model, tuple(fp8.exclude_modules))
    chosen = set(plan.converted)
    if isinstance(model, torch.nn.Linear) and "" in chosen:
        raise ConfigError("fp8.enabled: the model is a single Linear layer; torchao converts layers inside a "
                          "model (wrap it in a module)", key="fp8.enabled")
    convert_to_float8_training(model, config=torchao_config(fp8.recipe, emulate),
                               module_filter_fn=lambda module, name: name in chosen)
    if rank == 0:
        by_reason: dict[str, list[str]] = {}
        for name, why in plan.kept.items():
            by_reason.setdefault(why.split(" (")[0] if why.startswith("dims") else why, []).append(name)
        kept = "; ".join(f"{names[0]} ({why})" if len(names) == 1 else
                         f"{len(names)} layers ({why}: {names[0]}, ...)" for why, names in by_reason.items())
        print(f"fp8: {len(plan.converted)} of {len(plan.shapes)} Linear layers compute in float8 (torchao, recipe "
              f"{fp8.recipe}{', ' + how if how else ''}); high precision: {kept or 'none'}",
              file=sys.stderr, flush=True)
    return plan


def float8_gathered_weights(model: torch.nn.Module, plan: Optional[FP8Plan], fp8) -> list[torch.nn.Parameter]:
    """The weights ZeRO-3 gathers as float8 (`fp8.float8_all_gather`): the converted layers' (none without it)."""
    if plan is None or not fp8.float8_all_gather:
        return []
    return [model.get_submodule(name).weight for name in plan.converted]


# --- memory: what float8 adds to a step (zerotrain.estimate; docs/fp8.md, "Memory") -------------------------------
def fp8_layer_bytes(tokens: int, in_features: int, out_features: int, recipe: str, emulate: bool,
                    dtype_bytes: int) -> dict[str, int]:
    """The transient bytes one `Float8Linear` adds over an `nn.Linear` of the same shape for `tokens` rows (M),
    in its forward and in its backward; nothing is kept between them: in eager mode torchao saves the same
    high-precision input and weight as `nn.Linear`, and dynamic scaling keeps no amax history (no state).

    Emulated (torchao's `emulate=True`, measured on the CPU in fp32 by `benchmarks/fp8_memory.py`, within 2% on
    8 layer shapes): forward 13 bytes per element of input and weight (the float8 copy, its fp32 dequantized
    copies, the cast's temporaries); backward the larger of the input-gradient phase (16 per output-gradient
    element, 10 per weight element) and the weight-gradient phase (19, 14 per input element, 5 per weight
    element); rowwise adds its per-row scales and their temporaries (13 x 4 bytes per row). Native (a GPU
    with an fp8 matmul, structural, to be checked by the GPU check's FP8 row): the float8 copies, the layout
    copies `torch._scaled_mm` needs, and two high-precision temporaries of the largest cast."""
    m, k, n = int(tokens), int(in_features), int(out_features)
    mk, nk, mn = m * k, n * k, m * n
    rowwise = recipe == "rowwise"
    if emulate:
        forward = 13 * (mk + nk) + (52 * (m + n) if rowwise else 0)
        backward = max(10 * nk + 16 * mn, 14 * mk + 5 * nk + 19 * mn) + (52 * (2 * m + n + k) if rowwise else 0)
    else:
        scales = 4 * (2 * m + n + k) if rowwise else 16
        forward = mk + nk + 2 * max(mk, nk) * dtype_bytes + scales
        backward = 2 * mn + nk + mk + (mn + nk) + 2 * max(mn, mk, nk) * dtype_bytes + scales
    return {"forward": forward, "backward": backward}


def fp8_transient_bytes(plan: FP8Plan, tokens: int, recipe: str, emulate: bool, dtype_bytes: int) -> dict:
    """The largest transient of any converted layer (`fp8_layer_bytes`) for a micro-batch of `tokens` tokens:
    {"bytes", "layer", "phase"}; the step's peak grows by at most this (one layer casts at a time)."""
    best = {"bytes": 0, "layer": None, "phase": None}
    for name in plan.converted:
        out_f, in_f = plan.shapes[name]
        for phase, nbytes in fp8_layer_bytes(tokens, in_f, out_f, recipe, emulate, dtype_bytes).items():
            if nbytes > best["bytes"]:
                best = {"bytes": nbytes, "layer": name, "phase": phase}
    return best
