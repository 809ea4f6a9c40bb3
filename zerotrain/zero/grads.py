"""Gradient reducers, overlapped with backward, by what they keep and when they reduce.

Every reducer turns the gradients of one backward into this rank's reduced fp32 gradient shards
(`grad_shards`), bucket by bucket, through a :class:`~zerotrain.zero.interfaces.BucketReduce` it is
given (`zero.reduce`: exact, or qgZ with LoCo error feedback). What they share lives once, in
:class:`BucketReducer`: a hook per parameter; a bucket is launched as soon as every one of its
parameters has a gradient, strictly in bucket order on every rank whatever order the hooks fire in
(so collectives always match), buckets whose parameters got no gradient at the end of backward; at
most `max_in_flight` reductions in flight, finished oldest first; a finished staging buffer reused by
a later bucket of the same backward (:class:`StagingPool`); shards reported final in order.

- :class:`FullBufferReducer` (stages 0-1): a full gradient buffer per bucket in the training dtype (the
  parameters' `.grad` are views of it), accumulated over micro-steps and reduced once at the
  accumulation boundary: all-reduced (every rank keeps the whole mean, stage 0), or reduce-scattered
  (each keeps its shard, stage 1).
- :class:`PartitionedReducer` (stage 2): no full buffer. Every micro-step each gradient is copied into
  a transient staging bucket, reduce-scattered, and added into this rank's fp32 gradient shard; the
  full gradient is freed at once.
- `zero.stage3.grads.Stage3GradReducer`: stage 3's per-parameter shards packed rank-major into
  reduce buckets.

Gradients are divided by the data-parallel size before the reduction, so the reduced result is the
mean (an exact stage-1 reduce-scatter divides the shard after it instead: 1/N of the work). Split
experts (`zerotrain.parallel.experts`) are divided by the data-parallel size too, but reduced only
over their expert-data-parallel group (their bucket's `ShardGroup`: the ranks holding the same
experts, whose gradient already holds every token of the expert-parallel group routed to them), not
reduced at all when that group is one rank.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..comm import Completed, Comm
from .flat import FlatBucket, ShardLayout
from .interfaces import BucketReduce, GradientReducer
from .param_hooks import weak_hook
from .reduce import ExactReduce

__all__ = ["BucketReducer", "StagingPool", "FullBufferReducer", "PartitionedReducer"]


class StagingPool:
    """Staging buffers of one backward: a buffer whose reduction finished is kept as a spare for the next
    bucket that fits in it, and the spares are dropped at the end of backward. A fresh 80 MB buffer costs
    ~20k page faults on first touch, about 4x the time of the copy itself on a CPU run, so a backward of
    B buckets allocates about 2 buffers, not B. Counts the staging bytes alive into `stats`."""

    def __init__(self, stats: dict):
        self.stats = stats
        self.spares: list[torch.Tensor] = []
        stats.setdefault("peak_held_bytes", 0)  # staging in use plus the spares kept: what the pool holds at most

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A staging buffer of `numel` elements: the head of a spare that fits, else a new one (uninitialized).
        A new one replaces the spares that did not fit: buckets of a backward come in like sizes, so a spare
        too small for this one would mostly wait, unused, until the end of backward (three of them, 338 MiB,
        on a 0.24B GPT whose buckets differ by a few thousand elements: benchmarks/RESULTS_scale.md)."""
        for index, spare in enumerate(self.spares):
            if spare.numel() >= numel and spare.dtype == dtype and spare.device == device:
                buffer = self.spares.pop(index)
                self.count(buffer.numel() * buffer.element_size())
                self.stats["staging_reused"] += 1
                return buffer[:numel]
        self.spares.clear()
        buffer = torch.empty(numel, dtype=dtype, device=device)
        self.count(buffer.numel() * buffer.element_size())
        return buffer

    def release(self, staging: torch.Tensor, reuse: bool) -> None:
        """A staging buffer's reduction finished: keep it (whole) for later buckets when it is ours to reuse."""
        whole = self.whole(staging)  # a reused spare counts whole
        self.count(-whole.numel() * whole.element_size())  # (moved to the spares: no new peak of what is held)
        if reuse:
            self.spares.append(whole)

    @staticmethod
    def whole(staging: torch.Tensor) -> torch.Tensor:
        """The whole buffer a staging tensor is (a reused spare's head is a view of it)."""
        return staging if staging._base is None else staging._base

    def clear(self) -> None:
        self.spares.clear()

    def _spare_bytes(self) -> int:
        return sum(spare.numel() * spare.element_size() for spare in self.spares)

    def count(self, nbytes: int) -> None:
        """`nbytes` more (or fewer) staging bytes in use (the spares as they are now count in the held peak)."""
        self.stats["staging_bytes"] += nbytes
        self.stats["peak_staging_bytes"] = max(self.stats["peak_staging_bytes"], self.stats["staging_bytes"])
        held = self.stats["staging_bytes"] + self._spare_bytes()
        self.stats["peak_held_bytes"] = max(self.stats["peak_held_bytes"], held)


