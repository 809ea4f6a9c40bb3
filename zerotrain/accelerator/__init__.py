"""`zerotrain.accelerator.get_accelerator()`: DeepSpeed's accelerator object, for CUDA and the CPU.

DeepSpeed programs call `get_accelerator().device_name(local_rank)`, `.set_device`, `.manual_seed_all`,
`.synchronize`, `.memory_allocated`, ... before and after an engine exists. This is the same object
with the same names and meaning, over torch: the device is CUDA when torch sees a GPU, else the CPU (where
seeds, synchronize and memory calls are what torch's CPU offers: memory counters read 0). Nothing else
of DeepSpeed's accelerator layer (op builders, other vendors) is mirrored.
"""
from __future__ import annotations


from .real_accelerator import Accelerator, get_accelerator, set_accelerator

__all__ = ["Accelerator", "get_accelerator", "set_accelerator"]
