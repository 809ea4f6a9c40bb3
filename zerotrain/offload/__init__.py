"""Optimizer states and the optimizer step off the device: CPU (fused CPU Adam, SuperOffload-style
overlap with exact rollback) and NVMe (async I/O swapper with bounded aligned buffers).

The engine (`zerotrain.engine.parts`) picks the class from `zero_optimization.offload_optimizer`; every
class is a ShardedOptimizer (`zero.interfaces.MasterOptimizer`) (`masters`, `step`, `publish`, `has_overflow`, `grad_norm`,
`state_bytes`, `last_grad_norm`, `param_groups`, `optimizer`) plus `stats`, `memory_split()`,
`offloaded_bytes()`, `resident_states()` (the checkpoint saves and loads inside it) and `close()`.
An offloaded run computes what the device run computes.
"""
from .aio import OffloadIOError
from .cpu_optimizer import OffloadOptimizer, choose_offloaded, resident_states
from .nvme import NvmeOffloadOptimizer
from .speculative import SuperOffloadOptimizer

__all__ = ["OffloadIOError", "OffloadOptimizer", "SuperOffloadOptimizer", "NvmeOffloadOptimizer",
           "choose_offloaded", "resident_states"]
