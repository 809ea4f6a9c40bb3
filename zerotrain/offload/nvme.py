"""ZeRO-Infinity-style NVMe offload: fp32 masters and optimizer states in files, streamed through bounded buffers.

Each offloaded bucket's shard is cut into chunks of `chunk_numel` elements. A chunk's record
in the files holds its fp32 master and its per-element optimizer states (Adam's exp_avg and
exp_avg_sq, or whatever the torch optimizer keeps), each region aligned (`nvme_records.py`).
Host memory holds no per-parameter master or state between steps: `masters[i]` of an
offloaded bucket is a placeholder of the right shape that holds no memory (the optimizer's
groups and `optimizer.state` are keyed by it). Host memory for masters and states is the pool
of `buffer_count` aligned buffers (`aio.AlignedBuffers`), whatever the model size.

A step streams the chunks through the pool: the reads of the next records are in flight while
the current one is updated on the main thread (zerotrain's CPU Adam kernel, `cpu_adam.adam_step`,
where `CpuAdamStepper.supports()` the group; else the torch optimizer through `SubsetStepper`),
its new weights are cast into the model's shard in the same pass (the publish), and the writes
of the previous records go on behind it (`aio.AsyncFileIO`, O_DIRECT where the filesystem takes it).
The last `buffer_count - 1` records stay in their buffers after a committed step, and the next
step updates them first without reading them (`nvme_stream.py`).

A step never overwrites a current record: each chunk's new record goes to a free extent of the
swap file's ring of spares and becomes current at the commit, an index flip (`nvme_records.py`;
disk use is the records once plus a few spare records per size class, not a second copy). When
every write of the step has succeeded on every rank, the step commits: the index moves, the
scalar states (Adam's step count) are replaced. When any read or write fails, on any rank (one
all-reduce of a failure flag per rank after the step's I/O), every rank raises an
`aio.OffloadIOError` naming the failing ranks (a full disk says so), after all I/O in flight has
finished, and rolls back: the chunks not committed keep their records and the model shards of
those already updated are published again from them. A step whose chunks fit in the ring commits
nothing before that, so the training state is exactly as before the step. A larger step commits
chunks early, in order, when the ring of their size is used up; those chunks (and the step's
scalar states) are remembered, and the retried step — `step()` again: the gradients are kept —
skips them, so the run goes on exactly as if nothing had failed. Until that retry the model and
the records hold the early-committed chunks' new values (a checkpoint load clears it). The file is
allocated in full when the optimizer is built, so a disk too small fails at start-up with the sizes
in the message.

Gradients streamed (`stream_gradients`, chosen by `streams_gradients` below: stage 3, no clipping,
no loss scale or overflow check, no accumulation): each bucket is stepped as soon as the reducer has
its final gradient shard, during backward, and the reducer frees the shard, so host memory never holds
the whole model's gradients; the norm's terms are summed as they come (the same sum), and the step is
agreed and committed in `step()` as above. A failed streamed step is retried by running the batch's
forward and backward again (its gradients are gone); the chunks committed early are skipped.

Gradients spilled (`spill_gradients`, chosen by `spills_gradients`: the same conditions with clipping on,
DeepSpeed's default): the whole model's gradients must be known before the clip's multiplier is, so instead of
holding them in host memory until `step()` each final shard's norm terms are summed and the shard is written,
in its own dtype (lossless), on the same background thread, and the reducer frees it: into its parameter's own
extent in the NVMe parameter file where offload_param keeps the shard there (lent by the store, on the main
thread, until the step's publish writes the new values: no extra disk), else to a spill file beside the records
(`nvme_records.GradientSpill`). A failed step publishes every lent parameter again from the records. `step()` then streams the records as usual, each chunk's gradient
read back from the spill into its buffer's gradient region alongside its record, with the clipped multiplier:
the same chunks, the same arithmetic, the same bits as holding them. The last shards handed over whose spill the
thread has not started when `step()` comes (at most `_stream_budget` elements, already held) are not spilled:
`step()` cancels those writes and steps them from memory (`_keep_unspilled`: neither written nor read back, and
the norm does not wait for their writes). Why a spill rather than speculation or a first pass: see `GradientSpill`. Host memory for gradients (`grad_host_peak_bytes`): the handed-over shards not
yet written (bounded by `_stream_budget`, as streaming's) plus the spill's staging; held, every offloaded shard.

The norm from a first pass (`norm_first_pass`, chosen by `takes_norm_first`: where the spill would be used and the
parameters are on NVMe too, or `offload_optimizer.norm_first_pass: true`): the engine runs each step's backward
twice over one retained graph (`MasterOptimizer.takes_norm_first_pass`, `engine.core`). In the first pass the
reducer reduce-scatters every bucket as usual and each final shard only adds its squares (fp64, on the step thread)
to the norm and is freed: nothing is stepped, spilled or written. `end_norm_pass` reduces the global norm, which
fixes the clip's multiplier; the second pass is then exactly the streamed step above with that multiplier (each
final shard stepped during backward, overlapped with it as without clipping). The cost is one more backward: its
compute, one more reduce-scatter, and one more read of the parameter shards it gathers (2 B/param in bf16; fewer
where the recorded order keeps a parameter gathered from the first pass into the second), against the spill's write
and read of the gradient (2 B/param each way) and a step that waits for backward to end. Exact where backward is
deterministic (CPU, gloo): the second pass's gradients are the first's bit for bit, which `step()` checks from the
norm terms (`norm_pass_mismatches` counts steps where they differ, e.g. CUDA's atomics in an embedding's backward:
the clip is then the first pass's norm applied to the second pass's gradients, and the reported norm the first's).
A model whose graph cannot be backpropagated twice fails in the second pass with one line naming the key to set
(`norm_first_pass: false`: the spill). Stage 3's fetch record simply holds both passes' requests (the same every
step), so prefetch and reads ahead follow them, from the first pass's end into the second's start.

The streamed steps run on one background thread (`_worker`), in the order the gradients came: the main
thread hands each final shard over and goes on with backward, so the waits on record reads, the CPU
Adam kernel (ctypes: the GIL is released) and the writes behind overlap the backward's compute and
collectives instead of stopping it. The thread touches only the records and this optimizer's staging;
the new weights of an offload_param bucket (its store is not thread-safe, and the main thread's gathers
read it) are written to the store by the main thread, at its next hand-over or when the steps are
waited for (`_settle_streamed`: before `step()` agrees and commits, before the model is used again, and
before anything else reads the records). At most `_stream_budget` elements of handed-over gradients wait
for the thread (the main thread waits for the oldest beyond that): host memory stays bounded. The chunks
are stepped in the same order with the same arithmetic: the same bits.

Between steps `optimizer.state[master]` holds only the scalar states. `resident_states()` brings
masters and per-element states into host memory (checkpoint save and load run inside it) and
writes back whatever is there on exit; `resident_masters()` brings only the masters (read only,
for `engine.full_state_dict()`). Per-element states found in `optimizer.state` at the start of
a step (a checkpoint load that did not use `resident_states`) are written to disk first.
"""
from __future__ import annotations

