"""How a checkpoint's inputs are kept until its recompute: partitioned over the tensor-parallel
ranks, in host memory, and/or in one contiguous arena.

torch's non-reentrant checkpoint saves the checkpointed function's tensor inputs through
autograd's saved-tensor mechanism *before* it installs its own hooks for the function's body,
so a `saved_tensors_hooks` pair entered around the call sees exactly those inputs: `InputSaver`
is that pair. Its pack keeps

- `partition_activations`: this tensor-parallel rank's 1/tp slice of the flattened input (the
  input of a checkpointed transformer block is the same on every tensor-parallel rank, as
  DeepSpeed and Megatron assume); unpack all-gathers it back over the tensor-parallel group;
- `cpu_checkpointing`: the kept tensor (slice) in host memory, pinned when it came from an
  accelerator, copied back to its device at unpack;
- `contiguous_memory_optimization`: the kept slices in slots of one preallocated buffer per
  size (`number_checkpoints` slots), reused as saved inputs are freed, so many checkpoints do not
  fragment device memory.

Only floating-point tensors with at least tp elements are kept this way (DeepSpeed's rule);
parameters and everything else are saved as they are.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from ..comm import Comm


@dataclass
class _Kept:
    """A packed input: its kept data and how to rebuild the full tensor."""

    data: torch.Tensor  # the slice (partitioned) or the whole flattened tensor
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    numel: int
    partitioned: bool


class ContiguousArena:
    """Slots of `slots` x `numel` elements per (numel, dtype, device), handed out and given back."""

    def __init__(self, slots: int):
        self.slots = max(1, int(slots))
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.free: dict[tuple, list[int]] = {}
        self.overflows = 0  # slices that found no free slot (kept in their own tensor)

    def take(self, source: torch.Tensor, owner: object) -> torch.Tensor:
        """A copy of 1-D `source` in a free slot; the slot is given back when `owner` is collected."""
        key = (source.numel(), source.dtype, source.device, source.is_pinned() if source.device.type == "cpu" else False)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(self.slots * source.numel(), dtype=source.dtype, device=source.device,
                                            pin_memory=key[3])
            self.free[key] = list(range(self.slots - 1, -1, -1))
        if not self.free[key]:
            self.overflows += 1
            return source
        slot = self.free[key].pop()
        view = self.buffers[key][slot * source.numel():(slot + 1) * source.numel()]
        view.copy_(source)
        weakref.finalize(owner, self.free[key].append, slot)
        return view

    def reset(self) -> None:
        self.buffers.clear()
        self.free.clear()


class InputSaver:
    """The `saved_tensors_hooks` pack/unpack pair for checkpoint inputs (see module docstring)."""

    def __init__(self, tp: Optional[Comm], partition: bool, cpu: bool, arena: Optional[ContiguousArena],
                 stats: dict):
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.partition = partition and self.tp is not None
        self.cpu = cpu
        self.arena = arena
        self.stats = stats

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _applies(self, tensor: torch.Tensor) -> bool:
        if not (self.partition or (self.cpu and tensor.device.type != "cpu")):
            return False  # nothing to save (on a CPU run, cpu_checkpointing alone changes nothing)
        size = self.tp.size if self.partition else 1
        return (not isinstance(tensor, torch.nn.Parameter) and tensor.is_floating_point()
                and tensor.numel() >= size and not getattr(tensor, "no_checkpointing", False))

    def pack(self, tensor: torch.Tensor):
        if not self._applies(tensor):
            return tensor
        flat = tensor.detach().reshape(-1)
        data = flat
        if self.partition:
            size, rank = self.tp.size, self.tp.rank
            chunk = -(-flat.numel() // size)
            if chunk * size != flat.numel():
                flat = torch.nn.functional.pad(flat, (0, chunk * size - flat.numel()))
            data = flat[rank * chunk:(rank + 1) * chunk]
        if self.cpu and data.device.type != "cpu":
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            host.copy_(data, non_blocking=True)
            data = host
        kept = _Kept(data, tensor.shape, tensor.dtype, tensor.device, tensor.numel(), self.partition)
        if self.arena is not None:
            kept.data = self.arena.take(data, kept)
        elif data.device == tensor.device:
            kept.data = data.clone()  # a slice of the input would keep the whole input alive
        where = "host" if kept.data.device.type == "cpu" and tensor.device.type != "cpu" else "device"
        self.stats[f"kept_{where}_bytes"] += kept.data.numel() * kept.data.element_size()
        self.stats["input_bytes"] += tensor.numel() * tensor.element_size()
        return kept

    def unpack(self, kept):
        if not isinstance(kept, _Kept):
            return kept
        data = kept.data.to(kept.device, non_blocking=True)
        if kept.partitioned:
            full = torch.empty(data.numel() * self.tp.size, dtype=data.dtype, device=data.device)
            self.tp.all_gather(full, data.contiguous())
            data = full[:kept.numel]
        return data.view(kept.shape)
