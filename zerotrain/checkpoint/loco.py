"""LoCo's error buffers in a checkpoint: one small safetensors file per rank.

With `zero_quantized_gradients` and `zeropp_loco_param`, every rank keeps an error buffer
per gradient bucket and hop (int8 values plus block scales, `zerotrain.comm.compressed`).
It is per-rank state tied to the data-parallel layout, so it is saved as it is, in
`loco_state_<rank>.safetensors` (tensors under "loco/..." keys, the rest of
the gradient reducer's `loco_state()` as JSON in the header's metadata), listed in the manifest with
its size and crc32 like every other file. A resumed run on the same layout continues
exactly; on another layout, or when the checkpoint holds no buffers for this rank, the
buffers restart from zero with a warning (`load_loco_state`, `zero.reduce.QuantizedReduce`).
"""
from __future__ import annotations

import json
import warnings
from typing import Any, Optional

import torch
from safetensors import safe_open

from .format import CheckpointError, SafetensorsWriter
from .integrity import manifest_entry
from .slots import LoCoState

_KIND = "loco"


def loco_file(rank: int) -> str:
    """The name of rank `rank`'s LoCo state file inside a checkpoint directory."""
    return f"loco_state_{rank}.safetensors"


def capture_loco(loco: LoCoState) -> Optional[dict]:
    """This rank's LoCo state (CPU copies, safe to write later), or None when LoCo is off."""
    if not loco.enabled:
        return None
    return loco.state_dict()


def _flatten(value: Any, path: str, tensors: dict) -> Any:
    """`value` with every tensor replaced by {"__tensor__": key}; the tensors go to `tensors[key]`."""
    if torch.is_tensor(value):
        tensors[path] = value.detach().cpu().contiguous()
        return {"__tensor__": path}
    if isinstance(value, dict):
        return {str(k): _flatten(v, f"{path}/{k}", tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_flatten(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    return value


def _unflatten(value: Any, tensors: dict, path: str) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            key = value["__tensor__"]
            if key not in tensors:
                raise CheckpointError(f"{path}: LoCo tensor {key!r} is missing")
            return tensors[key]
        return {k: _unflatten(v, tensors, path) for k, v in value.items()}
    if isinstance(value, list):
        return [_unflatten(v, tensors, path) for v in value]
    return value


def write_loco(path: str, state: dict) -> dict:
    """Write `state` (from `capture_loco`) to `path`, fsynced; returns its manifest entry {size, crc32}."""
    tensors: dict = {}
    skeleton = _flatten(state, _KIND, tensors)
    entries = [(key, tensor.dtype, tuple(tensor.shape)) for key, tensor in tensors.items()]
    writer = SafetensorsWriter(path, entries, {"zerotrain": _KIND, "state": json.dumps(skeleton)})
    try:
        for key, tensor in tensors.items():
            writer.write(key, [tensor])
        size, crc = writer.close()
    except BaseException:
        writer.abort()
        raise
    return manifest_entry(size, crc)


def read_loco(path: str) -> dict:
    """Read back what `write_loco` wrote (raises CheckpointError naming the file when it cannot)."""
    try:
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        if metadata.get("zerotrain") != _KIND or "state" not in metadata:
            raise CheckpointError(f"{path} is not a LoCo state file")
        return _unflatten(json.loads(metadata["state"]), tensors, path)
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - any read or parse failure names the file
        raise CheckpointError(f"cannot read LoCo state {path}: {type(error).__name__}: {error}") from error


def restore_loco(loco: LoCoState, state: Optional[dict], path: str, rank: int) -> None:
    """Give the reducer its saved LoCo buffers, or restart them from zero (warning) when there are none.

    Called after the counters are restored: the reducer's step count (reset_T) follows them."""
    if loco.enabled and state is None:
        warnings.warn(f"checkpoint {path} holds no LoCo error buffers for rank {rank}; they restart from zero")
    loco.load_state_dict(state)
