"""What a save reads from the engine, taken at one instant: the bytes of this rank's pieces.

A synchronous save on the CPU reads the live tensors (training waits for it). An
asynchronous save, or any save from an accelerator, first copies the pieces this rank
contributes into host buffers that are kept and reused by the next save (pinned when
CUDA is present), so the training step blocks only for that copy. Only the pieces the
plan needs are copied: all of a sharded slot, but of a replicated (stage-0) slot only
the tensors this rank writes.

With `defer`, the copies are only listed (`Sources.copies`) and run later by
`Sources.complete()` in the background writer, while training goes on with its next
forward and backward; the checkpointer fences the next optimizer update on their
completion (nothing before it changes the slots). Small state (optimizer scalars)
and whole tensors outside the slots (buffers, which a forward may update) are always
copied at once.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

import torch

from .format import dtype_name
from .optim_state import scalar_value, split_state
from .plan import SavePlan, extra_tensors
from .slots import CheckpointState


class HostBuffers:
    """Host tensors reused across saves, keyed by what they hold."""

    def __init__(self) -> None:
        self._buffers: dict = {}
        self.allocations = 0  # buffers allocated so far: unchanged by a save that reuses them all

    def get(self, key, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() != numel or buffer.dtype != dtype:
            buffer = torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())
            self._buffers[key] = buffer
            self.allocations += 1
        return buffer

    def addresses(self) -> dict:
        """{key: data pointer} of every buffer (tests check that a second save reuses the first's memory)."""
        return {key: buffer.data_ptr() for key, buffer in self._buffers.items()}

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


@dataclass
class Sources:
    """Byte views (uint8, CPU) of this rank's slot tensors and of the extra tensors it writes."""

    slots: dict = field(default_factory=dict)     # (slot, kind) -> (uint8 tensor, itemsize)
    extras: dict = field(default_factory=dict)    # name -> uint8 tensor of the whole tensor
    scalars: dict = field(default_factory=dict)   # slot -> {key: float}
    copies: list = field(default_factory=list)    # deferred (destination, source) copies
    error: Optional[BaseException] = None         # why the deferred copies failed: the save then fails

    def complete(self) -> None:
        """Run the deferred copies (the background writer does, before the next optimizer update)."""
        copies, self.copies = self.copies, []
        try:
            for destination, source in copies:
                destination.copy_(source)
        except Exception as error:  # noqa: BLE001 - the job reports it to every rank
            self.error = error

    def piece(self, piece, kind: str) -> torch.Tensor:
        data, size = self.slots[(piece.slot, kind)]
        return data[piece.shard_start * size:(piece.shard_start + piece.numel) * size]


def _slot_tensor(optimizer: torch.optim.Optimizer, slot, kind: str) -> torch.Tensor:
    if kind == "model":
        return slot.model_shard
    if kind == "master":
        return slot.master
    return optimizer.state[slot.master][kind[len("state:"):]]


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def capture(state: CheckpointState, slots, plan: SavePlan, rank: int, pool: HostBuffers, copy: bool,
            defer: bool = False) -> Sources:
    """The bytes this rank contributes to the save; copied into `pool` when `copy` (or off the CPU).

    `defer` (CPU tensors only): list the copies in `Sources.copies` instead of running them.
    """
    sources = Sources()
    needed: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for tensor in plan.tensors.values():
        for kind, _ in tensor.kinds(plan.master_separate):
            for piece in tensor.pieces:
                if piece.rank == rank:
                    needed.setdefault((piece.slot, kind), []).append(
                        (piece.shard_start, piece.shard_start + piece.numel))
    copied_to_host = False
    for (index, kind), ranges in needed.items():
        source = _slot_tensor(state.optimizer, slots[index], kind).detach()
        if not copy and source.device.type == "cpu":
            data = source
        else:
            data = pool.get(("slot", index, kind), source.numel(), source.dtype)
            for start, end in _merged(ranges):
                if defer:
                    sources.copies.append((data[start:end], source[start:end]))
                else:
                    data[start:end].copy_(source[start:end], non_blocking=True)
            copied_to_host = copied_to_host or source.device.type != "cpu"
        sources.slots[(index, kind)] = (data.view(torch.uint8), data.element_size())
    sharded = {name for name, t in plan.tensors.items() if t.pieces}
    for name, tensor in extra_tensors(state.module, sharded):
        planned = plan.tensors.get(name)
        if planned is None or planned.writer != rank:
            continue
        flat = tensor.detach().reshape(-1)
        if copy or flat.device.type != "cpu" or not flat.is_contiguous():
            data = pool.get(("extra", name), flat.numel(), flat.dtype)
            data.copy_(flat, non_blocking=True)  # never deferred: forward may update buffers (BatchNorm)
            copied_to_host = copied_to_host or flat.device.type != "cpu"
            flat = data
        sources.extras[name] = flat.view(torch.uint8)
    for index, slot in enumerate(slots):
        if slot.master is None:
            continue
        _, scalars = split_state(state.optimizer.state.get(slot.master, {}), slot.master)
        sources.scalars[index] = {key: scalar_value(value) for key, value in scalars.items()}
    if copied_to_host:
        torch.cuda.synchronize()
    return sources


def hf_config_files(module: torch.nn.Module, dtype: torch.dtype) -> dict[str, dict]:
    """config.json (and generation_config.json) of a Hugging Face model, naming the saved dtype."""
    if hasattr(module, "get_base_model") and hasattr(module, "peft_config"):
        module = module.get_base_model()  # a PEFT-wrapped model: the base model's config and architecture
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict") or not hasattr(config, "model_type"):
        return {}
    payload = json.loads(json.dumps(config.to_dict(), default=str))
    payload["dtype" if "dtype" in payload or "torch_dtype" not in payload else "torch_dtype"] = dtype_name(dtype)
    if not payload.get("architectures"):
        payload["architectures"] = [type(module).__name__]
    files = {"config.json": payload}
    generation = getattr(module, "generation_config", None)
    if generation is not None and hasattr(generation, "to_dict"):
        files["generation_config.json"] = json.loads(json.dumps(generation.to_dict(), default=str))
    return files