import threading
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Collection, Optional

import torch

from .aio import OffloadIOError
from .cpu_adam import COPY_BACK_DTYPES, adam_step
from .cpu_optimizer import OffloadOptimizer
from .nvme_records import DEFAULT_CHUNK_NUMEL, Chunk, GradientSpill, NvmeRecords, master_placeholder
from .nvme_stream import NvmeStream
from .partial import SubsetStepper

__all__ = ["NvmeOffloadOptimizer", "DEFAULT_CHUNK_NUMEL", "streams_gradients", "spills_gradients", "takes_norm_first",
           "record_dtypes"]


def record_dtypes(config) -> dict[str, Optional[torch.dtype]]:
    """The dtypes the records store (`NvmeOffloadOptimizer`'s `master_dtype`, `state_dtype`; plain CPU offload's
    too, `bf16_host.py`): bf16 masters with `bf16.bf16_master_weights_and_grads`, bf16 fp32-states with
    `bf16.bf16_optimizer_states` (bf16 training)."""
    narrow = config.bf16_records
    return {"master_dtype": torch.bfloat16 if narrow else torch.float32,
            "state_dtype": torch.bfloat16 if narrow and config.bf16.bf16_optimizer_states else None}


def streams_gradients(config, frees_final_shards: bool) -> bool:
    """Whether NVMe offload steps each bucket as soon as its gradient shard is final, during backward, so
    that host memory never holds the whole model's gradients: only where nothing needs all of them before
    the update (no clipping, no fp16 loss scale, no bf16 overflow check, every bucket offloaded), the
    reducer can free a shard once consumed (`frees_final_shards`: its `can_free_final_shards`, stage 3),
    and no accumulation: with it the reducer holds the
    summed shards between micro-batches anyway, and a failed step could not be retried by running the one
    batch's forward/backward again (its gradients are gone once streamed)."""
    offload = config.zero_optimization.offload_optimizer
    return (not config.gradient_clipping and not config.fp16.enabled and float(offload.ratio) >= 1.0
            and config.gradient_accumulation_steps == 1
            and not (config.bf16.enabled and config.bf16.check_grad_overflow)
            and frees_final_shards)


def spills_gradients(config, frees_final_shards: bool) -> bool:
    """Whether NVMe offload spills each final gradient shard to disk during backward (`GradientSpill`) instead of
    holding the whole model's gradients in host memory until the clip's norm is known: where the gradients
    would be streamed (`streams_gradients`) but for clipping, which is on (DeepSpeed's default, 1.0)."""
    offload = config.zero_optimization.offload_optimizer
    return (bool(config.gradient_clipping) and not config.fp16.enabled and float(offload.ratio) >= 1.0
            and config.gradient_accumulation_steps == 1
            and not (config.bf16.enabled and config.bf16.check_grad_overflow)
            and frees_final_shards)


def takes_norm_first(config, frees_final_shards: bool, params_on_nvme: bool) -> bool:
    """Whether NVMe offload takes the clip's global norm from a first backward (over the retained graph) and then
    streams the clipped step during a second one, instead of spilling the gradients (`spills_gradients`' case):
    `offload_optimizer.norm_first_pass` true, or "auto" (unset) where the parameters are on NVMe too
    (`params_on_nvme`): there the step is bound by the disk, and the second backward costs one more read of the
    parameter shards (2 B/param in bf16) against the spill's write and read of the gradient plus a step that
    waits for the norm after backward. false: the spill."""
    offload = config.zero_optimization.offload_optimizer
    wanted = offload.norm_first_pass if offload is not None else None
    if wanted is False or not spills_gradients(config, frees_final_shards):
        return False
    return bool(wanted) or params_on_nvme


