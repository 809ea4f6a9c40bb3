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
reduced result is the mean. Expert-local buckets (experts split over the ranks,
`zerotrain.parallel.experts`) are divided by the data-parallel size too, but reduced
only over their expert-data-parallel group (the ranks holding the same experts; their
gradient already holds every token of the expert-parallel group routed to them):
all-reduced at stage 0, reduce-scattered over that group at stages 1-2, not reduced
at all when the group is one rank. Buckets are launched strictly in index order on
every rank, whatever order the hooks fire in, so collectives always match.

With `zero_quantized_gradients` (qgZ, stages 1-3) each reduce-scatter becomes the
quantized all-to-all reduce of `zerotrain.comm.compressed` (int4, one or two hops;
split experts' buckets over their expert-data-parallel group, one hop), optionally with
LoCo error feedback per bucket; the engine reports each optimizer
step (`after_optimizer_step`) so the error buffers are reset every `reset_T` steps,
dropped on an fp16 overflow and rescaled when the loss scale changes.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from ..comm import Comm, Completed
from ..comm.compressed import QuantizedReduceScatter
from ..comm.quant import DEFAULT_BLOCK
from .flat import FlatBucket
from .interfaces import GradientReducer


@dataclass
class GradQuantization:
    """How qgZ compresses gradients: bits, block size, LoCo (beta None: no error feedback),
    and the (intra-node, inter-node) Comms of a two-hop reduce (None: one hop)."""

    bits: int = 4
    block_size: int = DEFAULT_BLOCK
    loco_beta: Optional[float] = None
    reset_T: int = 1024
    hierarchy: Optional[tuple[Comm, Comm]] = None


class GradReducer(GradientReducer):
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
        # stage 2: which parameters of a staging bucket hold a gradient yet, the staging buffers
        # whose reduction finished (reused by later buckets of the same backward, then freed),
        # and the fp32 shard storage kept across steps (reduced into directly after zero()).
        self._written: list[Optional[list[bool]]] = [None] * len(buckets)
        self._spare_staging: list[torch.Tensor] = []
        self._shard_storage: list[Optional[torch.Tensor]] = [None] * len(buckets)
        self._pending: list[tuple[int, object, Optional[torch.Tensor], Optional[torch.Tensor]]] = []
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
        self._spare_staging = []
        self._reduce_now = False

    def zero(self) -> None:
        """Forget all gradients (after a step, or when a step is skipped)."""
        for full in self.full_grads:
            if full is not None:
                full.zero_()
        # Stage 2 keeps each shard's storage; the next reduction overwrites it instead of adding.
        self.grad_shards = [None] * len(self.buckets)

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
            self._stage(bucket_index, position, param.grad)
            param.grad = None
        self._ready_count[bucket_index] += 1
        if not self._reduce_now:
            return
        while (self._next_launch < len(self.buckets)
               and self._ready_count[self._next_launch] == len(self.buckets[self._next_launch].params)):
            self._launch(self._next_launch)
            self._next_launch += 1

    # --- stage 2 staging --------------------------------------------------
    def _predivides(self, bucket: FlatBucket) -> bool:
        """Stage 2 divides by the world size while staging (one pass less) when it reduces in the
        training dtype; in another reduce dtype it divides after the cast, as stages 0-1 do."""
        return self.comm.size > 1 and self.reduce_dtype in (None, bucket.dtype)

    def _stage(self, bucket_index: int, position: int, grad: torch.Tensor) -> None:
        """Put one gradient into its bucket's staging buffer (written, not accumulated, the first time)."""
        bucket = self.buckets[bucket_index]
        staging = self._staging[bucket_index]
        if staging is None:
            staging = self._staging[bucket_index] = self._take_staging(bucket)
            self._written[bucket_index] = [False] * len(bucket.params)
        view = bucket.param_view(position, staging)
        divisor = self.comm.size if self._predivides(bucket) else 1
        if self._written[bucket_index][position]:  # a second gradient in one backward
            view.add_(grad / divisor if divisor > 1 else grad)
        elif divisor > 1:
            torch.div(grad, divisor, out=view)
        else:
            view.copy_(grad)
        self._written[bucket_index][position] = True

    def _take_staging(self, bucket: FlatBucket) -> torch.Tensor:
        """A staging buffer for `bucket`: a finished one of this backward if one fits, else a new one;
        only its padding is zeroed (every parameter's slice is written, or zeroed at launch)."""
        for index, spare in enumerate(self._spare_staging):
            if spare.dtype == bucket.dtype and spare.numel() >= bucket.padded_numel:
                staging = self._spare_staging.pop(index)[:bucket.padded_numel]
                break
        else:
            staging = torch.empty(bucket.padded_numel, dtype=bucket.dtype, device=bucket.device)
        staging[bucket.numel:].zero_()
        return staging

    def _finish_staging(self, bucket_index: int) -> torch.Tensor:
        """The bucket's staging buffer, ready to reduce: slices no gradient reached are zeroed."""
        bucket = self.buckets[bucket_index]
        staging = self._staging[bucket_index]
        self._staging[bucket_index] = None
        if staging is None:  # no gradient reached this bucket in this backward
            return bucket.new_zeros()
        for position, written in enumerate(self._written[bucket_index]):
            if not written:
                bucket.param_view(position, staging).zero_()
        return staging

    def _divides_shard(self, dtype: torch.dtype) -> bool:
        """Stage 1 divides the reduced shard by the world size, not the full buffer before (1/N of
        the work); not in fp16, whose sum could overflow, nor under qgZ, which quantizes the mean."""
        return self.stage == 1 and self.comm.size > 1 and not self.quantized_reducers and dtype != torch.float16

    # --- reduction --------------------------------------------------------
    def _launch(self, bucket_index: int) -> None:
        bucket = self.buckets[bucket_index]
        staging = None
        if self.keeps_full_grads:
            source = self.full_grads[bucket_index]
        else:
            source = staging = self._finish_staging(bucket_index)
        if self.reduce_dtype is not None and source.dtype != self.reduce_dtype:
            source = source.to(self.reduce_dtype)
        expert = bucket.group.expert
        comm = bucket.group.comm  # experts: their expert-data-parallel group
        if expert:  # divided by the data-parallel size, before the sum over the expert replicas
            if self.comm.size > 1 and (self.keeps_full_grads or not self._predivides(bucket)):
                source.div_(self.comm.size)
            if comm.size == 1:
                self._keep_local(bucket_index, source, staging)
                return
        elif self.comm.size > 1 and not self._divides_shard(source.dtype) and (
                self.keeps_full_grads or not self._predivides(bucket)):
            source.div_(self.comm.size)
        if self.stage == 0:
            handle = comm.all_reduce(source, async_op=True)
            reduced = source
        elif self.quantized_reducers:  # qgZ: quantized all-to-all reduce (+ LoCo), experts over their group
            reduced, handle = self.quantized_reducers[bucket_index](source)
        else:
            storage = self._shard_storage[bucket_index] if self.stage == 2 else None
            if storage is not None and self.grad_shards[bucket_index] is None and storage.dtype == source.dtype:
                reduced = storage  # first reduction since zero(): straight into the kept shard
            else:
                reduced = torch.empty(bucket.shard_numel, dtype=source.dtype, device=source.device)
            handle = comm.reduce_scatter(reduced, source, async_op=True)
        # Keep `source` alive until the collective is done; the staging buffer is reused after it.
        self._pending.append((bucket_index, handle, reduced if self.stage > 0 else source, staging))
        self._drain(keep=1)

    def _keep_local(self, bucket_index: int, source: torch.Tensor, staging: Optional[torch.Tensor]) -> None:
        """An expert-local bucket no other rank holds (ep_size == dp size): its gradient, already divided
        by the data-parallel size, holds every rank's tokens routed to this rank's experts, so it is not
        reduced. Queued like a collective so shards still become final in bucket order."""
        reduced = source
        if self.stage == 2:  # the staging buffer is reused: keep the result in the bucket's shard storage
            storage = self._shard_storage[bucket_index]
            if storage is not None and self.grad_shards[bucket_index] is None and storage.dtype == source.dtype:
                reduced = storage.copy_(source)
            else:
                reduced = source.clone()
        self._pending.append((bucket_index, Completed(), reduced, staging))  # no collective to wait for
        self._drain(keep=1)

    def _drain(self, keep: int) -> None:
        """Finish all but the newest `keep` collectives in flight, oldest first."""
        while len(self._pending) > keep:
            bucket_index, handle, reduced, staging = self._pending.pop(0)
            handle.wait()
            if staging is not None:
                self._spare_staging.append(staging)
            self._store_reduced(bucket_index, reduced)
            if self._boundary:
                for callback in self.shard_ready_callbacks:
                    callback(bucket_index)

    def _store_reduced(self, bucket_index: int, reduced: torch.Tensor) -> None:
        if self.stage == 2:
            shard = self.grad_shards[bucket_index]
            if shard is not None:
                shard.add_(reduced)
                return
            storage = self._shard_storage[bucket_index]
            if storage is None:
                storage = self._shard_storage[bucket_index] = (
                    reduced.float() if reduced.dtype != torch.float32 else reduced)
            elif reduced is not storage:
                storage.copy_(reduced)
            self.grad_shards[bucket_index] = storage
            return
        if self.stage == 0 and reduced is not self.full_grads[bucket_index]:
            self.full_grads[bucket_index].copy_(reduced)  # reduced in another dtype
            reduced = self.full_grads[bucket_index]
        if self._divides_shard(reduced.dtype) and not self.buckets[bucket_index].group.expert:
            reduced.div_(self.comm.size)
        self.grad_shards[bucket_index] = reduced.float() if reduced.dtype != torch.float32 else reduced

    # --- qgZ / LoCo ---------------------------------------------------------
    def set_gradient_quantization(self, quantization: Optional[GradQuantization]) -> None:
        """Switch gradient compression on (or off with None) for stages 1-3; drops any LoCo error."""
        self.quantization = quantization
        self.quantized_reducers = []
        if quantization is None or self.stage == 0 or self.comm.size == 1:
            return
        self.quantized_reducers = [self._quantized_reducer(bucket, quantization) for bucket in self.buckets]

    def _quantized_reducer(self, bucket: FlatBucket,
                           quantization: GradQuantization) -> Optional[QuantizedReduceScatter]:
        """qgZ's reducer of one bucket: over the data-parallel ranks (two hops across nodes), or for split
        experts over their expert-data-parallel group in one hop (None where that group is this rank alone)."""
        comm = bucket.group.comm
        if comm.size == 1:
            return None
        hierarchy = quantization.hierarchy if comm is self.comm else None
        return QuantizedReduceScatter(comm, bucket.shard_numel, bits=quantization.bits,
                                      block_size=quantization.block_size, loco_beta=quantization.loco_beta,
                                      hierarchy=hierarchy)

    @property
    def loco_enabled(self) -> bool:
        return bool(self.quantized_reducers) and self.quantization.loco_beta is not None

    def after_optimizer_step(self, overflow: bool, scale_before: float, scale_after: float) -> None:
        """The engine's report of one optimizer step (taken or skipped): LoCo's error buffers are
        dropped on an overflow, rescaled when the loss scale changed, and zeroed every reset_T steps."""
        self.optimizer_steps += 1
        if not self.loco_enabled:
            return
        for reducer in self._reducers():
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
            "buffers": [[feedback.state_dict() for feedback in reducer.feedbacks] if reducer is not None else []
                        for reducer in self.quantized_reducers],
        }

    def load_loco_state(self, state: dict) -> bool:
        """Restore what loco_state() returned. On another layout (world size, buckets, hops, expert groups) the
        error buffers start from zero with a warning (the step count is still restored); returns
        whether the buffers were loaded."""
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        if not self.loco_enabled:
            return False
        layout, current = state.get("layout"), self._loco_layout()
        if isinstance(layout, dict):  # saved before "expert_partitions" existed: no experts then
            layout = {"expert_partitions": [], **layout}
        if layout != current:
            warnings.warn(f"LoCo error buffers of rank {self.comm.rank} were saved on another layout "
                          f"({state.get('layout')} vs {current}); they restart from zero")
            self.reset_loco_state()
            return False
        device = self.buckets[0].device if self.buckets else None
        for reducer, saved in zip(self.quantized_reducers, state["buffers"]):
            for feedback, entry in zip(reducer.feedbacks if reducer is not None else [], saved):
                feedback.load_state_dict(entry, device)
        return True

    def reset_loco_state(self) -> None:
        """Zero every LoCo error buffer (the step count is kept)."""
        for reducer in self._reducers():
            reducer.reset_error()

    def _loco_layout(self) -> dict:
        return {"world": self.comm.size, "rank": self.comm.rank,
                "shards": [bucket.shard_numel for bucket in self.buckets],
                "hops": [[hop.rows, hop.cols] for reducer in self._reducers()[:1] for hop in reducer.hops],
                "loco": self.loco_enabled,
                # expert buckets: how many ranks share each one's reduction (the expert-data-parallel group)
                "expert_partitions": [bucket.partitions for bucket in self.buckets
                                      if bucket.group.expert]}

    def loco_bytes(self) -> int:
        """Bytes of LoCo error buffers this rank holds (8-bit values plus block scales)."""
        return sum(feedback.nbytes for reducer in self._reducers() for feedback in reducer.feedbacks)

    def _reducers(self) -> list[QuantizedReduceScatter]:
        """The quantized reducers there are (an expert bucket no other rank holds has none)."""
        return [reducer for reducer in self.quantized_reducers if reducer is not None]

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
