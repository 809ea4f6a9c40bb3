"""`zerotrain.comm`: the only package that calls torch.distributed collectives.

- `core`: :class:`Comm` (collectives over one process group, with per-kind byte counters); :class:`ShapeOnlyComm`,
  a group for a meta-device forward that moves nothing (`zerotrain estimate`).
- `handles`: :class:`CommCounters`, :class:`CollectiveError` and the handles collectives return.
- `same_host`: the transport that lets ranks on one host read each other's chunks from memory.
- `quant`: blockwise symmetric int8 / int4 quantization with torch ops (CPU and CUDA).
- `compressed`: the ZeRO++ collectives built on it — the quantized gradient reduce-scatter
  (qgZ, all-to-all based, one or two hops) with LoCo error feedback, and the int8 weight
  all-gather (qwZ).
- `at_exit`: at the interpreter's exit, waits until gloo's worker threads are parked (a process group kept
  alive past teardown by other code would otherwise abort the process if a worker drops a collective late).
- `autograd`: `all_gather_with_grad`, an all-gather whose backward reduce-scatters the gradient;
  `all_to_all_with_grad` (Ulysses' sequence <-> head exchange) and `all_reduce_with_grad`.
"""
from . import at_exit  # noqa: F401 (registers its exit callback)
from .autograd import all_gather_with_grad, all_reduce_with_grad, all_to_all_with_grad
from .core import Comm, ShapeOnlyComm, release_groups
from .handles import CollectiveError, CommCounters, Completed

__all__ = ["Comm", "ShapeOnlyComm", "release_groups", "CommCounters", "CollectiveError", "Completed", "all_gather_with_grad", "all_to_all_with_grad",
           "all_reduce_with_grad"]

# deepspeed.comm's names: a script ported with `import zerotrain as deepspeed` reaches this package by
# `deepspeed.comm.get_rank()`; say where they are instead of a bare AttributeError.
_DEEPSPEED_COMM_NAMES = frozenset({"init_distributed", "is_initialized", "destroy_process_group", "get_rank",
                                   "get_world_size", "get_local_rank", "barrier", "all_reduce", "broadcast",
                                   "all_gather", "ReduceOp", "get_global_rank", "all_gather_into_tensor",
                                   "reduce_scatter_tensor", "reduce", "send", "recv", "new_group"})


def __getattr__(name: str):
    if name in _DEEPSPEED_COMM_NAMES:
        raise AttributeError(f"zerotrain.comm is zerotrain's internal collectives package; deepspeed.comm's "
                             f"{name} is zerotrain.dist.{name} (where zerotrain.dist has it): "
                             f"`import zerotrain.dist as dist` in place of `import deepspeed.comm as dist`")
    raise AttributeError(f"module 'zerotrain.comm' has no attribute {name!r}")