class NvmeOffloadOptimizer(OffloadOptimizer):
    """Offload whose fp32 masters and optimizer states live on disk; see the module docstring.

    It holds its records (`records`: the file, its extents and index, the buffer pool, paging; `nvme_records.py`) and its
    streaming step (`stream`; `nvme_stream.py`) as members."""

    kind = "nvme"

    def __init__(self, *args, nvme_path: str, buffer_count: int = 4, aio=None,
                 chunk_numel: Optional[int] = None, direct: Optional[bool] = None, spare: Optional[int] = None,
                 stream_gradients: bool = False, spill_gradients: bool = False, norm_first_pass: bool = False,
                 master_dtype: torch.dtype = torch.float32,
                 state_dtype: Optional[torch.dtype] = None, **kwargs):
        kwargs["host_grads"] = False  # gradients go to the host chunk by chunk, through the buffers
        super().__init__(*args, **kwargs)
        # gradients stepped bucket by bucket during backward (the factory decides: no clipping, no loss
        # scale, no overflow check, a reducer that frees shards once consumed)
        self.stream_gradients = bool(stream_gradients) and self.reducer is not None
        if self.stream_gradients:
            self.reducer.free_final_shards()
        self._streamed: Optional[StreamedStep] = None
        self._last_order: dict[int, int] = {}  # the buckets' order in the last streamed step
        self._stepper = SubsetStepper(self.optimizer)
        self.records = NvmeRecords(self.buckets, self.masters, self.optimizer, self.offloaded, nvme_path=nvme_path,
                                   rank=comm_rank(self), buffer_count=buffer_count, aio=aio, chunk_numel=chunk_numel,
                                   direct=direct, pin_memory=kwargs.get("pin_memory", False), spare=spare,
                                   master_dtype=master_dtype, state_dtype=state_dtype)
        self.stream = NvmeStream(self.records)
        # clipping on: final gradient shards spilled to disk during backward, read back by the step (see
        # `nvme_records.GradientSpill` for why a spill rather than speculation or a first pass for the norm)
        # clipping on, the norm from a first backward (`takes_norm_first`): no spill; the second backward streams
        self.norm_first = bool(norm_first_pass) and self.reducer is not None and not self.stream_gradients
        self._norm_terms: Optional[dict[int, list[torch.Tensor]]] = None  # the first pass's, while it runs
        self._first_pass: Optional[FirstPass] = None  # its norm and clip, from its end to step()
        if self.norm_first:
            self.reducer.free_final_shards()
        self.spill_gradients = bool(spill_gradients) and self.reducer is not None and not self.stream_gradients \
            and not self.norm_first
        self.spill: Optional[GradientSpill] = None
        if self.spill_gradients:
            try:
                self.spill = GradientSpill(self.records, {i: self.buckets[i].dtype for i in self.records.on_disk},
                                           {i: self.buckets[i].shard_extent() for i in self.records.on_disk})
            except BaseException:
                self.records.close()
                raise
            self.reducer.free_final_shards()
        self._chunks_of: dict[int, list[Chunk]] = {}
        for chunk in self.records.chunks:
            self._chunks_of.setdefault(chunk.bucket, []).append(chunk)
        self.stats.update(nvme_bytes_read=0, nvme_bytes_written=0, nvme_failed_steps=0, nvme_restored_chunks=0,
                          direct_io=int(self.records.io.direct), nvme_file_bytes=self.records.disk_bytes(),
                          nvme_early_commits=0, nvme_resumed_chunks=0, grad_host_peak_bytes=0, grad_kept_in_memory=0,
                          nvme_spill_skipped_bytes=0, norm_first_passes=0, norm_pass_mismatches=0,
                          nvme_spill_bytes=self.spill.file_bytes if self.spill is not None else 0)
        self._published: set[int] = set()  # buckets whose model shards the last update() already wrote
        self._staging: dict[int, torch.Tensor] = {}  # offload_param buckets: new shard values, chunk by chunk
        self._staging_left: dict[int, int] = {}  # chunks of a staged bucket not yet in its staging tensor
        self._store_written: set[int] = set()  # offload_param buckets whose store this step wrote
        # streamed steps on a background thread (see the module docstring)
        self._worker: Optional[ThreadPoolExecutor] = None
        self._queued: deque[tuple[Future, int]] = deque()  # (a handed-over bucket's task, its gradient elements)
        self._on_worker = threading.local()
        self._to_publish: deque[tuple[int, torch.Tensor]] = deque()  # staged buckets for the main thread to write
        # spilled buckets handed over and not started yet: bucket -> its gradient shard, and their tasks
        # (`_keep_unspilled`); the step thread takes a bucket out of `_unspilled` as it starts it
        self._unspilled: dict[int, torch.Tensor] = {}
        self._spill_tasks: dict[int, Future] = {}
        self._stream_budget = self.records.pool.count * self.records.chunk_numel
        try:
            self._write_initial_masters()
        except BaseException:
            self.records.close()
            raise

    def initial_host_master(self, shard: torch.Tensor, pin_memory: bool) -> torch.Tensor:
        """No host copy, even while building: `_write_initial_masters` fills the records from the model shards
        chunk by chunk, so host memory never holds all the masters at once (a model too large for it)."""
        return master_placeholder(shard.numel())

    def _write_initial_masters(self) -> None:
        """The first records' masters, cast from the model's shards chunk by chunk through the buffer pool."""
        records = self.records
        writes: list[Future] = []
        shard, shard_of = None, None
        for chunk in records.chunks:
            if shard_of != chunk.bucket:  # one bucket's shard at a time (offload_param reads it from its store)
                shard, shard_of = self.buckets[chunk.bucket].local_shard(), chunk.bucket
            buffer = records.pool.acquire()
            records.master(chunk, buffer).copy_(shard.narrow(0, chunk.start, chunk.numel))
            writes.append(records.io.write(records.fd, records.current(chunk), records.record(chunk, buffer),
                                           done=lambda b=buffer: records.pool.release(b)))
        for future in writes:
            future.result()

    def write_master(self, bucket: int, values: torch.Tensor) -> None:
        """New master values of bucket `bucket` from outside a step (a user's write to a stage-3 parameter):
        an offloaded one's into memory while resident, else into new records, each committed once written."""
        if bucket not in self._chunks_of:  # not on disk: its master is a tensor
            self.masters[bucket].copy_(values)
            return
        self._settle_streamed()
        records = self.records
        if records.resident:
            self.masters[bucket].copy_(values)
            return
        records.drop_kept([bucket])
        buffer = records.pool.acquire()
        try:
            for chunk in (c for c in records.chunks if c.bucket == bucket):
                record = records.record(chunk, buffer)
                records.io.read(records.fd, records.current(chunk), record).result()
                records.master(chunk, buffer).copy_(values.narrow(0, chunk.start, chunk.numel))
                records.rewrite(chunk, record)
        finally:
            records.pool.release(buffer)

    # --- the step ----------------------------------------------------------------
    def update(self, grad_shards: list[torch.Tensor], multiplier: float, indices) -> None:
        self._settle_streamed()
        self._update(grad_shards, multiplier, indices, None)

    def _update(self, grad_shards: list[torch.Tensor], multiplier: float, indices,
                streamed: Optional["StreamedStep"]) -> None:
        """Step the offloaded chunks of `indices` that have a gradient (after those `streamed` during
        backward), agree with every rank, then commit or roll back the whole step."""
        if self.records.resident:
            raise RuntimeError("NVMe offload: a step inside resident_states()/resident_masters() is not allowed")
        indices = list(indices)
        records = self.records
        state = streamed if streamed is not None else StreamedStep(records)
        wanted = set(indices)
        spilled = self.spill.ready if self.spill is not None else set()
        chunks = [c for c in records.chunks if c.bucket in wanted and (grad_shards[c.bucket] is not None
                                                                        or c in spilled)]
        self._published.clear()
        if streamed is None:
            self._store_written.clear()
        error = state.error
        if error is None:
            try:
                if streamed is None:
                    records.adopt_states()  # states someone put in memory (a checkpoint load) go to disk first
                self._step_chunks(chunks, grad_shards, multiplier, state, keep_tail=True)
                state.wait_writes()
            except BaseException as caught:  # noqa: BLE001 - every rank learns of it below, then it is raised
                error = caught
        else:
            state.wait_writes(quietly=True)
        records.drop_prefetched()
        committed, pending, scalars = state.committed, state.pending, state.scalars
        self.stats["nvme_early_commits"] += len(committed)
        try:
            self._agree(error, [c for c in state.stepped if c not in set(committed)])
        except BaseException:
            for buffer in state.keep.values():  # not committed: the buffers hold records that are not current
                records.pool.release(buffer)
            for chunk, extent in pending:
                records.abort(chunk, extent)
            if committed:  # the retry of this step skips them and steps with the same scalars
                records.resume.update(committed)
                records.resume_scalars = {b: v for b, v in scalars.items()
                                          if any(c.bucket == b for c in records.resume)}
            raise
        for chunk, extent in pending:  # commit: every write of the step succeeded, on every rank
            records.commit(chunk, extent)
        records.resume.clear()
        records.resume_scalars = {}
        records.kept.update(state.keep)
        for bucket, values in scalars.items():
            self.records.has_state[bucket] = True
            self.optimizer.state[self.masters[bucket]] = values
            self._published.add(bucket)
        io, spill = self.records.io, self.spill
        self.stats["nvme_bytes_read"], self.stats["nvme_bytes_written"] = io.bytes_read, io.bytes_written
        if spill is not None:  # the gradients spilled into the parameter files move through their stores' I/O
            self.stats["nvme_bytes_read"] += spill.slot_bytes_read
            self.stats["nvme_bytes_written"] += spill.slot_bytes_written
        super().update(grad_shards, multiplier, [i for i in indices if not self.offloaded[i]])

    def _step_chunks(self, chunks: list[Chunk], grad_shards, multiplier: float, state: "StreamedStep",
                     keep_tail: bool) -> None:
        """Stream `chunks` through the records into `state`; chunks a failed try committed are not stepped
        again (their offload_param buckets get their new weights from the records: that try's staging was
        dropped)."""
        records = self.records
        resumed = [c for c in chunks if c in records.resume]
        self.stats["nvme_resumed_chunks"] += len(resumed)
        self._publish_from_files([c for c in resumed if self.buckets[c.bucket].offloaded])
        self.stream.run([c for c in chunks if c not in records.resume], grad_shards, multiplier, self._step_chunk,
                        state.stepped, state.keep, state.scalars, state.pending, state.committed,
                        in_flight=state.in_flight, keep_tail=keep_tail, wait=keep_tail, spill=self.spill)

    # --- gradients streamed to the step during backward -----------------------------
    def _on_shard_ready(self, index: int) -> None:
        """With `stream_gradients`, bucket `index`'s final gradient shard is stepped at once (its records
        read, updated and written behind) and the reducer frees it: host memory never holds the gradients of
        the whole model. The step still commits only in `step()`, after every rank's I/O is known."""
        if not ((self.stream_gradients or self.spill_gradients or self.norm_first) and self.offloaded[index]):
            return super()._on_shard_ready(index)
        grad = self.reducer.grad_shards[index]
        if grad is None:
            return
        if self._norm_terms is not None:  # the first of two passes: the norm's terms only
            self._hand_over(grad)
            self._queued.append((self._worker.submit(self._norm_bucket, index, grad), grad.numel()))
            return
        state = self._streamed
        if state is None:
            state = self._streamed = StreamedStep(self.records)
            if self._first_pass is not None:  # the second pass: each bucket stepped with the clip already known
                state.multiplier = self._first_pass.multiplier
            self._published.clear()
            self._store_written.clear()
            try:
                self.records.adopt_states()
            except BaseException as caught:  # noqa: BLE001 - raised on every rank by step()
                state.error = caught
        state.order.append(index)
        self._hand_over(grad)
        if self.spill_gradients:
            if index in self.spill.slots:  # the gradient goes into the parameter's own extent (GradientSpill)
                self.buckets[index].lend_shard_extent()
                self.spill.lend(index, self.buckets[index].shard_extent())
            self._unspilled[index] = grad  # before the task exists: the thread takes it out as it starts
            self._spill_tasks[index] = future = self._worker.submit(self._spill_bucket, index, grad, state)
            self._queued.append((future, grad.numel()))
            return
        if self.buckets[index].offloaded and self._chunks_of.get(index):
            self._stage(index)
        self._queued.append((self._worker.submit(self._stream_bucket, index, grad, state), grad.numel()))

    def _hand_over(self, grad: torch.Tensor) -> None:
        """Main thread, before handing `grad` to the step thread: the staged weights it finished go to their stores,
        and at most `_stream_budget` elements of handed-over gradients wait (the oldest are waited for)."""
        self._write_published()
        while self._queued and sum(numel for _, numel in self._queued) + grad.numel() > self._stream_budget:
            self._queued.popleft()[0].result()  # the oldest hand-over done: its gradient is freed
            self._write_published()
        # the gradients host memory holds for the step: the handed-over shards not done yet, this one, and
        # the spill's staging (`grad_host_peak_bytes`; without streaming or a spill: every offloaded shard)
        held = (sum(numel for _, numel in self._queued) + grad.numel()) * grad.element_size() + \
            (self.spill.host_bytes() if self.spill is not None else 0)
        self.stats["grad_host_peak_bytes"] = max(self.stats["grad_host_peak_bytes"], held)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="zerotrain-nvme-step")

    def _norm_bucket(self, index: int, grad: torch.Tensor) -> None:
        """Background thread, first pass: the norm's terms of bucket `index`'s final gradient shard (then freed)."""
        self._norm_terms[index] = self.gradients.bucket_terms(index, grad)

    # --- the norm from a first pass (`takes_norm_first`) -------------------------------------
    def takes_norm_first_pass(self) -> bool:
        """MasterOptimizer: with clipping, each boundary backward runs twice (`norm_first`; see the module docstring)."""
        return self.norm_first

    def begin_norm_pass(self) -> None:
        """The first pass begins: every final shard from now on only adds its terms to the norm (on the step
        thread, as the streamed steps sum theirs) and is freed; nothing is stepped, spilled or written."""
        self._settle_streamed()
        self._norm_terms, self._first_pass = {}, None

    def end_norm_pass(self, loss_scale: float) -> None:
        """The first pass is over: the global norm (one all-reduce), hence the clip's multiplier, fixed for the
        step that the second pass streams bucket by bucket (`_on_shard_ready`)."""
        self._settle_streamed()
        terms, self._norm_terms = self._norm_terms or {}, None
        norm = self.gradients.norm([_NO_GRADIENT] * len(self.buckets), terms) / loss_scale
        self._first_pass = FirstPass(norm, self.multiplier(norm, loss_scale), terms)

    def _spill_bucket(self, index: int, grad: torch.Tensor, state: "StreamedStep") -> None:
        """Background thread: the norm's terms of bucket `index`'s final gradient shard, and the shard written
        to the spill file chunk by chunk (waited for: the shard is freed when this returns). An error is kept
        in `state` (every rank learns of it in step())."""
        self._unspilled.pop(index, None)  # started: step() no longer keeps it in memory
        try:
            state.terms[index] = self.gradients.bucket_terms(index, grad)
            if state.error is not None:
                return
            writes = self.spill.write_shard(index, grad)
            for future in writes:
                future.result()
            self.spill.ready.update(self._chunks_of.get(index, []))
        except BaseException as caught:  # noqa: BLE001 - raised on every rank by step()
            state.error = caught

    def _stream_bucket(self, index: int, grad: torch.Tensor, state: "StreamedStep") -> None:
        """Background thread: step bucket `index` from its final gradient shard, then read ahead the records
        of the buckets that follow it. An error is kept in `state` (every rank learns of it in step())."""
        self._on_worker.active = True
        try:
            state.terms[index] = self.gradients.bucket_terms(index, grad)  # the norm's terms (read after settling)
            if state.error is not None:
                return
            chunks = self._chunks_of.get(index, [])
            self._step_chunks(chunks, {index: grad}, state.multiplier, state, keep_tail=False)
            # read ahead the records of the buckets that came next in the last streamed step (first step:
            # backward's usual order, the reverse of the buckets'), while the backward computes them
            position = self._last_order.get(index)
            upcoming = ([b for b, _ in sorted(self._last_order.items(), key=lambda kv: kv[1]) if
                         self._last_order[b] > position] if position is not None else range(index - 1, -1, -1))
            wanted = []
            for bucket in upcoming:
                wanted.extend(c for c in self._chunks_of.get(bucket, ()))
                if len(wanted) >= self.records.pool.count:
                    break
            self.stream.prefetch(wanted)
        except BaseException as caught:  # noqa: BLE001 - raised on every rank by step()
            state.error = caught
        finally:
            self._on_worker.active = False

    def _write_published(self) -> None:
        """Main thread: write the staged buckets the background thread finished into their stores."""
        while self._to_publish:
            bucket, staging = self._to_publish.popleft()
            self.buckets[bucket].write_shard(staging)
            self._store_written.add(bucket)

    def _settle_streamed(self) -> None:
        """Wait for every streamed step handed to the background thread and write their new weights."""
        while self._queued:
            self._queued.popleft()[0].result()  # errors are kept in the step's state, not raised here
        self._unspilled.clear()
        self._spill_tasks.clear()
        self._write_published()

    def _keep_unspilled(self) -> dict[int, torch.Tensor]:
        """At `step()`: the spills of the last handed-over shards that the background thread has not started
        are cancelled, and those shards stay in host memory for the step (the norm sums their squares from
        them: the same terms). Their gradients are then neither written nor read back, and the step
        does not wait for those writes before the norm. The bytes are the ones already held (at most
        `_stream_budget` elements, counted in `grad_host_peak_bytes` and the budget); the step frees them.
        Why this and not speculation: see `GradientSpill`. Returns bucket -> its gradient shard."""
        kept: dict[int, torch.Tensor] = {}
        for index, grad in list(self._unspilled.items()):
            if self._spill_tasks[index].cancel():  # not started: it never will be
                kept[index] = grad
        self._unspilled.clear()
        self._spill_tasks.clear()
        if kept:
            self._queued = deque((future, numel) for future, numel in self._queued if not future.cancelled())
        self.stats["grad_kept_in_memory"] += sum(grad.numel() for grad in kept.values())
        self.stats["nvme_spill_skipped_bytes"] += sum(self.spill.write_bytes(index) for index in kept)
        return kept

    def before_model_use(self) -> None:
        """The streamed steps of the last backward are done and their weights in the model before it runs."""
        self._settle_streamed()

    def step(self, grad_shards: list[torch.Tensor], loss_scale: float) -> None:
        kept = self._keep_unspilled() if self._streamed is not None and self.spill_gradients else {}
        self._settle_streamed()
        state, self._streamed = self._streamed, None
        first, self._first_pass = self._first_pass, None
        if kept:  # the last shards handed over, not spilled: stepped from memory
            grad_shards = [kept.get(index, grad) for index, grad in enumerate(grad_shards)]
        if state is None:
            held = sum(g.numel() * g.element_size() for i, g in enumerate(grad_shards)
                       if g is not None and self.offloaded[i])
            self.stats["grad_host_peak_bytes"] = max(self.stats["grad_host_peak_bytes"], held)
            return super().step(grad_shards, loss_scale)
        self._last_order = {bucket: position for position, bucket in enumerate(state.order)}
        # the streamed buckets' shards are gone: their squares were summed as they came (same order, same sum)
        present = [g if g is not None else _NO_GRADIENT for g in grad_shards]
        if first is not None:  # the norm of the first pass, whose clip the second pass stepped with
            norm, multiplier = first.norm, first.multiplier
            self.stats["norm_first_passes"] += 1
            # the second pass's terms: the same bits where backward is deterministic (CPU, gloo); counted, not used
            if not first.same_terms(state.terms):
                self.stats["norm_pass_mismatches"] += 1
        else:
            norm = self.gradients.norm(present, state.terms) / loss_scale
            multiplier = self.multiplier(norm, loss_scale)
        self.last_grad_norm = norm
        self.shards_written = set()
        try:  # spilled: the step reads each chunk's gradient back with its record, clipped by the norm's multiplier
            self._update(grad_shards, multiplier, range(len(self.buckets)), state)
        finally:
            if self.spill is not None:  # the next step's gradients are spilled again (a retry reruns backward)
                self.spill.ready.clear()
                self.spill.lent.clear()  # written by the publish (or the rollback's): the stores took them back
        self.stats["steps"] += 1
        self.publish_after_update()

    def _agree(self, error: Optional[BaseException], stepped: list[Chunk]) -> None:
        """All ranks learn which ranks' step I/O failed; if any did, every rank rolls back and raises.

        One all-reduce of a per-rank failure flag after the step's I/O. Without it a rank whose
        read or write failed would stop while the others went on with the step applied (a silent
        divergence, then a hang in the next collective). Rolling back is not moving
        the index of the chunks not committed yet and publishing their old masters again."""
        comm = self.comm
        failed = [comm_rank(self)] if error is not None else []
        if comm is not None and comm.size > 1:
            flags = torch.zeros(comm.size, dtype=torch.float32, device=self.device)
            flags[comm.rank] = float(error is not None)
            comm.all_reduce(flags)
            failed = [rank for rank, flag in enumerate(flags.tolist()) if flag > 0]
        if not failed:
            return
        self.stats["nvme_failed_steps"] += 1
        self._restore_model(stepped, error or RuntimeError(f"I/O failed on rank(s) {failed}"))
        if error is not None:
            if isinstance(error, OffloadIOError):
                raise OffloadIOError(f"NVMe offload: the step failed on rank(s) {failed}; "
                                     f"here (rank {comm_rank(self)}): {error}") from error
            raise error
        raise OffloadIOError(f"NVMe offload: the step failed on rank(s) {failed} (their optimizer-state I/O); "
                             f"rank {comm_rank(self)} rolled its own step back, so every rank's training state "
                             f"is as it was before the step")

    def _step_chunk(self, chunk: Chunk, buffer: torch.Tensor, grad: torch.Tensor, multiplier: float,
                    scalars: dict) -> None:
        """Update the chunk's master and states in `buffer` and cast the new weights into the model's shard.
        A narrow (bf16) record is stepped in fp32 copies and stored back rounded stochastically; the model
        then gets the stored master, so that it and the records agree."""
        group, master = self.records.group(chunk), self.records.master(chunk, buffer)
        regions = self.records.states(chunk, buffer)
        fresh = not self.records.has_state[chunk.bucket]
        target = self._publish_target(chunk)
        narrow = self.records.narrow_records
        if narrow:
            master, regions = self.records.widen(chunk, buffer, fresh)
        if set(regions) == {"exp_avg", "exp_avg_sq"} and self.cpu_adam.supports(master, group):
            if chunk.bucket not in scalars:  # one step count per bucket, shared by its chunks
                old = None if fresh else self.optimizer.state.get(self.masters[chunk.bucket], {}).get("step")
                step = old.clone() if torch.is_tensor(old) else torch.zeros((), dtype=torch.float32)
                scalars[chunk.bucket] = {"step": step.add_(1)}
            if fresh:
                for region in regions.values():
                    region.zero_()
            if not (grad.device.type == "cpu" and grad.dtype == torch.float32 and grad.is_contiguous()):
                grad = self.records.gradient(buffer, chunk.numel).copy_(grad)
            direct = not narrow and target.device.type == "cpu" and target.dtype in COPY_BACK_DTYPES \
                and target.is_contiguous()
            self._kernel_step(master, grad, regions, scalars[chunk.bucket]["step"], group, multiplier,
                              target if direct else None)
        else:
            direct = False
            self._torch_step(chunk, master, grad, regions, fresh, multiplier, buffer, scalars)
        if narrow:  # the seed: the optimizer's step count (checkpointed), so a resumed run rounds the same way
            step = scalars[chunk.bucket].get("step", self.stats["steps"])
            self.records.store(chunk, buffer, master, regions, int(step))
            master = self.records.master(chunk, buffer)
        if not direct:
            target.copy_(master)
        self._published_chunk(chunk)

    def _kernel_step(self, master, grad, regions, step, group_index: int, multiplier: float, copy_to) -> None:
        """zerotrain's CPU Adam kernel on one chunk (bit-identical to torch's fused Adam(W))."""
        group = self.optimizer.param_groups[group_index]
        beta1, beta2 = group["betas"]
        decoupled = group.get("decoupled_weight_decay", type(self.optimizer) is torch.optim.AdamW)
        adam_step(master, grad, regions["exp_avg"], regions["exp_avg_sq"], step, lr=float(group["lr"]),
                  beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                  weight_decay=float(group["weight_decay"]), decoupled=bool(decoupled), multiplier=multiplier,
                  copy_to=copy_to)

    def _torch_step(self, chunk: Chunk, master, grad, regions, fresh: bool, multiplier: float, buffer,
                    scalars: dict) -> None:
        """The torch optimizer's own step on one chunk, through a shadow optimizer over `chunk.param`."""
        host_grad = self.records.gradient(buffer, chunk.numel)
        host_grad.copy_(grad)
        if multiplier != 1.0:
            host_grad.mul_(multiplier)
        state: dict = {}
        if not fresh:
            for key, value in self.optimizer.state.get(self.masters[chunk.bucket], {}).items():
                state[key] = value.clone() if torch.is_tensor(value) else value
            state.update(regions)
        states = defaultdict(dict, {chunk.param: state})
        chunk.param.data = master
        chunk.param.grad = host_grad
        try:
            self._stepper.step([chunk.param], [self.records.group(chunk)], state=states)
        finally:
            chunk.param.grad = None
            chunk.param.data = chunk.empty
        after = states[chunk.param]
        for key, region in regions.items():
            if after[key].data_ptr() != region.data_ptr():
                region.copy_(after[key])  # a fresh state: the optimizer allocated it
        scalars[chunk.bucket] = {k: v for k, v in after.items() if k not in regions}

    # --- the new weights into the model ------------------------------------------------
    def _publish_target(self, chunk: Chunk) -> torch.Tensor:
        """Where the chunk's new weights go: its range of the model shard (training dtype), or, for a
        stage-3 shard kept by an offload_param store, of a staging tensor written when the bucket is whole."""
        bucket = self.buckets[chunk.bucket]
        if bucket.offloaded:
            return self._stage(chunk.bucket).narrow(0, chunk.start, chunk.numel)
        return bucket.local_shard().narrow(0, chunk.start, chunk.numel)

    def _stage(self, index: int) -> torch.Tensor:
        """The staging tensor of offload_param bucket `index` (made on first use). The main thread makes it
        before handing a streamed bucket over, so the step thread allocates nothing of the model's size
        (memory a thread's own malloc arena would keep)."""
        staging = self._staging.get(index)
        if staging is None:
            bucket = self.buckets[index]
            staging = self._staging[index] = torch.empty(bucket.shard_numel, dtype=bucket.dtype)
            self._staging_left[index] = len(self._chunks_of.get(index, ()))
        return staging

    def _published_chunk(self, chunk: Chunk) -> None:
        """A staged bucket goes to its store once all its chunks are in (in whatever order they came)."""
        if chunk.bucket in self._staging:
            self._staging_left[chunk.bucket] -= 1
            if self._staging_left[chunk.bucket] == 0:
                del self._staging_left[chunk.bucket]
                if getattr(self._on_worker, "active", False):  # the store is the main thread's
                    self._to_publish.append((chunk.bucket, self._staging.pop(chunk.bucket)))
                    return
                self.buckets[chunk.bucket].write_shard(self._staging.pop(chunk.bucket))
                self._store_written.add(chunk.bucket)

    def _publish_from_files(self, chunks: list[Chunk]) -> None:
        """Cast the masters of `chunks` in their current records into the model's shards."""
        buffer = self.records.pool.acquire()
        try:
            for chunk in chunks:
                region = self.records.master_region(chunk, buffer)
                self.records.io.read(self.records.fd, self.records.current(chunk), region).result()
                self._publish_target(chunk).copy_(self.records.master(chunk, buffer))
                self._published_chunk(chunk)
        finally:
            self.records.pool.release(buffer)

    def _restore_model(self, stepped: list[Chunk], cause: BaseException) -> None:
        """After a failed step: the model shards the step wrote get the masters of the current records (the
        old ones where not committed; the new ones of chunks committed early)."""
        self._staging.clear()
        self._staging_left.clear()
        # and the parameters whose extents hold their spilled gradients (lent): their values come back too
        written_whole = set(self._store_written) | (set(self.spill.lent) if self.spill is not None else set())
        chunks = [c for c in self.records.chunks if c.bucket in written_whole] + \
            [c for c in stepped if not self.buckets[c.bucket].offloaded]
        try:
            self._publish_from_files(chunks)
        except BaseException as error:
            self._staging.clear()
            self._staging_left.clear()
            raise OffloadIOError(f"NVMe offload: a step failed ({cause}) and the model weights could not be put "
                                 f"back ({error}); the masters and states on disk are as before the step (a "
                                 f"checkpoint load or the next successful step's publish makes them agree)") from error
        self.stats["nvme_restored_chunks"] += len(chunks)

    def publish(self, current: Collection[int] = ()) -> None:
        """Cast masters into the model's buffers (offloaded ones from the files unless the step just did)
        and all-gather every bucket that keeps a full copy. `current`: buckets whose shards already hold them."""
        self._settle_streamed()
        done = self._published | set(current)
        if not self.records.resident:
            self._publish_from_files([c for c in self.records.chunks if c.bucket not in done])
        self._published.clear()
        handles = []
        for index, (bucket, master) in enumerate(zip(self.buckets, self.masters)):
            from_master = (self.records.resident or not self.offloaded[index]) and index not in current
            if bucket.offloaded:  # offload_param: into host memory or the NVMe file
                if from_master:
                    bucket.write_shard(master)
                continue
            shard = bucket.local_shard()
            if from_master and master.data_ptr() != shard.data_ptr():
                shard.copy_(master)
            if bucket.keeps_full_copy and (bucket.partitions > 1 or shard.data_ptr() != bucket.flat_param.data_ptr()):
                comm = bucket.group.comm  # split experts: their expert-data-parallel group
                handles.append(comm.all_gather(bucket.flat_param, shard, async_op=True))
        for handle in handles:
            handle.wait()

    # --- MasterOptimizer's capabilities, from the records ----------------------------------
    @contextmanager
    def resident_states(self, write_back: bool = True):
        """Masters and per-element states in host memory (`masters`, `optimizer.state[master]`) while inside.

        For checkpoint save (`write_back=False`: only read, the files stay) and load (what is in memory
        on exit is written, each record committed once written). On an exception inside, or a failed
        read, the files are left as they were."""
        self._settle_streamed()
        with self.records.paged_in(write_back, with_states=True):
            yield self

    @contextmanager
    def resident_masters(self):
        """The fp32 masters in host memory while inside, read only (e.g. to gather the full weights)."""
        self._settle_streamed()
        with self.records.paged_in(False, with_states=False):
            yield self

    def memory_split(self) -> dict[str, int]:
        """As OffloadOptimizer's, with the offloaded masters and per-element states counted under `nvme`
        (in host memory only while resident) and the I/O buffers under `host_buffers`."""
        split = self.records.account(super().memory_split())
        if self.spill is not None:
            split["host_buffers"] += self.spill.host_bytes()
        return split

    def close(self) -> None:
        try:
            self._settle_streamed()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            self.records.close()


