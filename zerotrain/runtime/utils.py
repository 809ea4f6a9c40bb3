"""`deepspeed.runtime.utils`' names that training programs call, with DeepSpeed 0.19.8's behaviour.

`set_random_seed(seed)` (Python's `random`, numpy's and torch's generators; DeepSpeed's pipeline example and
Megatron-DeepSpeed seed through it), `see_memory_usage(message, force=False)` (rank 0 prints the device's
allocated/reserved memory and the host's, only when `force`), `RepeatingLoader`, `partition_uniform` /
`partition_balanced` (the pipeline cut, `zerotrain.pipe.module`), `move_to_device`. The rest of DeepSpeed's
module (its gradient-norm and fp16 helpers, `PartitionedTensor`, ...) belongs to its engine internals and has
no counterpart here (`zerotrain port` lists it: `zerotrain.port.paths`).
"""
from __future__ import annotations

import gc
import random
from typing import Any

import torch

from ..accelerator import get_accelerator
from ..pipe.module import partition_balanced, partition_uniform
from ..utils.repeating import RepeatingLoader

__all__ = ["set_random_seed", "see_memory_usage", "RepeatingLoader", "partition_uniform", "partition_balanced",
           "move_to_device"]


def set_random_seed(seed: int) -> None:
    """Seed Python's `random`, numpy's global generator (seed mod 2³²) and torch's (seed mod 2⁶³), as DeepSpeed."""
    import numpy

    random.seed(seed)
    numpy.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed % (2 ** 63))


def see_memory_usage(message: str, force: bool = False) -> None:
    """With `force`, print `message`, the device memory (allocated, its peak, reserved, its peak, GB) and the
    host's used memory, on global rank 0 only, then reset the device's peak counters; without it, nothing."""
    import torch.distributed as dist

    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    accel, gib = get_accelerator(), 1024 ** 3
    print(message)
    print(f"MA {round(accel.memory_allocated() / gib, 2)} GB Max_MA {round(accel.max_memory_allocated() / gib, 2)} GB "
          f"CA {round(accel.memory_reserved() / gib, 2)} GB Max_CA {round(accel.max_memory_reserved() / gib)} GB ")
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with torch's usual installs
        psutil = None
    if psutil is not None:
        stats = psutil.virtual_memory()
        print(f"CPU Virtual Memory:  used = {round((stats.total - stats.available) / gib, 2)} GB, "
              f"percent = {stats.percent}%")
    accel.reset_peak_memory_stats()


def move_to_device(item: Any, device: Any, criterion_func: Any = None) -> Any:
    """`item` with every tensor inside lists, tuples and dicts moved to `device` (DeepSpeed's helper: an item
    that `criterion_func` accepts is moved in place, its `.data` replaced)."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device)
