"""Gradient reduction for ZeRO stages 0-2, overlapped with backward.

Per bucket, as soon as backward has produced every gradient in it:

- stage 0 keeps a full gradient buffer (the parameters' `.grad` are views of it)
  and all-reduces it at the accumulation boundary;
- stage 1 keeps the same full buffer and reduce-scatters it at the boundary, so
  each rank ends with only its shard of the reduced gradient;
- stage 2 keeps no full buffer: every micro-step, each gradient is copied into a
  transient staging bucket, reduce-scattered, and added into this rank's fp32
  gradient shard; the full gradient is freed at once.

Gradients are divided by the data-parallel size before the reduction, so the
reduced result is the mean. Buckets are launched strictly in index order on
every rank, whatever order the hooks fire in, so collectives always match.

With `zero_quantized_gradients` (qgZ, stages 1-3) each reduce-scatter becomes the
quantized all-to-all reduce of `zerotrain.comm.compressed` (int4, one or two hops),
optionally with LoCo error feedback per bucket; the engine reports each optimizer
step (`after_optimizer_step`) so the error buffers are reset every `reset_T` steps,
dropped on an fp16 overflow and rescaled when the loss scale changes.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from ..comm import Comm
from ..comm.compressed import QuantizedReduceScatter
from ..comm.quant import DEFAULT_BLOCK
from .flat import FlatBucket


@dataclass
class GradQuantization:
    """How qgZ compresses gradients: bits, block size, LoCo (beta None: no error feedback),
    and the (intra-node, inter-node) Comms of a two-hop reduce (None: one hop)."""

    bits: int = 4
    block_size: int = DEFAULT_BLOCK
    loco_beta: Optional[float] = None
    reset_T: int = 1024
    hierarchy: Optional[tuple[Comm, Comm]] = None


class GradReducer:
    """Owns gradient buffers and the hooks that reduce them during backward."""

    def __init__(self, buckets: list[FlatBucket], comm: Comm, stage: int, reduce_dtype: Optional[torch.dtype] = None,
                 quantization: Optional[GradQuantization] = None):
        self.buckets = buckets
        self.comm = comm
        self.stage = stage
        self.reduce_dtype = reduce_dtype
        self.keeps_full_grads = stage <= 1
        # stage 0/1: full gradient buffers in the training dtype; params' .grad are views.
        self.full_grads: list[Optional[torch.Tensor]] = [
            torch.zeros_like(b.flat_param) if self.keeps_full_grads else None for b in buckets]
        # The reduced gradient this rank owns, fp32 (stage 0: the whole bucket).
        self.grad_shards: list[Optional[torch.Tensor]] = [None] * len(buckets)
        self._staging: list[Optional[torch.Tensor]] = [None] * len(buckets)
        self._pending: list[tuple[int, object, Optional[torch.Tensor]]] = []
        self._ready_count = [0] * len(buckets)
        self._next_launch = 0
        self._reduce_now = False
        self._boundary = False
        # Called with a bucket index once its gradient shard is final for this step
        # (during backward, while later buckets are still being computed).
        self.shard_ready_callbacks: list = []
        self._where = {}
        for bucket_index, bucket in enumerate(buckets):
            for position, param in enumerate(bucket.params):
                self._where[id(param)] = (bucket_index, position)
                param.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._attach_grad_views()
        self.quantization: Optional[GradQuantization] = None
        self.quantized_reducers: list[Optional[QuantizedReduceScatter]] = []
        self.optimizer_steps = 0  # counted for LoCo's reset_T
        self.set_gradient_quantization(quantization)

    # --- per micro-step ---------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        """Arm the hooks for one backward; reduce during it if this is the boundary (or stage 2)."""
        self._reduce_now = boundary or self.stage == 2
        self._boundary = boundary
        self._ready_count = [0] * len(self.buckets)
        self._next_launch = 0
        self._attach_grad_views()

    def end_backward(self) -> None:
        """Launch buckets whose gradients never all arrived (unused params), then wait for all."""
        if self._reduce_now:
            while self._next_launch < len(self.buckets):
                self._launch(self._next_launch)
                self._next_launch += 1
        self._drain(keep=0)
        self._reduce_now = False

    def zero(self) -> None:
        """Forget all gradients (after a step, or when a step is skipped)."""
        for full in self.full_grads:
            if full is not None:
                full.zero_()
        for index, shard in enumerate(self.grad_shards):
            if shard is not None and self.stage == 2:
                shard.zero_()
            elif self.stage < 2:
                self.grad_shards[index] = None

    # --- hooks ------------------------------------------------------------
    def _attach_grad_views(self) -> None:
        if not self.keeps_full_grads:
            return
        for bucket, full in zip(self.buckets, self.full_grads):
            for position, param in enumerate(bucket.params):
                view = bucket.param_view(position, full)
                if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                    if param.grad is not None:
                        view.add_(param.grad)
                    param.grad = view

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        bucket_index, position = self._where[id(param)]
        bucket = self.buckets[bucket_index]
        if self.keeps_full_grads:
            view = bucket.param_view(position, self.full_grads[bucket_index])
            if param.grad.data_ptr() != view.data_ptr():  # someone replaced .grad; fold it in
                view.add_(param.grad)
                param.grad = view
        else:
            if self._staging[bucket_index] is None:
                self._staging[bucket_index] = bucket.new_zeros()
            bucket.param_view(position, self._staging[bucket_index]).add_(param.grad)
            param.grad = None
        self._ready_count[bucket_index] += 1
        if not self._reduce_now:
            return
        while (self._next_launch < len(self.buckets)
               and self._ready_count[self._next_launch] == len(self.buckets[self._next_launch].params)):
            self._launch(self._next_launch)
            self._next_launch += 1

    # --- reduction --------------------------------------------------------
    def _launch(self, bucket_index: int) -> None:
        bucket = self.buckets[bucket_index]
        if self.keeps_full_grads:
            source = self.full_grads[bucket_index]
        else:
            source = self._staging[bucket_index]
            if source is None:  # no gradient reached this bucket in this backward
                source = bucket.new_zeros()
            self._staging[bucket_index] = None
        if self.reduce_dtype is not None and source.dtype != self.reduce_dtype:
            source = source.to(self.reduce_dtype)
        if self.comm.size > 1:
            source.div_(self.comm.size)
        if self.stage == 0:
            handle = self.comm.all_reduce(source, async_op=True)
            reduced = source
        elif self.quantized_reducers:  # qgZ: quantized all-to-all reduce (+ LoCo)
            reduced, handle = self.quantized_reducers[bucket_index](source)
        else:
            reduced = torch.empty(bucket.shard_numel, dtype=source.dtype, device=source.device)
            handle = self.comm.reduce_scatter(reduced, source, async_op=True)
        # Keep `source` alive until the collective is done.
        self._pending.append((bucket_index, handle, reduced if self.stage > 0 else source))
        self._drain(keep=1)

    def _drain(self, keep: int) -> None:
        """Finish all but the newest `keep` collectives in flight, oldest first."""
        while len(self._pending) > keep:
            bucket_index, handle, reduced = self._pending.pop(0)
            handle.wait()
            self._store_reduced(bucket_index, reduced)
            if self._boundary:
                for callback in self.shard_ready_callbacks:
                    callback(bucket_index)

    def _store_reduced(self, bucket_index: int, reduced: torch.Tensor) -> None:
        if self.stage == 2:
            shard = self.grad_shards[bucket_index]
            if shard is None:
                self.grad_shards[bucket_index] = reduced.float() if reduced.dtype != torch.float32 else reduced
            else:
                shard.add_(reduced)
            return
        if self.stage == 0 and reduced is not self.full_grads[bucket_index]:
            self.full_grads[bucket_index].copy_(reduced)  # reduced in another dtype
            reduced = self.full_grads[bucket_index]
        self.grad_shards[bucket_index] = reduced.float() if reduced.dtype != torch.float32 else reduced

    # --- qgZ / LoCo ---------------------------------------------------------
    def set_gradient_quantization(self, quantization: Optional[GradQuantization]) -> None:
        """Switch gradient compression on (or off with None) for stages 1-3; drops any LoCo error."""
        self.quantization = quantization
        self.quantized_reducers = []
        if quantization is None or self.stage == 0 or self.comm.size == 1:
            return
        self.quantized_reducers = [
            QuantizedReduceScatter(self.comm, bucket.shard_numel, bits=quantization.bits,
                                   block_size=quantization.block_size, loco_beta=quantization.loco_beta,
                                   hierarchy=quantization.hierarchy)
            for bucket in self.buckets]

    @property
    def loco_enabled(self) -> bool:
        return bool(self.quantized_reducers) and self.quantization.loco_beta is not None

    def after_optimizer_step(self, overflow: bool, scale_before: float, scale_after: float) -> None:
        """The engine's report of one optimizer step (taken or skipped): LoCo's error buffers are
        dropped on an overflow, rescaled when the loss scale changed, and zeroed every reset_T steps."""
        self.optimizer_steps += 1
        if not self.loco_enabled:
            return
        for reducer in self.quantized_reducers:
            if overflow:
                reducer.reset_error()
            elif scale_after != scale_before:
                reducer.rescale_error(scale_after / scale_before)
            if self.optimizer_steps % self.quantization.reset_T == 0:
                reducer.reset_error()

    def loco_state(self) -> dict:
        """This rank's LoCo error buffers (CPU tensors) and step count, for a checkpoint.

        Per-rank state: it only loads back on the same data-parallel layout (see load_loco_state)."""
        return {
            "optimizer_steps": self.optimizer_steps,
            "layout": self._loco_layout(),
            "buffers": [[feedback.state_dict() for feedback in reducer.feedbacks] for reducer in self.quantized_reducers],
        }

    def load_loco_state(self, state: dict) -> bool:
        """Restore what loco_state() returned. On another layout (world size, buckets, hops) the
        error buffers start from zero with a warning (the step count is still restored); returns
        whether the buffers were loaded."""
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        if not self.loco_enabled:
            return False
        if state.get("layout") != self._loco_layout():
            warnings.warn("LoCo error buffers were saved on another layout; they restart from zero")
            for reducer in self.quantized_reducers:
                reducer.reset_error()
            return False
        device = self.buckets[0].device if self.buckets else None
        for reducer, saved in zip(self.quantized_reducers, state["buffers"]):
            for feedback, entry in zip(reducer.feedbacks, saved):
                feedback.load_state_dict(entry, device)
        return True

    def _loco_layout(self) -> dict:
        return {"world": self.comm.size, "rank": self.comm.rank,
                "shards": [bucket.shard_numel for bucket in self.buckets],
                "hops": [[hop.rows, hop.cols] for hop in self.quantized_reducers[0].hops] if self.quantized_reducers else [],
                "loco": self.loco_enabled}

    def loco_bytes(self) -> int:
        """Bytes of LoCo error buffers this rank holds (8-bit values plus block scales)."""
        return sum(feedback.nbytes for reducer in self.quantized_reducers for feedback in reducer.feedbacks)

    # --- accounting -------------------------------------------------------
    def held_bytes(self) -> int:
        """Bytes of gradient memory this rank holds between steps (LoCo error buffers included)."""
        total = self.loco_bytes()
        for full in self.full_grads:
            if full is not None:
                total += full.numel() * full.element_size()
        if self.stage == 2:
            total += sum(b.shard_numel * 4 for b in self.buckets)
        return total