_NO_GRADIENT = torch.zeros(0)  # a streamed bucket's place in the norm's list (its terms are known)


class StreamedStep:
    """One step's chunks in progress: stepped, written (pending their commit), committed early, the buffers
    kept, the scalar states, the writes in flight, the norm terms of streamed buckets, the first error."""

    def __init__(self, records: NvmeRecords):
        self.records = records
        self.stepped: list[Chunk] = []
        self.pending: list[tuple[Chunk, int]] = []
        self.committed: list[Chunk] = []
        self.keep: dict[Chunk, torch.Tensor] = {}
        self.scalars: dict = dict(records.resume_scalars)  # a retry steps with the scalars the failed try used
        self.in_flight: dict[Chunk, Future] = {}
        self.terms: dict[int, list[torch.Tensor]] = {}
        self.order: list[int] = []  # the buckets in the order their gradients came
        self.error: Optional[BaseException] = None
        self.multiplier = 1.0  # what the streamed buckets' gradients are multiplied by (the first pass's clip)

    def wait_writes(self, quietly: bool = False) -> None:
        """Wait for every write still in flight; the first failure is raised (unless `quietly`)."""
        first = None
        for future in list(self.in_flight.values()):
            try:
                future.result()
            except BaseException as error:  # noqa: BLE001 - all are waited for, the first is raised
                first = first or error
        if first is not None and not quietly:
            raise first


class FirstPass:
    """The first of two backwards (`takes_norm_first`): the global norm, the clip's multiplier, this rank's terms."""

    def __init__(self, norm: float, multiplier: float, terms: dict[int, list[torch.Tensor]]):
        self.norm, self.multiplier, self.terms = norm, multiplier, terms

    def same_terms(self, terms: dict[int, list[torch.Tensor]]) -> bool:
        """Whether the second pass's terms (`terms`) equal the first's, bit for bit."""
        return terms.keys() == self.terms.keys() and all(
            len(terms[i]) == len(mine) and all(torch.equal(a, b) for a, b in zip(terms[i], mine))
            for i, mine in self.terms.items())


def comm_rank(optimizer) -> int:
    return int(optimizer.comm.rank) if optimizer.comm is not None else 0