class BucketReducer(GradientReducer):
    """What every reducer shares: hooks, in-order launches, the queue of reductions in flight, staging reuse,
    the LoCo pass-through to its reduce. Subclasses say what a gradient does on arrival (`_accept`), what a
    launch reduces (`_launch`), and where a reduced shard goes (`_store`).

    `buckets` are what is launched (anything with `group` and `shard_numel`, bound to `reduce`);
    `members[i]` the parameters of bucket i, whose gradients it waits for.
    """

    reduces_every_micro_step = True  # False: gradients accumulate until the boundary, reduced only then

    def __init__(self, buckets: Sequence, members: Sequence[Sequence[torch.nn.Parameter]], comm: Comm,
                 reduce: Optional[BucketReduce] = None, max_in_flight: int = 1):
        self.buckets = buckets
        self.comm = comm  # the data-parallel Comm (gradients are divided by its size)
        self.max_in_flight = max_in_flight
        self.shard_ready_callbacks: list = []  # called with a shard index once it is final for this step
        self.optimizer_steps = 0  # counted for LoCo's reset_T
        self.stats = {"staging_bytes": 0, "peak_staging_bytes": 0, "staging_reused": 0}
        self._pool = StagingPool(self.stats)
        self._sizes = [len(params) for params in members]
        self._arrived: list[set[int]] = [set() for _ in buckets]  # positions with a gradient in this backward
        # (bucket index, handle, reduced, staging buffer or None, whether the staging buffer may be reused)
        self._pending: list[tuple[int, object, torch.Tensor, Optional[torch.Tensor], bool]] = []
        self._next_launch = 0
        self._reduce_now = self.reduces_every_micro_step
        self._boundary = False
        self._where: dict[int, tuple[int, int]] = {}
        for index, params in enumerate(members):
            for position, param in enumerate(params):
                self._where[id(param)] = (index, position)
                param.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready))
        self.reduce: BucketReduce
        self.set_reduce(ExactReduce() if reduce is None else reduce)

    def set_reduce(self, reduce: BucketReduce) -> None:
        """Reduce with `reduce` from now on (exact, or qgZ with fresh LoCo error buffers)."""
        self._check_reduce(reduce)
        reduce.bind(self.buckets)
        self.reduce = reduce

    def _check_reduce(self, reduce: BucketReduce) -> None:
        """Refuse a reduce this reducer cannot use; any by default."""

    # --- per micro-step ---------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        """Arm the hooks for one backward; reduce during it if this is the boundary (or every micro-step)."""
        self._reduce_now = boundary or self.reduces_every_micro_step
        self._boundary = boundary
        self._next_launch = 0
        for arrived in self._arrived:
            arrived.clear()
        self._before_backward()

    def end_backward(self) -> None:
        """Launch the buckets still waiting (parameters without a gradient count as zero), then wait for all."""
        if self._reduce_now:
            while self._next_launch < len(self.buckets):
                self._launch_next()
        self._drain(keep=0)
        self._pool.clear()
        self._reduce_now = self.reduces_every_micro_step

    def _before_backward(self) -> None:
        """Anything to set up before a backward; nothing by default."""

    # --- hooks ------------------------------------------------------------
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        index, position = self._where[id(param)]
        if index < self._next_launch:
            raise RuntimeError(f"gradient of {self._param_name(index, position)} arrived after its bucket was "
                               "reduced (a second backward through it in one micro-step?)")
        self._accept(index, position, param)
        self._arrived[index].add(position)
        if not self._reduce_now:
            return
        while (self._next_launch < len(self.buckets)
               and len(self._arrived[self._next_launch]) == self._sizes[self._next_launch]):
            self._launch_next()

    def _param_name(self, index: int, position: int) -> str:
        return self.buckets[index].names[position]

    def _accept(self, index: int, position: int, param: torch.nn.Parameter) -> None:
        """Take parameter `position` of bucket `index`'s gradient (`param.grad`), before it counts as arrived."""
        raise NotImplementedError

    # --- reduction --------------------------------------------------------
    def _launch_next(self) -> None:
        index = self._next_launch
        self._next_launch = index + 1
        self._pending.append(self._launch(index))
        self._drain(keep=self.max_in_flight)

    def _launch(self, index: int) -> tuple[int, object, torch.Tensor, Optional[torch.Tensor], bool]:
        """Start reducing bucket `index`: (index, handle, reduced, staging buffer or None, reusable)."""
        raise NotImplementedError

    def _drain(self, keep: int) -> None:
        """Finish all but the newest `keep` reductions in flight, oldest first."""
        while len(self._pending) > keep:
            index, handle, reduced, staging, reuse = self._pending.pop(0)
            handle.wait()
            if staging is not None:
                self._pool.release(staging, reuse and self._spare_wanted(staging))
            del staging  # an adopted gradient is freed before the shard is stored
            self._store(index, reduced)
            if self._boundary:
                self._shard_final(index)

    def _store(self, index: int, reduced: torch.Tensor) -> None:
        raise NotImplementedError

    def _spare_wanted(self, staging: torch.Tensor) -> bool:
        """Whether a finished staging buffer may still serve a later bucket of this backward (kept as a spare
        until the end of backward otherwise); yes by default."""
        return True

    def _shard_final(self, index: int) -> None:
        """Bucket `index`'s shard is final for this step: tell the callbacks (one shard per bucket by default)."""
        for callback in self.shard_ready_callbacks:
            callback(index)

    # --- the engine's optimizer-step report and LoCo's state, from the reduce --------
    @property
    def loco_enabled(self) -> bool:
        return self.reduce.loco_enabled

    def after_optimizer_step(self, overflow: bool, scale_before: float, scale_after: float) -> None:
        """The engine's report of one optimizer step (taken or skipped): counted, and passed to the reduce
        (LoCo's error buffers are dropped on an overflow, rescaled when the loss scale changed, and
        zeroed every reset_T steps)."""
        self.optimizer_steps += 1
        self.reduce.loco_after_step(overflow, scale_before, scale_after, self.optimizer_steps)

    def loco_state(self) -> dict:
        """This rank's LoCo error buffers (CPU tensors), their layout and the step count, for a checkpoint.
        Per-rank state: it only loads back on the same data-parallel layout (see load_loco_state)."""
        return {"optimizer_steps": self.optimizer_steps, **self.reduce.loco_state()}

    def load_loco_state(self, state: dict) -> bool:
        """Restore what loco_state() returned. On another layout (world size, buckets, hops, expert groups) the
        error buffers start from zero with a warning (the step count is still restored); returns whether
        the buffers were loaded."""
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        return self.reduce.load_loco_state(state)

    def reset_loco_state(self) -> None:
        """Zero every LoCo error buffer (the step count is kept)."""
        self.reduce.reset_loco_state()

    def loco_bytes(self) -> int:
        """Bytes of LoCo error buffers this rank holds (8-bit values plus block scales)."""
        return self.reduce.loco_bytes()

    # --- accounting -------------------------------------------------------
    def held_bytes(self) -> int:
        """Bytes of gradient memory this rank holds between steps (LoCo error buffers included)."""
        return self.loco_bytes() + self._gradient_bytes()

    def _gradient_bytes(self) -> int:
        raise NotImplementedError

    def held_tensors(self) -> list[torch.Tensor]:
        """The gradient tensors this reducer keeps alive now (shards, buffers, staging, spares): for measuring
        what held_bytes() accounts for."""
        return [shard for shard in self.grad_shards if shard is not None] + list(self._pool.spares)


