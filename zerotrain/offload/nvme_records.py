"""The records of NVMe offload (`nvme.py`): where a chunk's master and states sit, and paging them in.

A chunk's record, in either slot file and in an I/O buffer, is its fp32 master (one aligned
region of `chunk_numel` elements) followed by one aligned region per per-element optimizer state
(the group's layout, `probe_state_layout`). A buffer holds one record of the largest group and,
after it, one fp32 region for the chunk's gradient when it must be copied to the host.

`NvmeRecords` is what `NvmeOffloadOptimizer` holds its records in (a member, `optimizer.records`): the
swap directory, the two slot files and which slot is current per bucket, the I/O engine, the buffer
pool and the records still kept in it after a step (`nvme_stream.py`), the views of a record in a
buffer, paging masters and states into host memory for checkpoints (`paged_in`) and writing them back
into the spare slots, and the memory accounting of what lives on disk.
"""
from __future__ import annotations

import os
import shutil
import weakref
from contextlib import contextmanager
from typing import Iterable, Optional, Sequence

import torch

from .aio import ALIGN, AlignedBuffers, AsyncFileIO, OffloadIOError, open_swap_directory, round_up
from .partial import probe_state_layout

DEFAULT_CHUNK_NUMEL = 1 << 22  # 4M elements: 16 MiB per fp32 region per chunk


def master_placeholder(numel: int) -> torch.Tensor:
    """What an offloaded master holds between steps: one fp32 element broadcast to `numel` (no memory;
    writing into it fails loudly). The master tensor object stays, as the optimizer's key."""
    return torch.empty((), dtype=torch.float32).expand(numel)


class Chunk:
    """`numel` elements of bucket `bucket`'s shard from `start`; its record is at `offset` in both slot files."""

    empty = torch.empty(0)

    def __init__(self, bucket: int, index: int, start: int, numel: int):
        self.bucket, self.index, self.start, self.numel = bucket, index, start, numel
        self.offset = 0
        self.param = torch.empty(0)  # a stable tensor: the shadow optimizer's key (its data: the buffer's master)


