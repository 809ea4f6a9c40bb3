"""ZeRO-Infinity-style NVMe offload: optimizer states in files, streamed through bounded buffers.

The fp32 masters stay in host memory (`.masters`, as for CPU offload); the per-element
optimizer states (Adam's exp_avg and exp_avg_sq, or whatever the torch optimizer keeps)
live in files under `nvme_path` (three files in one directory per rank and run, removed at
exit: two state slots and a master backup; every chunk has its own aligned offsets). Each
offloaded bucket's shard is cut into chunks of `chunk_numel` elements; a step streams the
chunks through a pool of `buffer_count` aligned buffers (`aio.AlignedBuffers`), with the
reads of the next chunks in flight while the current one is updated on the main thread
and the writes of the previous ones going on behind it (`aio.AsyncFileIO`, O_DIRECT where
the filesystem takes it). Host memory for states is bounded by the pool, whatever the model size.

A step leaves the training state as it was when any read or write fails:

- states are double-buffered: each bucket has two slot files; a step reads the current
  slot and writes the other, and only when every write of the step has succeeded are the
  slots flipped (and the scalar states such as Adam's step count replaced);
- before a chunk's masters are updated, their old values are written to a backup file
  (in parallel with the state read); if the step fails, the masters of every chunk it
  updated are read back from there.

The error is an `aio.OffloadIOError` raised from `step()` in the training process, after all
I/O in flight has finished (never a hang, never a silent loss); a full disk says so. Ranks agree
after the step's I/O (one all-reduce of a failure flag per rank): when any rank failed, every
rank rolls its step back and raises an error naming the failing ranks, so no rank goes on with
a step the others did not take. The files are allocated in full when the optimizer is built,
so a disk too small for them fails at start-up with the sizes in the message.

Between steps `optimizer.state[master]` holds only the scalar states. `resident_states()`
brings the per-element ones into host memory (checkpoint save must use it) and writes back
whatever is there on exit; per-element states found in `optimizer.state` at the start of a
step (a checkpoint load that did not use it) are written to disk first, so they are not lost.
"""
from __future__ import annotations

import os
import shutil
import weakref
from collections import defaultdict
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Optional

import torch

from .aio import ALIGN, AlignedBuffers, AsyncFileIO, OffloadIOError, open_swap_directory, round_up
from .cpu_optimizer import OffloadOptimizer
from .partial import SubsetStepper, probe_state_layout

DEFAULT_CHUNK_NUMEL = 1 << 22  # 4M elements: 16 MiB per fp32 state per chunk


class _Chunk:
    def __init__(self, bucket: int, index: int, start: int, numel: int, master: torch.Tensor):
        self.bucket, self.index, self.start, self.numel = bucket, index, start, numel
        self.offset = self.backup_offset = 0  # bytes into the state slot files and the backup file
        self.view = master.narrow(0, start, numel)  # a stable tensor: the shadow optimizer's key