class FullBufferReducer(BucketReducer):
    """Stages 0-1: a full gradient buffer per bucket (the parameters' `.grad` are views of it) accumulated
    over micro-steps and reduced at the accumulation boundary: all-reduced when not `sharded` (every rank
    keeps the whole reduced gradient: stage 0), else reduce-scattered (each keeps its shard: stage 1).
    `reduce_dtype`: the dtype to reduce in (default: the bucket's)."""

    reduces_every_micro_step = False

    def __init__(self, buckets: list[FlatBucket], comm: Comm, reduce: Optional[BucketReduce] = None, *,
                 sharded: bool, reduce_dtype: Optional[torch.dtype] = None):
        self.sharded = sharded
        self.reduce_dtype = reduce_dtype
        # full gradient buffers in the training dtype; params' .grad are views
        self.full_grads: list[torch.Tensor] = [torch.zeros_like(bucket.flat_param) for bucket in buckets]
        # The reduced gradient this rank owns, fp32 (not sharded: the whole bucket).
        self.grad_shards: list[Optional[torch.Tensor]] = [None] * len(buckets)
        super().__init__(buckets, [bucket.params for bucket in buckets], comm, reduce)
        self._attach_grad_views()

    def _check_reduce(self, reduce: BucketReduce) -> None:
        if not self.sharded and not reduce.exact:
            raise ValueError("qgZ quantizes reduce-scatters: a replicated gradient buffer (ZeRO stage 0) is "
                             "all-reduced exactly")

    def zero(self) -> None:
        """Forget all gradients (after a step, or when a step is skipped)."""
        for full in self.full_grads:
            full.zero_()
        self.grad_shards = [None] * len(self.buckets)

    def _before_backward(self) -> None:
        self._attach_grad_views()

    def _attach_grad_views(self) -> None:
        for bucket, full in zip(self.buckets, self.full_grads):
            for position, param in enumerate(bucket.params):
                view = bucket.param_view(position, full)
                if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                    if param.grad is not None:
                        view.add_(param.grad)
                    param.grad = view

    def _accept(self, index: int, position: int, param: torch.nn.Parameter) -> None:
        view = self.buckets[index].param_view(position, self.full_grads[index])
        if param.grad.data_ptr() != view.data_ptr():  # someone replaced .grad; fold it in
            view.add_(param.grad)
            param.grad = view

    def _divides_shard(self, dtype: torch.dtype) -> bool:
        """A sharded exact reduce divides the reduced shard by the world size, not the full buffer before (1/N
        of the work); not in fp16, whose sum could overflow, nor under qgZ, which quantizes the mean."""
        return self.sharded and self.comm.size > 1 and self.reduce.exact and dtype != torch.float16

    def _launch(self, index: int):
        bucket = self.buckets[index]
        source = self.full_grads[index]
        if self.reduce_dtype is not None and source.dtype != self.reduce_dtype:
            source = source.to(self.reduce_dtype)
        group = bucket.group  # experts: their expert-data-parallel group
        if group.expert:  # divided by the data-parallel size, before the sum over the expert replicas
            if self.comm.size > 1:
                source.div_(self.comm.size)
            if group.comm.size == 1:  # no other rank holds these experts: nothing to reduce
                return index, Completed(), source, None, False
        elif self.comm.size > 1 and not self._divides_shard(source.dtype):
            source.div_(self.comm.size)
        if self.sharded:
            reduced, handle = self.reduce.reduce_scatter(index, source)
        else:
            handle, reduced = self.reduce.all_reduce(index, source), source
        return index, handle, reduced, None, False

    def _store(self, index: int, reduced: torch.Tensor) -> None:
        full = self.full_grads[index]
        if not self.sharded and reduced is not full:
            full.copy_(reduced)  # reduced in another dtype
            reduced = full
        if self._divides_shard(reduced.dtype) and not self.buckets[index].group.expert:
            reduced.div_(self.comm.size)
        self.grad_shards[index] = reduced.float() if reduced.dtype != torch.float32 else reduced

    def _gradient_bytes(self) -> int:
        """The full buffers, and the reduced fp32 gradients from the accumulation boundary to the step where they
        are tensors of their own (a shard, or the fp32 cast of a bf16/fp16 buffer): what backward leaves held."""
        own = sum(shard.numel() * shard.element_size() for shard, full in zip(self.grad_shards, self.full_grads)
                  if shard is not None and shard.untyped_storage().data_ptr() != full.untyped_storage().data_ptr())
        return own + sum(full.numel() * full.element_size() for full in self.full_grads)

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.full_grads) + super().held_tensors()


