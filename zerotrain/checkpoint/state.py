"""Trainer state and RNG state: what a checkpoint keeps besides tensors, as plain JSON.

JSON rather than pickles, so that loading a checkpoint never runs code from it.
Values JSON has no type for are tagged: tuples, tensors, numpy arrays, bytes, and
dicts with non-string keys. `client_state` may hold any of those; anything else is
rejected at save time with the path of the offending value.
"""
from __future__ import annotations

import base64
import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .format import FORMAT_NAME, FORMAT_VERSION, CheckpointError, dtype_name, torch_dtype

if TYPE_CHECKING:
    from .slots import CheckpointState


def encode(value: Any, path: str = "value") -> Any:
    """A JSON-ready copy of `value` (tagged dicts for tuples, tensors, arrays, bytes)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().reshape(-1)
        data = flat.float().tolist() if flat.dtype in (torch.bfloat16, torch.float16) else flat.tolist()
        return {"__tensor__": {"dtype": dtype_name(value.dtype), "shape": list(value.shape), "data": data}}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": {"dtype": str(value.dtype), "shape": list(value.shape),
                                "data": value.reshape(-1).tolist()}}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: encode(v, f"{path}[{k!r}]") for k, v in value.items()}
        return {"__dict__": [[encode(k, f"{path}.key"), encode(v, f"{path}[{k!r}]")] for k, v in value.items()]}
    raise CheckpointError(f"{path}: a {type(value).__name__} cannot be stored in a checkpoint (allowed: JSON "
                          f"types, tuples, tensors, numpy arrays, bytes)")


def decode(value: Any) -> Any:
    """Invert `encode`."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (tag, body), = value.items()
        if tag == "__tuple__":
            return tuple(decode(v) for v in body)
        if tag == "__tensor__":
            dtype = torch_dtype(body["dtype"])
            return torch.tensor(body["data"], dtype=dtype).reshape(body["shape"])
        if tag == "__ndarray__":
            return np.array(body["data"], dtype=np.dtype(body["dtype"])).reshape(body["shape"])
        if tag == "__bytes__":
            return base64.b64decode(body)
        if tag == "__dict__":
            return {decode(k): decode(v) for k, v in body}
    return {k: decode(v) for k, v in value.items()}


# --- RNG -------------------------------------------------------------------------------------
def capture_rng() -> dict:
    """This process's generators: python, numpy, torch CPU and (when present) every CUDA device."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return encode(state, "rng")


def restore_rng(encoded: dict) -> None:
    state = decode(encoded)
    random.setstate(_tuples(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["cpu"].to(torch.uint8))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.to(torch.uint8) for s in state["cuda"]])


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


# --- trainer state ----------------------------------------------------------------------------
def capture_trainer_state(state: "CheckpointState", tag: str, client_state: dict) -> dict:
    """Counters, scheduler, loss scaler, config and topology of `state`, JSON-ready (taken now)."""
    from ..version import __version__

    gas = state.config.gradient_accumulation_steps
    scheduler = state.scheduler
    counters = state.counters.state_dict()
    topology = dict(state.topology.describe())
    topology.update(stage=state.stage, dtype=dtype_name(state.dtype),
                    gradient_accumulation_steps=gas, train_batch_size=state.config.train_batch_size)
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "zerotrain_version": __version__,
        "tag": tag,
        "global_steps": counters["global_steps"],
        "global_samples": counters["global_samples"],
        "skipped_steps": counters["skipped_steps"],
        "micro_steps": counters["micro_steps"],
        "loss_scaler": encode(state.loss_scaler.state_dict(), "loss_scaler"),
        "lr_scheduler": encode(scheduler.state_dict(), "lr_scheduler") if scheduler is not None else None,
        "config": encode(_plain(state.config.raw), "config"),
        "topology": topology,
        "client_state": encode(client_state, "client_state"),
        # only the trainable parameters were written (checkpoint.adapters_only): a load reads no frozen ones
        "adapters_only": bool(state.config.checkpoint.adapters_only),
        # what an export to DeepSpeed's layout needs beside the tensors (`deepspeed_export`)
        **module_names(state.module),
    }


def module_names(module: torch.nn.Module) -> dict:
    """The persistent buffers among the module's state (the rest are parameters) and its tied names ({alias:
    the name the tensor is saved under}), as DeepSpeed's checkpoints record them (`buffer_names`,
    `shared_params`)."""
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    first: dict = {}
    shared = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if torch.is_tensor(tensor):
            if id(tensor) in first:
                shared[name] = first[id(tensor)]
            else:
                first[id(tensor)] = name
    buffers = [name for name in module.state_dict(keep_vars=True) if name not in params and name not in shared]
    return {"buffer_names": buffers, "shared_params": shared}


def _plain(value):
    """The config as JSON types (it was read from JSON, but may have been built from Python values)."""
    try:
        return decode(encode(value))
    except CheckpointError:
        return repr(value)


def apply_trainer_state(target: "CheckpointState", state: dict, load_lr_scheduler_states: bool) -> None:
    """Restore counters, loss scale and (optionally) the LR scheduler; RNG is restored separately."""
    global_steps = int(state["global_steps"])
    target.counters.load_state_dict({
        "global_steps": global_steps,
        "global_samples": int(state["global_samples"]),
        "skipped_steps": int(state.get("skipped_steps", 0)),
        # Gradients are not saved: resume at an accumulation boundary, under this run's accumulation.
        "micro_steps": global_steps * target.config.gradient_accumulation_steps,
    })
    target.loss_scaler.load_state_dict(decode(state["loss_scaler"]))
    scheduler = target.scheduler
    if load_lr_scheduler_states and scheduler is not None and state.get("lr_scheduler") is not None:
        scheduler.load_state_dict(decode(state["lr_scheduler"]))