class NvmeRecords:
    """The records of the offloaded buckets: files, slots, the buffer pool, views and paging.

    `buckets`, `masters` and `optimizer` are the optimizer's (masters are keyed in `optimizer.state`);
    `offloaded[i]`: whether bucket i lives on disk. The files are allocated in full here, so a disk too
    small fails at once with the sizes."""

    def __init__(self, buckets: Sequence, masters: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                 offloaded: Sequence[bool], *, nvme_path: str, rank: int, buffer_count: int = 4, aio=None,
                 chunk_numel: Optional[int] = None, direct: Optional[bool] = None, pin_memory: bool = False):
        self.buckets, self.masters, self.optimizer, self.rank = buckets, masters, optimizer, rank
        shards = [b.shard_numel for b, off in zip(buckets, offloaded) if off] or [1]
        self.chunk_numel = round_up(min(chunk_numel or DEFAULT_CHUNK_NUMEL, max(shards)), ALIGN // 4)
        self.region = round_up(self.chunk_numel * 4)  # one fp32 chunk: the master, the gradient
        self.layouts: dict[int, list[tuple[str, torch.dtype, int, int]]] = {}  # key, dtype, offset, bytes
        self.record_bytes: dict[int, int] = {}
        for group in {b.group_index for b, off in zip(buckets, offloaded) if off}:
            offset, layout = self.region, []  # the master first, then the states
            for key, dtype in probe_state_layout(optimizer, group):
                size = round_up(self.chunk_numel * dtype.itemsize)
                layout.append((key, dtype, offset, size))
                offset += size
            self.layouts[group], self.record_bytes[group] = layout, offset
        self.chunks: list[Chunk] = []
        for index, (bucket, off) in enumerate(zip(buckets, offloaded)):
            for number, start in enumerate(range(0, bucket.shard_numel, self.chunk_numel) if off else ()):
                self.chunks.append(Chunk(index, number, start, min(self.chunk_numel, bucket.shard_numel - start)))
        self.directory, self.io = open_swap_directory(nvme_path, f"zerotrain-optim-r{rank}-", aio, direct,
                                                      "NVMe offload")
        self._finalizer = weakref.finalize(self, _cleanup, self.io, self.directory)
        self.files: tuple[int, int] = (-1, -1)  # slot 0, slot 1
        self._open_files()
        self.slot = {chunk.bucket: 0 for chunk in self.chunks}  # each offloaded bucket's current slot file
        self.has_state = {bucket: False for bucket in self.slot}
        largest = max(self.record_bytes.values(), default=ALIGN)
        self.pool = AlignedBuffers(max(2, int(buffer_count)), largest + self.region, pin=pin_memory)
        self.resident = False  # masters hold their values (inside paged_in)
        self.kept: dict[Chunk, torch.Tensor] = {}  # records still in pool buffers after a step (nvme_stream.py)

    def _open_files(self) -> None:
        """Two slot files for all buckets; each chunk's record has its offset in both."""
        size = 0
        for chunk in self.chunks:
            chunk.offset = size
            size += self.record_bytes[self.buckets[chunk.bucket].group_index]
        needed, free = 2 * size, shutil.disk_usage(self.directory).free
        if needed > free:
            self.close()
            raise OffloadIOError(f"NVMe offload: rank {self.rank} needs {needed / 2**20:.1f} MiB under "
                                 f"{os.path.dirname(self.directory)} for its fp32 masters and optimizer states; "
                                 f"only {free / 2**20:.1f} MiB are free")
        try:
            if self.chunks:
                path = os.path.join(self.directory, "states")
                self.files = (self.io.open(path + ".slot0", size), self.io.open(path + ".slot1", size))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the I/O threads and remove the swap directory."""
        self._finalizer()

    def current(self, chunk: Chunk) -> int:
        """The file holding the chunk's current record."""
        return self.files[self.slot[chunk.bucket]]

    def spare(self, chunk: Chunk) -> int:
        """The file a step (or a write from outside) writes the chunk's next record to."""
        return self.files[1 - self.slot[chunk.bucket]]

    def drop_kept(self, buckets: Optional[Iterable[int]] = None) -> None:
        """Give the buffers of the kept records (of `buckets`, else all) back to the pool: their chunks'
        current records changed outside a step, or a step did not commit."""
        wanted = None if buckets is None else set(buckets)
        for chunk in [c for c in self.kept if wanted is None or c.bucket in wanted]:
            self.pool.release(self.kept.pop(chunk))

    # --- views into a buffer ---------------------------------------------------------
    def group(self, chunk: Chunk) -> int:
        return self.buckets[chunk.bucket].group_index

    def record(self, chunk: Chunk, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[:self.record_bytes[self.group(chunk)]]

    def master_region(self, chunk: Chunk, buffer: torch.Tensor) -> torch.Tensor:
        """The aligned bytes of the chunk's master at the start of its record (what a master-only read fills)."""
        return buffer[:self.region]

    def master(self, chunk: Chunk, buffer: torch.Tensor) -> torch.Tensor:
        return self.master_region(chunk, buffer).view(torch.float32)[:chunk.numel]

    def states(self, chunk: Chunk, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of the chunk's per-element states in the buffer's record."""
        return {key: buffer[offset:offset + size].view(dtype)[:chunk.numel]
                for key, dtype, offset, size in self.layouts[self.group(chunk)]}

    def gradient(self, buffer: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 gradient region after the largest record."""
        start = max(self.record_bytes.values())
        return buffer[start:start + self.region].view(torch.float32)[:numel]

    def _state_keys(self, bucket: int) -> list[str]:
        return [key for key, *_ in self.layouts[self.buckets[bucket].group_index]]

    def _states_in_memory(self, bucket: int) -> bool:
        """Whether `optimizer.state[master]` holds every per-element state of the bucket."""
        state, keys = self.optimizer.state.get(self.masters[bucket], {}), self._state_keys(bucket)
        return bool(keys) and all(torch.is_tensor(state.get(key)) for key in keys)

    # --- masters and states in host memory, for checkpoints and full weights ---------------
    @contextmanager
    def paged_in(self, write_back: bool, with_states: bool):
        """Masters (and, `with_states`, per-element states) in host memory while inside; with `write_back`,
        what is in memory on exit goes to the spare slots, which become current only when all were
        written. On an exception inside, or a failed read, the files are left as they were."""
        if self.resident:  # nested: the outer context pages out
            yield
            return
        try:
            self._page_in(with_states)
            yield
        except BaseException:
            self._page_out(set())
            raise
        written = set(self.slot) if write_back else set()
        try:
            self.write_records(written, masters_in_memory=True)
        except BaseException:
            self._page_out(set())
            raise
        self._page_out(written)

    def _page_in(self, with_states: bool) -> None:
        self.resident = True
        for bucket in self.slot:
            master = self.masters[bucket]
            master.data = torch.empty(master.numel(), dtype=torch.float32)
        buffer = self.pool.acquire()
        try:
            for chunk in self.chunks:
                bucket, numel = chunk.bucket, self.buckets[chunk.bucket].shard_numel
                states = with_states and self.has_state[bucket]
                self.io.read(self.current(chunk), chunk.offset, self.record(chunk, buffer) if states
                             else self.master_region(chunk, buffer)).result()
                self.masters[bucket].narrow(0, chunk.start, chunk.numel).copy_(self.master(chunk, buffer))
                if not states:
                    continue
                state = self.optimizer.state[self.masters[bucket]]
                for key, region in self.states(chunk, buffer).items():
                    if not torch.is_tensor(state.get(key)) or state[key].numel() != numel:
                        state[key] = torch.empty(numel, dtype=region.dtype)
                    state[key].narrow(0, chunk.start, chunk.numel).copy_(region)
        finally:
            self.pool.release(buffer)

    def write_records(self, buckets: set, masters_in_memory: bool) -> None:
        """Write the records of `buckets` to their spare slots: masters from memory (else as in the
        current slot), per-element states from `optimizer.state` where all are there (else as they were)."""
        buffer = None
        try:
            for chunk in self.chunks:
                if chunk.bucket not in buckets:
                    continue
                buffer = buffer if buffer is not None else self.pool.acquire()
                record, states = self.record(chunk, buffer), self._states_in_memory(chunk.bucket)
                if not (masters_in_memory and states):
                    self.io.read(self.current(chunk), chunk.offset, record).result()
                if masters_in_memory:
                    self.master(chunk, buffer).copy_(self.masters[chunk.bucket].narrow(0, chunk.start, chunk.numel))
                if states:
                    state = self.optimizer.state[self.masters[chunk.bucket]]
                    for key, region in self.states(chunk, buffer).items():
                        region.copy_(state[key].narrow(0, chunk.start, chunk.numel))
                self.io.write(self.spare(chunk), chunk.offset, record).result()
        finally:
            if buffer is not None:
                self.pool.release(buffer)

    def _page_out(self, written: set) -> None:
        """Flip the slots of `written` buckets; keep only scalar states (and no masters) in memory."""
        self.drop_kept(written)  # their records in the buffers are no longer the current ones
        for bucket in self.slot:
            master = self.masters[bucket]
            state = self.optimizer.state.get(master)
            if bucket in written:
                self.slot[bucket] ^= 1
                self.has_state[bucket] = self._states_in_memory(bucket)
            elif self.has_state[bucket] and not state:
                self.has_state[bucket] = False  # the states were cleared (a load of a fresh checkpoint)
            for key in self._state_keys(bucket):
                if state is not None:
                    state.pop(key, None)
            if self.resident:
                master.data = master_placeholder(master.numel())
        self.resident = False

    def adopt_states(self) -> None:
        """Per-element states someone put in `optimizer.state` outside paged_in go to disk."""
        written = {bucket for bucket in self.slot if self._states_in_memory(bucket)}
        self.write_records(written, masters_in_memory=False)
        self._page_out(written)

    # --- accounting ------------------------------------------------------------------
    def account(self, split: dict[str, int]) -> dict[str, int]:
        """An OffloadOptimizer memory split, corrected: the offloaded masters and per-element states counted
        under `nvme` (in host memory only while resident) and the I/O buffers under `host_buffers`."""
        for bucket in self.slot:
            numel = self.buckets[bucket].shard_numel
            if not self.resident:
                split["host"] -= numel * 4  # OffloadOptimizer counts a host master: here a placeholder
            per_element = sum(d.itemsize for _, d, *_ in self.layouts[self.buckets[bucket].group_index])
            split["nvme"] += (4 + (per_element if self.has_state[bucket] else 0)) * numel
        split["host_buffers"] += self.pool.total_bytes()
        return split


def _cleanup(io: AsyncFileIO, directory: str) -> None:
    io.shutdown()
    shutil.rmtree(directory, ignore_errors=True)
