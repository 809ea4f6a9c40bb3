"""Whole weights in and out of an engine's parts: full fp32 weights on rank 0, DeepSpeed's 16-bit
state dict and `save_16bit_model`, the module's own state dict, and loading weights into the weights
and the masters. `consolidate.full_state_dict` joins the shards; this module says what to join.
"""
from __future__ import annotations

import os
import warnings

import torch

from ..consolidate import full_state_dict as consolidate_full_state_dict
from .parts import EngineParts
from .state import publish_weights

__all__ = ["full_state_dict", "consolidated_16bit_state_dict", "save_16bit_model", "module_state_dict",
           "load_state_dict"]


def full_state_dict(parts: EngineParts, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Full fp32 weights on CPU under the model's parameter names, on rank 0 only (collective).
    `trainable_only`: only the parameters that require grad (e.g. a LoRA adapter without its base).

    Data-parallel shards are gathered on data-parallel rank 0; with tensor parallelism the
    slices of its tensor-parallel group are then joined on tensor-parallel rank 0 (global
    rank 0), by the TensorSlice each split parameter carries.
    """
    optimizer = parts.zero_optimizer
    return consolidate_full_state_dict(parts.module, parts.weights.buckets, optimizer.masters, parts.comm,
                                       parts.tp_comm, frozen=parts.weights.frozen,
                                       resident_masters=optimizer.resident_masters,  # NVMe: masters are in files
                                       trainable_only=trainable_only)


def consolidated_16bit_state_dict(parts: EngineParts, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """Whole weights in the training dtype (fp32 masters cast) plus persistent buffers, on global rank 0
    ({} elsewhere). Collective: every rank must call it."""
    full = full_state_dict(parts)
    if parts.topology.rank != 0:
        return {}
    module = parts.module
    frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    state = {n: t.to(parts.dtype) for n, t in full.items() if not (exclude_frozen_parameters and n in frozen)}
    for module_name, sub in module.named_modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                state.setdefault(f"{module_name}.{name}" if module_name else name, buffer.detach().cpu().clone())
    return state


def save_16bit_model(parts: EngineParts, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """Write whole weights in the training dtype to save_dir/save_filename on global rank 0 (torch.save,
    or safetensors for a `.safetensors` name). Collective. At ZeRO-3 only with
    `zero_optimization.stage3_gather_16bit_weights_on_model_save: true`, else nothing is written (with a
    warning) and False is returned, as in DeepSpeed."""
    path = os.path.join(save_dir, save_filename)
    if parts.weights.partitioned and not parts.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        warnings.warn(f"save_16bit_model did not write {path}: at ZeRO stage 3 it needs "
                      "zero_optimization.stage3_gather_16bit_weights_on_model_save: true (as in DeepSpeed)")
        return False
    state = consolidated_16bit_state_dict(parts, exclude_frozen_parameters)
    if parts.topology.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        if save_filename.endswith(".safetensors"):
            from safetensors.torch import save_file
            seen: set = set()
            tensors = {}
            for name, tensor in state.items():  # safetensors refuses shared storage (tied weights)
                tensors[name] = tensor.clone() if id(tensor) in seen else tensor.contiguous()
                seen.add(id(tensor))
            save_file(tensors, path, metadata={"format": "pt"})
        else:
            torch.save(state, path)
    parts.comm.all_gather_object(None)  # no rank returns before the file is written
    return True


def module_state_dict(parts: EngineParts, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """The wrapped model's own state_dict (training dtype); refused where parameters are partitioned."""
    if parts.weights.partitioned:
        raise RuntimeError("module_state_dict(): at ZeRO stage 3 the parameters are partitioned; "
                           "use engine.consolidated_16bit_state_dict() (collective) or engine.save_16bit_model()")
    state = parts.module.state_dict()
    if exclude_frozen_parameters:
        frozen = {n for n, p in parts.module.named_parameters() if not p.requires_grad}
        state = {k: v for k, v in state.items() if k not in frozen}
    return state


def load_state_dict(parts: EngineParts, state_dict: dict, strict: bool = True) -> tuple[list, list]:
    """Load weights given as `module.`-prefixed keys or as the model's own names into the weights and the
    fp32 masters; returns (missing, unexpected)."""
    own = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state_dict.items()}
    expected = dict(parts.module.named_parameters())
    expected.update(dict(parts.module.named_buffers()))
    missing = sorted(set(expected) - set(own))
    unexpected = sorted(set(own) - set(expected))
    if strict and (missing or unexpected):
        raise RuntimeError(f"load_state_dict: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}")
    names = [n for n in own if n in expected]
    with torch.no_grad():
        publish = parts.weights.load(own, expected, names, parts.zero_optimizer.masters)
    if publish:
        publish_weights(parts)
    return missing, unexpected