class NvmeOffloadOptimizer(OffloadOptimizer):
    """Offload whose optimizer states live on disk; see the module docstring."""

    kind = "nvme"

    def __init__(self, *args, nvme_path: str, buffer_count: int = 4, aio=None,
                 chunk_numel: Optional[int] = None, direct: Optional[bool] = None, **kwargs):
        kwargs["host_grads"] = False  # gradients go to the host chunk by chunk, through the buffers
        super().__init__(*args, **kwargs)
        self._stepper = SubsetStepper(self.optimizer)
        shards = [b.shard_numel for b, off in zip(self.buckets, self.offloaded) if off] or [1]
        per = ALIGN // 4
        self.chunk_numel = round_up(min(chunk_numel or DEFAULT_CHUNK_NUMEL, max(shards)), per)
        self.layouts: dict[int, list[tuple[str, torch.dtype, int, int]]] = {}  # key, dtype, offset, bytes
        self.record_bytes: dict[int, int] = {}
        for group in {b.group_index for b, off in zip(self.buckets, self.offloaded) if off}:
            offset, layout = 0, []
            for key, dtype in probe_state_layout(self.optimizer, group):
                size = round_up(self.chunk_numel * dtype.itemsize)
                layout.append((key, dtype, offset, size))
                offset += size
            self.layouts[group], self.record_bytes[group] = layout, max(offset, ALIGN)
        self.region = round_up(self.chunk_numel * 4)  # one fp32 chunk: master backup, gradient
        self.chunks: list[_Chunk] = []
        for index, (bucket, off) in enumerate(zip(self.buckets, self.offloaded)):
            for number, start in enumerate(range(0, bucket.shard_numel, self.chunk_numel) if off else ()):
                self.chunks.append(_Chunk(index, number, start, min(self.chunk_numel, bucket.shard_numel - start),
                                          self.masters[index]))
        self.directory, self.io = open_swap_directory(nvme_path, f"zerotrain-optim-r{comm_rank(self)}-", aio,
                                                      direct, "NVMe offload")
        self._finalizer = weakref.finalize(self, _cleanup, self.io, self.directory)
        self.files: tuple[int, int, int] = (-1, -1, -1)  # slot 0, slot 1, master backup
        self._open_files()
        self.slot = {chunk.bucket: 0 for chunk in self.chunks}
        self.has_state = {bucket: False for bucket in self.slot}
        largest = max(self.record_bytes.values(), default=ALIGN)
        self.pool = AlignedBuffers(max(2, int(buffer_count)), largest + 2 * self.region,
                                   pin=kwargs.get("pin_memory", False))
        self.stats.update(nvme_bytes_read=0, nvme_bytes_written=0, nvme_failed_steps=0, nvme_restored_chunks=0,
                          direct_io=int(self.io.direct))

    def _open_files(self) -> None:
        """Three files for all buckets: two state slots and the master backup; each chunk has its offsets."""
        states = backup = 0
        for chunk in self.chunks:
            chunk.offset, chunk.backup_offset = states, backup
            states += self.record_bytes[self.buckets[chunk.bucket].group_index]
            backup += self.region
        needed = 2 * states + backup
        free = shutil.disk_usage(self.directory).free
        if needed > free:
            self._finalizer()
            raise OffloadIOError(f"NVMe offload: rank {comm_rank(self)} needs {needed / 2**20:.1f} MiB under "
                                 f"{os.path.dirname(self.directory)} for its optimizer states; only "
                                 f"{free / 2**20:.1f} MiB are free")
        try:
            if self.chunks:
                path = os.path.join(self.directory, "states")
                self.files = (self.io.open(path + ".slot0", states), self.io.open(path + ".slot1", states),
                              self.io.open(path + ".backup", backup))
        except BaseException:
            self._finalizer()
            raise

    # --- buffer regions ----------------------------------------------------------
    def _group(self, chunk: _Chunk) -> int:
        return self.buckets[chunk.bucket].group_index

    def _record(self, chunk: _Chunk, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[:self.record_bytes[self._group(chunk)]]

    def _region(self, buffer: torch.Tensor, which: int) -> torch.Tensor:
        """The bytes of region 0 (master backup) or 1 (gradient), after the largest state record."""
        start = max(self.record_bytes.values()) + which * self.region
        return buffer[start:start + self.region]

    def _fp32(self, buffer: torch.Tensor, which: int, numel: int) -> torch.Tensor:
        return self._region(buffer, which).view(torch.float32)[:numel]

    def _states(self, chunk: _Chunk, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of the chunk's per-element states in the buffer's record."""
        return {key: buffer[offset:offset + size].view(dtype)[:chunk.numel]
                for key, dtype, offset, size in self.layouts[self._group(chunk)]}

    # --- I/O of one chunk ----------------------------------------------------------
    def _fetch(self, chunk: _Chunk, buffer: torch.Tensor) -> list[Future]:
        """Read the chunk's states (current slot) and write its masters' backup, both in the background."""
        fd_states, fd_backup = self.files[self.slot[chunk.bucket]], self.files[2]
        futures = [self.io.write(fd_backup, chunk.backup_offset, self._region(buffer, 0),
                                 before=lambda: self._fp32(buffer, 0, chunk.numel).copy_(chunk.view))]
        if self.has_state[chunk.bucket]:
            record = self._record(chunk, buffer)
            futures.append(self.io.read(fd_states, chunk.offset, record))
        return futures

    def _write_back(self, chunk: _Chunk, buffer: torch.Tensor) -> Future:
        record = self._record(chunk, buffer)
        fd = self.files[1 - self.slot[chunk.bucket]]
        return self.io.write(fd, chunk.offset, record, done=lambda: self.pool.release(buffer))

    def _step_chunk(self, chunk: _Chunk, buffer: torch.Tensor, grad: torch.Tensor, multiplier: float,
                    scalars: dict) -> None:
        master = self.masters[chunk.bucket]
        host_grad = self._fp32(buffer, 1, chunk.numel)
        host_grad.copy_(grad.narrow(0, chunk.start, chunk.numel))
        if multiplier != 1.0:
            host_grad.mul_(multiplier)
        regions = self._states(chunk, buffer)
        state: dict = {}
        if self.has_state[chunk.bucket]:
            for key, value in self.optimizer.state.get(master, {}).items():
                state[key] = value.clone() if torch.is_tensor(value) else value
            state.update(regions)
        states = defaultdict(dict, {chunk.view: state})
        chunk.view.grad = host_grad
        try:
            self._stepper.step([chunk.view], [self._group(chunk)], state=states)
        finally:
            chunk.view.grad = None
        after = states[chunk.view]
        for key, region in regions.items():
            if after[key].data_ptr() != region.data_ptr():
                region.copy_(after[key])  # a fresh state: the optimizer allocated it
        scalars[chunk.bucket] = {k: v for k, v in after.items() if k not in regions}

    # --- the step ----------------------------------------------------------------
    def update(self, grad_shards: list[torch.Tensor], multiplier: float, indices) -> None:
        indices = list(indices)
        wanted = set(indices)
        chunks = [c for c in self.chunks if c.bucket in wanted and grad_shards[c.bucket] is not None]
        stepped: list[_Chunk] = []
        scalars, error = {}, None
        try:
            self._drop_resident(self._write_all())  # states someone put in memory (a checkpoint load) go to disk first
            scalars = self._stream(chunks, grad_shards, multiplier, stepped)
        except BaseException as caught:  # noqa: BLE001 - every rank learns of it below, then it is raised
            error = caught
        self._agree(error, stepped)
        for bucket, values in scalars.items():  # commit: every write of the step succeeded, on every rank
            self.slot[bucket] ^= 1
            self.has_state[bucket] = True
            self.optimizer.state[self.masters[bucket]] = values
        self.stats["nvme_bytes_read"], self.stats["nvme_bytes_written"] = self.io.bytes_read, self.io.bytes_written
        super().update(grad_shards, multiplier, [i for i in indices if not self.offloaded[i]])

    def _agree(self, error: Optional[BaseException], stepped: list[_Chunk]) -> None:
        """All ranks learn which ranks' step I/O failed; if any did, every rank rolls back and raises.

        One all-reduce of a per-rank failure flag after the step's I/O. Without it a rank whose
        read or write failed would stop while the others went on with the step applied (a silent
        divergence, then a hang in the next collective)."""
        comm = self.comm
        failed = [comm_rank(self)] if error is not None else []
        if comm is not None and comm.size > 1:
            flags = torch.zeros(comm.size, dtype=torch.float32, device=self.device)
            flags[comm.rank] = float(error is not None)
            comm.all_reduce(flags)
            failed = [rank for rank, flag in enumerate(flags.tolist()) if flag > 0]
        if not failed:
            return
        if error is not None:
            if isinstance(error, OffloadIOError):
                raise OffloadIOError(f"NVMe offload: the step failed on rank(s) {failed}; "
                                     f"here (rank {comm_rank(self)}): {error}") from error
            raise error
        self.stats["nvme_failed_steps"] += 1
        self._restore_masters(stepped, RuntimeError(f"I/O failed on rank(s) {failed}"))
        raise OffloadIOError(f"NVMe offload: the step failed on rank(s) {failed} (their optimizer-state I/O); "
                             f"rank {comm_rank(self)} rolled its own step back, so every rank's training state "
                             f"is as it was before the step")

    def _stream(self, chunks: list[_Chunk], grad_shards, multiplier: float, stepped: list[_Chunk]) -> dict:
        """Read, update and write back `chunks`, appending each to `stepped` before its masters change.

        On failure the masters of `stepped` are restored and the error raised; the slots are untouched."""
        fetched: dict[int, tuple[torch.Tensor, list[Future]]] = {}
        writes: list[Future] = []
        scalars: dict = {}
        holding, ahead = None, 0  # holding: (buffer, its I/O futures) of the chunk being updated
        try:
            for k, chunk in enumerate(chunks):
                while ahead < len(chunks) and ahead - k < self.pool.count:
                    buffer = self.pool.acquire(block=ahead == k)  # blocks only on writes behind: they free buffers
                    if buffer is None:
                        break
                    fetched[ahead] = (buffer, self._fetch(chunks[ahead], buffer))
                    ahead += 1
                holding = fetched.pop(k)
                for future in holding[1]:
                    future.result()
                for future in writes:
                    if future.done() and future.exception() is not None:
                        raise future.exception()
                stepped.append(chunk)
                self._step_chunk(chunk, holding[0], grad_shards[chunk.bucket], multiplier, scalars)
                writes.append(self._write_back(chunk, holding[0]))
                holding = None
            for future in writes:
                future.result()
        except BaseException as error:
            self.stats["nvme_failed_steps"] += 1
            for buffer, futures in list(fetched.values()) + ([holding] if holding is not None else []):
                _quietly_wait(futures)
                self.pool.release(buffer)
            _quietly_wait(writes)
            self._restore_masters(stepped, error)
            raise
        return scalars

    def _restore_masters(self, chunks: list[_Chunk], cause: BaseException) -> None:
        """Put back the masters of `chunks` from their backups (written before they were updated)."""
        buffer = self.pool.acquire()
        try:
            for chunk in chunks:
                self.io.read(self.files[2], chunk.backup_offset, self._region(buffer, 0)).result()
                chunk.view.copy_(self._fp32(buffer, 0, chunk.numel))
                self.stats["nvme_restored_chunks"] += 1
        except BaseException as error:
            raise OffloadIOError(f"NVMe offload: a step failed ({cause}) and the master weights could not be "
                                 f"restored ({error}); the training state is inconsistent") from error
        finally:
            self.pool.release(buffer)

    # --- states in memory, for checkpoints -----------------------------------------
    @contextmanager
    def resident_states(self, write_back: bool = True):
        """Per-element states in `optimizer.state[master]` (host memory) while inside; written back after.

        For checkpoint save (`write_back=False`: the states were only read, the files stay) and load
        (the loaded states go to the spare slots, which become current only when all were written).
        On an exception inside, or a failed read, the files are left as they were.
        """
        try:
            self._read_all()
            yield self
        except BaseException:
            self._drop_resident(set())
            raise
        self._drop_resident(self._write_all() if write_back else set())

    def _chunk_io(self, chunk: _Chunk, buffer: torch.Tensor, write: bool) -> None:
        record = self._record(chunk, buffer)
        slot = 1 - self.slot[chunk.bucket] if write else self.slot[chunk.bucket]
        (self.io.write if write else self.io.read)(self.files[slot], chunk.offset, record).result()

    def _read_all(self) -> None:
        buffer = self.pool.acquire()
        try:
            for chunk in self.chunks:
                if not self.has_state[chunk.bucket]:
                    continue
                state, numel = self.optimizer.state[self.masters[chunk.bucket]], self.buckets[chunk.bucket].shard_numel
                self._chunk_io(chunk, buffer, write=False)
                for key, region in self._states(chunk, buffer).items():
                    if not torch.is_tensor(state.get(key)) or state[key].numel() != numel:
                        state[key] = torch.empty(numel, dtype=region.dtype)
                    state[key].narrow(0, chunk.start, chunk.numel).copy_(region)
        finally:
            self.pool.release(buffer)

    def _write_all(self) -> set:
        """Write per-element states found in `optimizer.state` to the spare slots; the buckets written."""
        written, buffer = set(), None
        try:
            for chunk in self.chunks:
                state = self.optimizer.state.get(self.masters[chunk.bucket], {})
                keys = [key for key, *_ in self.layouts[self._group(chunk)]]
                if not keys or not all(torch.is_tensor(state.get(key)) for key in keys):
                    continue
                buffer = buffer if buffer is not None else self.pool.acquire()
                regions = self._states(chunk, buffer)
                for key, region in regions.items():
                    region.copy_(state[key].narrow(0, chunk.start, chunk.numel))
                self._chunk_io(chunk, buffer, write=True)
                written.add(chunk.bucket)
        finally:
            if buffer is not None:
                self.pool.release(buffer)
        return written

    def _drop_resident(self, written: set) -> None:
        """Flip the slots of buckets written from memory; keep only scalar states in memory."""
        for bucket in self.slot:
            state = self.optimizer.state.get(self.masters[bucket])
            if bucket in written:
                self.slot[bucket] ^= 1
                self.has_state[bucket] = True
            elif self.has_state[bucket] and not state:
                self.has_state[bucket] = False  # the states were cleared (a load of a fresh checkpoint)
            for key, *_ in self.layouts[self.buckets[bucket].group_index]:
                if state is not None:
                    state.pop(key, None)

    # --- accounting ------------------------------------------------------------------
    def memory_split(self) -> dict[str, int]:
        split = super().memory_split()
        for bucket in self.slot:
            nbytes = sum(d.itemsize for _, d, *_ in self.layouts[self.buckets[bucket].group_index])
            split["nvme"] += nbytes * self.buckets[bucket].shard_numel if self.has_state[bucket] else 0
        split["host_buffers"] += self.pool.total_bytes()
        return split

    def close(self) -> None:
        self._finalizer()


def comm_rank(optimizer) -> int:
    return int(getattr(optimizer.comm, "rank", 0)) if optimizer.comm is not None else 0


def _quietly_wait(futures) -> None:
    for future in futures:
        try:
            future.result()
        except BaseException:  # noqa: BLE001 - the first error is the one raised
            pass


def _cleanup(io: AsyncFileIO, directory: str) -> None:
    io.shutdown()
    shutil.rmtree(directory, ignore_errors=True)
