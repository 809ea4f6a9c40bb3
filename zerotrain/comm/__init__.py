"""`zerotrain.comm`: the only package that calls torch.distributed collectives.

- `core`: :class:`Comm` (collectives over one process group, with per-kind byte counters).
- `handles`: :class:`CommCounters`, :class:`CollectiveError` and the handles collectives return.
- `same_host`: the transport that lets ranks on one host read each other's chunks from memory.
- `quant`: blockwise symmetric int8 / int4 quantization with torch ops (CPU and CUDA).
- `compressed`: the ZeRO++ collectives built on it — the quantized gradient reduce-scatter
  (qgZ, all-to-all based, one or two hops) with LoCo error feedback, and the int8 weight
  all-gather (qwZ).
- `autograd`: `all_gather_with_grad`, an all-gather whose backward reduce-scatters the gradient;
  `all_to_all_with_grad` (Ulysses' sequence <-> head exchange) and `all_reduce_with_grad`.
"""
from .autograd import all_gather_with_grad, all_reduce_with_grad, all_to_all_with_grad
from .core import Comm
from .handles import CollectiveError, CommCounters, Completed

__all__ = ["Comm", "CommCounters", "CollectiveError", "Completed", "all_gather_with_grad", "all_to_all_with_grad",
           "all_reduce_with_grad"]
