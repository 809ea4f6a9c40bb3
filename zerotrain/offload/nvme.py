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

A step leaves the training state as it was when any read or write fails: records are
double-buffered (two slot files; a step reads the current slot and writes the other), and only
when every write of the step has succeeded are the slots flipped (masters and states together)
and the scalar states (Adam's step count) replaced. The model shards of the chunks already
updated are then published again from the current slot. The error is an `aio.OffloadIOError`
raised from `step()` after all I/O in flight has finished; a full disk says so. Ranks agree after
the step's I/O (one all-reduce of a failure flag per rank): when any rank failed, every rank
rolls back and raises an error naming the failing ranks. The files are allocated in full when
the optimizer is built, so a disk too small fails at start-up with the sizes in the message.

Between steps `optimizer.state[master]` holds only the scalar states. `resident_states()` brings
masters and per-element states into host memory (checkpoint save and load run inside it) and
writes back whatever is there on exit; `resident_masters()` brings only the masters (read only,
for `engine.full_state_dict()`). Per-element states found in `optimizer.state` at the start of
a step (a checkpoint load that did not use `resident_states`) are written to disk first.
"""
from __future__ import annotations

import functools
import os
import shutil
import weakref
from collections import defaultdict
from concurrent.futures import Future
from typing import Collection, Optional

import torch

from .aio import ALIGN, AlignedBuffers, OffloadIOError, open_swap_directory, round_up
from .cpu_adam import COPY_BACK_DTYPES, adam_step
from .cpu_optimizer import OffloadOptimizer
from .nvme_records import NvmeRecords, _Chunk, _cleanup, master_placeholder
from .nvme_stream import NvmeStream
from .partial import SubsetStepper, probe_state_layout

DEFAULT_CHUNK_NUMEL = 1 << 22  # 4M elements: 16 MiB per fp32 region per chunk


class NvmeOffloadOptimizer(NvmeStream, NvmeRecords, OffloadOptimizer):
    """Offload whose fp32 masters and optimizer states live on disk; see the module docstring."""

    kind = "nvme"

    def __init__(self, *args, nvme_path: str, buffer_count: int = 4, aio=None,
                 chunk_numel: Optional[int] = None, direct: Optional[bool] = None, **kwargs):
        kwargs["host_grads"] = False  # gradients go to the host chunk by chunk, through the buffers
        super().__init__(*args, **kwargs)
        self._stepper = SubsetStepper(self.optimizer)
        shards = [b.shard_numel for b, off in zip(self.buckets, self.offloaded) if off] or [1]
        self.chunk_numel = round_up(min(chunk_numel or DEFAULT_CHUNK_NUMEL, max(shards)), ALIGN // 4)
        self.region = round_up(self.chunk_numel * 4)  # one fp32 chunk: the master, the gradient
        self.layouts: dict[int, list[tuple[str, torch.dtype, int, int]]] = {}  # key, dtype, offset, bytes
        self.record_bytes: dict[int, int] = {}
        for group in {b.group_index for b, off in zip(self.buckets, self.offloaded) if off}:
            offset, layout = self.region, []  # the master first, then the states
            for key, dtype in probe_state_layout(self.optimizer, group):
                size = round_up(self.chunk_numel * dtype.itemsize)
                layout.append((key, dtype, offset, size))
                offset += size
            self.layouts[group], self.record_bytes[group] = layout, offset
        self.chunks: list[_Chunk] = []
        for index, (bucket, off) in enumerate(zip(self.buckets, self.offloaded)):
            for number, start in enumerate(range(0, bucket.shard_numel, self.chunk_numel) if off else ()):
                self.chunks.append(_Chunk(index, number, start, min(self.chunk_numel, bucket.shard_numel - start)))
        self.directory, self.io = open_swap_directory(nvme_path, f"zerotrain-optim-r{comm_rank(self)}-", aio,
                                                      direct, "NVMe offload")
        self._finalizer = weakref.finalize(self, _cleanup, self.io, self.directory)
        self.files: tuple[int, int] = (-1, -1)  # slot 0, slot 1
        self._open_files()
        self.slot = {chunk.bucket: 0 for chunk in self.chunks}
        self.has_state = {bucket: False for bucket in self.slot}
        largest = max(self.record_bytes.values(), default=ALIGN)
        self.pool = AlignedBuffers(max(2, int(buffer_count)), largest + self.region,
                                   pin=kwargs.get("pin_memory", False))
        self.stats.update(nvme_bytes_read=0, nvme_bytes_written=0, nvme_failed_steps=0, nvme_restored_chunks=0,
                          direct_io=int(self.io.direct))
        self._resident = False  # masters hold their values (inside resident_states / resident_masters)
        self._published: set[int] = set()  # buckets whose model shards the last update() already wrote
        self._staging: dict[int, torch.Tensor] = {}  # offload_param buckets: new shard values, chunk by chunk
        self._staging_left: dict[int, int] = {}  # chunks of a staged bucket not yet in its staging tensor
        self._store_written: set[int] = set()  # offload_param buckets whose store this step wrote
        self._kept: dict[_Chunk, torch.Tensor] = {}  # records still in pool buffers after a step (nvme_stream.py)
        try:
            self._write_initial_masters()
        except BaseException:
            self._finalizer()
            raise
        for bucket in self.slot:  # stage 3: GatheredParameters(modifier_rank=...) writes masters through here
            self.buckets[bucket].master_writer = functools.partial(self.write_master, bucket)

    def _open_files(self) -> None:
        """Two slot files for all buckets; each chunk's record has its offset in both."""
        size = 0
        for chunk in self.chunks:
            chunk.offset = size
            size += self.record_bytes[self.buckets[chunk.bucket].group_index]
        needed, free = 2 * size, shutil.disk_usage(self.directory).free
        if needed > free:
            self._finalizer()
            raise OffloadIOError(f"NVMe offload: rank {comm_rank(self)} needs {needed / 2**20:.1f} MiB under "
                                 f"{os.path.dirname(self.directory)} for its fp32 masters and optimizer states; "
                                 f"only {free / 2**20:.1f} MiB are free")
        try:
            if self.chunks:
                path = os.path.join(self.directory, "states")
                self.files = (self.io.open(path + ".slot0", size), self.io.open(path + ".slot1", size))
        except BaseException:
            self._finalizer()
            raise

    def initial_host_master(self, shard: torch.Tensor, pin_memory: bool) -> torch.Tensor:
        """No host copy, even while building: `_write_initial_masters` fills slot 0 from the model shards
        chunk by chunk, so host memory never holds all the masters at once (a model too large for it)."""
        return master_placeholder(shard.numel())

    def _write_initial_masters(self) -> None:
        """Slot 0's masters, cast from the model's shards chunk by chunk through the buffer pool."""
        writes: list[Future] = []
        shard, shard_of = None, None
        for chunk in self.chunks:
            if shard_of != chunk.bucket:  # one bucket's shard at a time (offload_param reads it from its store)
                shard, shard_of = self.buckets[chunk.bucket].local_shard(), chunk.bucket
            buffer = self.pool.acquire()
            self._master_region(chunk, buffer).view(torch.float32)[:chunk.numel].copy_(
                shard.narrow(0, chunk.start, chunk.numel))
            writes.append(self.io.write(self.files[0], chunk.offset, self._record(chunk, buffer),
                                        done=lambda b=buffer: self.pool.release(b)))
        for future in writes:
            future.result()

    def write_master(self, bucket: int, values: torch.Tensor) -> None:
        """New master values of offloaded bucket `bucket` from outside a step (a user's write to a stage-3
        parameter): into memory while resident, else into the spare slot's records, then flipped."""
        if self._resident:
            self.masters[bucket].copy_(values)
            return
        self._drop_kept([bucket])
        buffer = self.pool.acquire()
        try:
            for chunk in (c for c in self.chunks if c.bucket == bucket):
                record = self._record(chunk, buffer)
                self.io.read(self.files[self.slot[bucket]], chunk.offset, record).result()
                self._master(chunk, buffer).copy_(values.narrow(0, chunk.start, chunk.numel))
                self.io.write(self.files[1 - self.slot[bucket]], chunk.offset, record).result()
        finally:
            self.pool.release(buffer)
        self.slot[bucket] ^= 1

    # --- the step ----------------------------------------------------------------
    def update(self, grad_shards: list[torch.Tensor], multiplier: float, indices) -> None:
        if self._resident:
            raise RuntimeError("NVMe offload: a step inside resident_states()/resident_masters() is not allowed")
        indices = list(indices)
        wanted = set(indices)
        chunks = [c for c in self.chunks if c.bucket in wanted and grad_shards[c.bucket] is not None]
        stepped: list[_Chunk] = []
        scalars, error, keep = {}, None, {}
        self._published.clear()
        self._store_written.clear()
        try:
            self._adopt_states()  # states someone put in memory (a checkpoint load) go to disk first
            scalars = self._stream(chunks, grad_shards, multiplier, stepped, keep)
        except BaseException as caught:  # noqa: BLE001 - every rank learns of it below, then it is raised
            error = caught
        try:
            self._agree(error, stepped)
        except BaseException:
            for buffer in keep.values():  # not committed: the buffers hold records of no current slot
                self.pool.release(buffer)
            raise
        self._kept.update(keep)
        for bucket, values in scalars.items():  # commit: every write of the step succeeded, on every rank
            self.slot[bucket] ^= 1
            self.has_state[bucket] = True
            self.optimizer.state[self.masters[bucket]] = values
            self._published.add(bucket)
        self.stats["nvme_bytes_read"], self.stats["nvme_bytes_written"] = self.io.bytes_read, self.io.bytes_written
        super().update(grad_shards, multiplier, [i for i in indices if not self.offloaded[i]])

    def _agree(self, error: Optional[BaseException], stepped: list[_Chunk]) -> None:
        """All ranks learn which ranks' step I/O failed; if any did, every rank rolls back and raises.

        One all-reduce of a per-rank failure flag after the step's I/O. Without it a rank whose
        read or write failed would stop while the others went on with the step applied (a silent
        divergence, then a hang in the next collective). Rolling back is not flipping the slots
        and publishing the stepped chunks' old masters again."""
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

    def _step_chunk(self, chunk: _Chunk, buffer: torch.Tensor, grad_shard: torch.Tensor, multiplier: float,
                    scalars: dict) -> None:
        """Update the chunk's master and states in `buffer` and cast the new weights into the model's shard."""
        group, master = self._group(chunk), self._master(chunk, buffer)
        regions = self._states(chunk, buffer)
        grad = grad_shard.narrow(0, chunk.start, chunk.numel)
        fresh = not self.has_state[chunk.bucket]
        target = self._publish_target(chunk)
        if set(regions) == {"exp_avg", "exp_avg_sq"} and self.cpu_adam.supports(master, group):
            if chunk.bucket not in scalars:  # one step count per bucket, shared by its chunks
                old = None if fresh else self.optimizer.state.get(self.masters[chunk.bucket], {}).get("step")
                step = old.clone() if torch.is_tensor(old) else torch.zeros((), dtype=torch.float32)
                scalars[chunk.bucket] = {"step": step.add_(1)}
            if fresh:
                for region in regions.values():
                    region.zero_()
            if not (grad.device.type == "cpu" and grad.dtype == torch.float32 and grad.is_contiguous()):
                grad = self._gradient(buffer, chunk.numel).copy_(grad)
            direct = target.device.type == "cpu" and target.dtype in COPY_BACK_DTYPES and target.is_contiguous()
            self._kernel_step(master, grad, regions, scalars[chunk.bucket]["step"], group, multiplier,
                              target if direct else None)
            if not direct:
                target.copy_(master)
        else:
            self._torch_step(chunk, master, grad, regions, fresh, multiplier, buffer, scalars)
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

    def _torch_step(self, chunk: _Chunk, master, grad, regions, fresh: bool, multiplier: float, buffer,
                    scalars: dict) -> None:
        """The torch optimizer's own step on one chunk, through a shadow optimizer over `chunk.param`."""
        host_grad = self._gradient(buffer, chunk.numel)
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
            self._stepper.step([chunk.param], [self._group(chunk)], state=states)
        finally:
            chunk.param.grad = None
            chunk.param.data = chunk.empty
        after = states[chunk.param]
        for key, region in regions.items():
            if after[key].data_ptr() != region.data_ptr():
                region.copy_(after[key])  # a fresh state: the optimizer allocated it
        scalars[chunk.bucket] = {k: v for k, v in after.items() if k not in regions}

    # --- the new weights into the model ------------------------------------------------
    def _publish_target(self, chunk: _Chunk) -> torch.Tensor:
        """Where the chunk's new weights go: its range of the model shard (training dtype), or, for a
        stage-3 shard kept by an offload_param store, of a staging tensor written when the bucket is whole."""
        bucket = self.buckets[chunk.bucket]
        if getattr(bucket, "offloaded", False):
            staging = self._staging.get(chunk.bucket)
            if staging is None:
                staging = self._staging[chunk.bucket] = torch.empty(bucket.shard_numel, dtype=bucket.dtype)
                self._staging_left[chunk.bucket] = sum(c.bucket == chunk.bucket for c in self.chunks)
            return staging.narrow(0, chunk.start, chunk.numel)
        return bucket.local_shard().narrow(0, chunk.start, chunk.numel)

    def _published_chunk(self, chunk: _Chunk) -> None:
        """A staged bucket goes to its store once all its chunks are in (in whatever order they came)."""
        if chunk.bucket in self._staging:
            self._staging_left[chunk.bucket] -= 1
            if self._staging_left[chunk.bucket] == 0:
                del self._staging_left[chunk.bucket]
                self.buckets[chunk.bucket].write_shard(self._staging.pop(chunk.bucket))
                self._store_written.add(chunk.bucket)

    def _publish_from_files(self, chunks: list[_Chunk]) -> None:
        """Cast the masters of `chunks` in the current slot into the model's shards."""
        buffer = self.pool.acquire()
        try:
            for chunk in chunks:
                region = self._master_region(chunk, buffer)
                self.io.read(self.files[self.slot[chunk.bucket]], chunk.offset, region).result()
                self._publish_target(chunk).copy_(region.view(torch.float32)[:chunk.numel])
                self._published_chunk(chunk)
        finally:
            self.pool.release(buffer)

    def _restore_model(self, stepped: list[_Chunk], cause: BaseException) -> None:
        """After a failed step: the model shards the step wrote get the (unchanged) masters of the current slot."""
        self._staging.clear()
        self._staging_left.clear()
        written_whole = set(self._store_written)
        chunks = [c for c in self.chunks if c.bucket in written_whole] + \
            [c for c in stepped if not getattr(self.buckets[c.bucket], "offloaded", False)]
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
        done = self._published | set(current)
        if not self._resident:
            self._publish_from_files([c for c in self.chunks if c.bucket not in done])
        self._published.clear()
        handles = []
        for index, (bucket, master) in enumerate(zip(self.buckets, self.masters)):
            from_master = (self._resident or not self.offloaded[index]) and index not in current
            if getattr(bucket, "offloaded", False):  # offload_param: into host memory or the NVMe file
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

    def close(self) -> None:
        self._finalizer()


def comm_rank(optimizer) -> int:
    return int(getattr(optimizer.comm, "rank", 0)) if optimizer.comm is not None else 0

