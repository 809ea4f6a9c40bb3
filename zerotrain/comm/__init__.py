"""`zerotrain.comm`: the only package that calls torch.distributed collectives.

- `core`: :class:`Comm` (collectives over one process group, with per-kind byte counters),
  :class:`CommCounters`, :class:`CollectiveError`.
- `quant`: blockwise symmetric int8 / int4 quantization with torch ops (CPU and CUDA).
- `compressed`: the ZeRO++ collectives built on it — the quantized gradient reduce-scatter
  (qgZ, all-to-all based, one or two hops) with LoCo error feedback, and the int8 weight
  all-gather (qwZ).
"""
from .core import (CollectiveError, Comm, CommCounters, _all_gather_single, _Done, _failure, _Named, _nbytes,
                   _reduce_scatter_single)

__all__ = ["Comm", "CommCounters", "CollectiveError"]