class PartitionedReducer(BucketReducer):
    """Stage 2: no full gradient buffer. Every micro-step each gradient is staged into its bucket's transient
    buffer, the bucket is reduce-scattered as soon as it is complete, and the result is added into this rank's
    fp32 gradient shard (kept across steps, reduced into directly after zero()). `reduce_dtype`: the dtype to
    reduce in (default: the bucket's).

    Stage 3 under qgZ uses it too, each partitioned parameter its own bucket: qgZ quantizes each parameter's
    gradient on its own there, and its LoCo error buffers are per parameter (moving it onto stage 3's reduce
    buckets would change the quantization blocks)."""

    reduces_every_micro_step = True

    def __init__(self, buckets: list[ShardLayout], comm: Comm, reduce: Optional[BucketReduce] = None, *,
                 reduce_dtype: Optional[torch.dtype] = None):
        self.reduce_dtype = reduce_dtype
        self.grad_shards: list[Optional[torch.Tensor]] = [None] * len(buckets)
        self._staging: list[Optional[torch.Tensor]] = [None] * len(buckets)
        self._shard_storage: list[Optional[torch.Tensor]] = [None] * len(buckets)  # fp32, kept across steps
        super().__init__(buckets, [bucket.params for bucket in buckets], comm, reduce)

    def zero(self) -> None:
        """Forget all gradients; each shard's storage is kept, the next reduction overwrites it instead of adding."""
        self.grad_shards = [None] * len(self.buckets)

    # --- staging ----------------------------------------------------------
    def _predivides(self, bucket: ShardLayout) -> bool:
        """Divide by the world size while staging (one pass less) when reducing in the training dtype; in
        another reduce dtype divide after the cast, as the full-buffer reducer does."""
        return self.comm.size > 1 and self.reduce_dtype in (None, bucket.dtype)

    def _accept(self, index: int, position: int, param: torch.nn.Parameter) -> None:
        """Put the gradient into its bucket's staging buffer (written, not accumulated, the first time); the
        full gradient is dropped."""
        bucket = self.buckets[index]
        staging = self._staging[index]
        if staging is None:  # only its padding is zeroed: every parameter's slice is written, or zeroed at launch
            staging = self._staging[index] = self._pool.take(bucket.padded_numel, bucket.dtype, bucket.device)
            staging[bucket.numel:].zero_()
        view = bucket.param_view(position, staging)
        grad = param.grad
        divisor = self.comm.size if self._predivides(bucket) else 1
        if position in self._arrived[index]:  # a second gradient in one backward
            view.add_(grad / divisor if divisor > 1 else grad)
        elif divisor > 1:
            torch.div(grad, divisor, out=view)
        else:
            view.copy_(grad)
        param.grad = None

    def _finish_staging(self, index: int) -> torch.Tensor:
        """The bucket's staging buffer, ready to reduce: slices no gradient reached are zeroed."""
        bucket = self.buckets[index]
        staging = self._staging[index]
        self._staging[index] = None
        if staging is None:  # no gradient reached this bucket in this backward
            return bucket.new_zeros()
        arrived = self._arrived[index]
        if len(arrived) < len(bucket.params):
            for position in range(len(bucket.params)):
                if position not in arrived:
                    bucket.param_view(position, staging).zero_()
        return staging

    # --- reduction --------------------------------------------------------
    def _launch(self, index: int):
        bucket = self.buckets[index]
        source = staging = self._finish_staging(index)
        if self.reduce_dtype is not None and source.dtype != self.reduce_dtype:
            source = source.to(self.reduce_dtype)
        divide = self.comm.size > 1 and not self._predivides(bucket)
        if bucket.group.expert:  # divided by the data-parallel size, before the sum over the expert replicas
            if divide:
                source.div_(self.comm.size)
            if bucket.group.comm.size == 1:
                return self._keep_local(index, source, staging)
        elif divide:
            source.div_(self.comm.size)
        storage = self._shard_storage[index]
        kept = storage is not None and self.grad_shards[index] is None and storage.dtype == source.dtype
        # first reduction since zero(): straight into the kept shard (an exact reduce; qgZ has its own output)
        reduced, handle = self.reduce.reduce_scatter(index, source, storage if kept else None)
        return index, handle, reduced, staging, True

    def _keep_local(self, index: int, source: torch.Tensor, staging: torch.Tensor):
        """An expert-local bucket no other rank holds (ep_size == dp size): its gradient, already divided by the
        data-parallel size, holds every rank's tokens routed to this rank's experts, so it is not reduced.
        Queued like a collective so shards still become final in bucket order; the staging buffer is reused,
        so the result goes into the bucket's shard storage."""
        storage = self._shard_storage[index]
        if storage is not None and self.grad_shards[index] is None and storage.dtype == source.dtype:
            reduced = storage.copy_(source)
        else:
            reduced = source.clone()
        return index, Completed(), reduced, staging, True

    def _store(self, index: int, reduced: torch.Tensor) -> None:
        shard = self.grad_shards[index]
        if shard is not None:
            shard.add_(reduced)
            return
        storage = self._shard_storage[index]
        if storage is None:
            storage = self._shard_storage[index] = reduced.float() if reduced.dtype != torch.float32 else reduced
        elif reduced is not storage:
            storage.copy_(reduced)
        self.grad_shards[index] = storage

    # --- accounting -------------------------------------------------------
    def _gradient_bytes(self) -> int:
        return sum(bucket.shard_numel * 4 for bucket in self.buckets)

    def held_tensors(self) -> list[torch.Tensor]:
        return ([t for t in self._shard_storage + self._staging if t is not None]
                + super().held_tensors())
