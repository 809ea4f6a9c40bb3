"""How a bucket's gradient is summed over its ShardGroup: the reduce a gradient reducer is given.

Every reducer (`zero.grads.FullBufferReducer`, `zero.grads.PartitionedReducer`,
`zero.stage3.grads.Stage3GradReducer`) stages gradients into buckets and launches them in order;
what one launch does to a bucket's buffer is this part, plugged in:

- :class:`ExactReduce`: the collective of `comm` (all-reduce, or reduce-scatter of a rank-major buffer),
  over the bucket's own group (`bucket.group.comm`: the data-parallel ranks, or split experts'
  expert-data-parallel group);
- :class:`QuantizedReduce`: qgZ, the quantized all-to-all reduce of `zerotrain.comm.compressed` (int4,
  one hop, or two across nodes over the data-parallel ranks; split experts one hop over their group),
  with LoCo error feedback per bucket when `loco_beta` is set. It owns the error buffers: their
  bookkeeping after each optimizer step (reset every `reset_T` steps, dropped on an fp16 overflow,
  rescaled when the loss scale changes) and their checkpoint state. It has no all-reduce: qgZ quantizes
  reduce-scatters (stages 1-3), never a replicated buffer.

A reduce is bound to its reducer's buckets once (`bind`): anything with `group` (a ShardGroup) and
`shard_numel`, in launch order.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..comm import Comm
from ..comm.compressed import QuantizedReduceScatter
from ..comm.quant import DEFAULT_BLOCK
from .interfaces import BucketReduce

__all__ = ["GradQuantization", "ExactReduce", "QuantizedReduce", "reduce_for"]


@dataclass
class GradQuantization:
    """How qgZ compresses gradients: bits, block size, LoCo (beta None: no error feedback),
    and the (intra-node, inter-node) Comms of a two-hop reduce (None: one hop)."""

    bits: int = 4
    block_size: int = DEFAULT_BLOCK
    loco_beta: Optional[float] = None
    reset_T: int = 1024
    hierarchy: Optional[tuple[Comm, Comm]] = None


class ExactReduce(BucketReduce):
    """The exact sum: `comm`'s all-reduce or reduce-scatter over each bucket's group."""

    exact = True

    def __init__(self) -> None:
        self.buckets: Sequence = ()

    def bind(self, buckets: Sequence) -> None:
        self.buckets = buckets

    def all_reduce(self, index: int, source: torch.Tensor):
        return self.buckets[index].group.comm.all_reduce(source, async_op=True)

    def reduce_scatter(self, index: int, source: torch.Tensor, out: Optional[torch.Tensor] = None):
        return _reduce_scatter(self.buckets[index], source, out)


class QuantizedReduce(BucketReduce):
    """qgZ (with LoCo when `quantization.loco_beta` is set): one QuantizedReduceScatter per bucket.

    `comm` is the data-parallel Comm: buckets reduced over it take the two-hop path of
    `quantization.hierarchy`; the LoCo layout a checkpoint records names its size and this rank.
    """

    exact = False

    def __init__(self, quantization: GradQuantization, comm: Comm):
        self.quantization = quantization
        self.comm = comm
        self.buckets: Sequence = ()
        # per bucket: its quantized reducer, None where the bucket's group is this rank alone
        self.per_bucket: list[Optional[QuantizedReduceScatter]] = []

    def bind(self, buckets: Sequence) -> None:
        self.buckets = buckets
        self.per_bucket = [self._reducer_of(bucket) for bucket in buckets] if self.comm.size > 1 else []

    def _reducer_of(self, bucket) -> Optional[QuantizedReduceScatter]:
        """Over the data-parallel ranks (two hops across nodes), or for split experts over their
        expert-data-parallel group in one hop (None where that group is this rank alone)."""
        comm = bucket.group.comm
        if comm.size == 1:
            return None
        quantization = self.quantization
        hierarchy = quantization.hierarchy if comm is self.comm else None
        return QuantizedReduceScatter(comm, bucket.shard_numel, bits=quantization.bits,
                                      block_size=quantization.block_size, loco_beta=quantization.loco_beta,
                                      hierarchy=hierarchy)

    def all_reduce(self, index: int, source: torch.Tensor):
        raise ValueError("qgZ quantizes reduce-scatters; a replicated gradient buffer (ZeRO stage 0) is "
                         "all-reduced exactly")

    def reduce_scatter(self, index: int, source: torch.Tensor, out: Optional[torch.Tensor] = None):
        reducer = self.per_bucket[index] if self.per_bucket else None
        if reducer is None:  # a data-parallel world of one: nothing to quantize
            return _reduce_scatter(self.buckets[index], source, out)
        return reducer(source)

    # --- LoCo ---------------------------------------------------------------
    @property
    def loco_enabled(self) -> bool:
        return bool(self.per_bucket) and self.quantization.loco_beta is not None

    def _reducers(self) -> list[QuantizedReduceScatter]:
        """The quantized reducers there are (an expert bucket no other rank holds has none)."""
        return [reducer for reducer in self.per_bucket if reducer is not None]

    def loco_after_step(self, overflow: bool, scale_before: float, scale_after: float, steps: int) -> None:
        """LoCo's error buffers are dropped on an overflow, rescaled when the loss scale changed, and
        zeroed every reset_T optimizer steps (`steps`: counted so far, this one included)."""
        if not self.loco_enabled:
            return
        for reducer in self._reducers():
            if overflow:
                reducer.reset_error()
            elif scale_after != scale_before:
                reducer.rescale_error(scale_after / scale_before)
            if steps % self.quantization.reset_T == 0:
                reducer.reset_error()

    def loco_state(self) -> dict:
        return {"layout": self._layout(),
                "buffers": [[feedback.state_dict() for feedback in reducer.feedbacks] if reducer is not None else []
                            for reducer in self.per_bucket]}

    def load_loco_state(self, state: dict) -> bool:
        if not self.loco_enabled:
            return False
        layout, current = state.get("layout"), self._layout()
        if isinstance(layout, dict):  # saved before "expert_partitions" existed: no experts then
            layout = {"expert_partitions": [], **layout}
        if layout != current:
            warnings.warn(f"LoCo error buffers of rank {self.comm.rank} were saved on another layout "
                          f"({state.get('layout')} vs {current}); they restart from zero")
            self.reset_loco_state()
            return False
        device = self.buckets[0].device if self.buckets else None
        for reducer, saved in zip(self.per_bucket, state["buffers"]):
            for feedback, entry in zip(reducer.feedbacks if reducer is not None else [], saved):
                feedback.load_state_dict(entry, device)
        return True

    def reset_loco_state(self) -> None:
        for reducer in self._reducers():
            reducer.reset_error()

    def _layout(self) -> dict:
        return {"world": self.comm.size, "rank": self.comm.rank,
                "shards": [bucket.shard_numel for bucket in self.buckets],
                "hops": [[hop.rows, hop.cols] for reducer in self._reducers()[:1] for hop in reducer.hops],
                "loco": self.loco_enabled,
                # expert buckets: how many ranks share each one's reduction (the expert-data-parallel group)
                "expert_partitions": [bucket.group.partitions for bucket in self.buckets if bucket.group.expert]}

    def loco_bytes(self) -> int:
        """Bytes of LoCo error buffers (8-bit values plus block scales)."""
        return sum(feedback.nbytes for reducer in self._reducers() for feedback in reducer.feedbacks)


def _reduce_scatter(bucket, source: torch.Tensor, out: Optional[torch.Tensor]):
    """The exact reduce-scatter of `source` over the bucket's group, into `out` (or a new shard)."""
    if out is None:
        out = torch.empty(bucket.shard_numel, dtype=source.dtype, device=source.device)
    return out, bucket.group.comm.reduce_scatter(out, source, async_op=True)


def reduce_for(quantization: Optional[GradQuantization], comm: Comm) -> BucketReduce:
    """The reduce a config asks for: qgZ (+ LoCo) with a quantization, else the exact one."""
    return ExactReduce() if quantization is None else QuantizedReduce(quantization, comm)
