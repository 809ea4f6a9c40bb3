"""The records of NVMe offload (`nvme.py`): where a chunk's master and states sit, and paging them in.

A chunk's record, in either slot file and in an I/O buffer, is its fp32 master (one aligned
region of `chunk_numel` elements) followed by one aligned region per per-element optimizer state
(the group's layout, `probe_state_layout`). A buffer holds one record of the largest group and,
after it, one fp32 region for the chunk's gradient when it must be copied to the host.

`NvmeRecords` is the part of `NvmeOffloadOptimizer` that maps records to tensors: buffer views,
paging masters and states into host memory for checkpoints (`resident_states`,
`resident_masters`), writing them back into the spare slots, and the memory accounting.
"""
from __future__ import annotations

import shutil
from contextlib import contextmanager

import torch

from .aio import AsyncFileIO


def master_placeholder(numel: int) -> torch.Tensor:
    """What an offloaded master holds between steps: one fp32 element broadcast to `numel` (no memory;
    writing into it fails loudly). The master tensor object stays, as the optimizer's key."""
    return torch.empty((), dtype=torch.float32).expand(numel)


class _Chunk:
    """`numel` elements of bucket `bucket`'s shard from `start`; its record is at `offset` in both slot files."""

    empty = torch.empty(0)

    def __init__(self, bucket: int, index: int, start: int, numel: int):
        self.bucket, self.index, self.start, self.numel = bucket, index, start, numel
        self.offset = 0
        self.param = torch.empty(0)  # a stable tensor: the shadow optimizer's key (its data: the buffer's master)


class NvmeRecords:
    """Record layout, paging in and out, and accounting of `NvmeOffloadOptimizer` (a mixin: see nvme.py)."""

    # --- views into a buffer ---------------------------------------------------------
    def _group(self, chunk: _Chunk) -> int:
        return self.buckets[chunk.bucket].group_index

    def _record(self, chunk: _Chunk, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[:self.record_bytes[self._group(chunk)]]

    def _master_region(self, chunk: _Chunk, buffer: torch.Tensor) -> torch.Tensor:
        """The aligned bytes of the chunk's master at the start of its record (what a master-only read fills)."""
        return buffer[:self.region]

    def _master(self, chunk: _Chunk, buffer: torch.Tensor) -> torch.Tensor:
        return self._master_region(chunk, buffer).view(torch.float32)[:chunk.numel]

    def _states(self, chunk: _Chunk, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of the chunk's per-element states in the buffer's record."""
        return {key: buffer[offset:offset + size].view(dtype)[:chunk.numel]
                for key, dtype, offset, size in self.layouts[self._group(chunk)]}

    def _gradient(self, buffer: torch.Tensor, numel: int) -> torch.Tensor:
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
    def resident_states(self, write_back: bool = True):
        """Masters and per-element states in host memory (`masters`, `optimizer.state[master]`) while inside.

        For checkpoint save (`write_back=False`: only read, the files stay) and load (what is in memory
        on exit goes to the spare slots, which become current only when all were written). On an
        exception inside, or a failed read, the files are left as they were."""
        with self._paged_in(write_back, with_states=True):
            yield self

    @contextmanager
    def resident_masters(self):
        """The fp32 masters in host memory while inside, read only (e.g. to gather the full weights)."""
        with self._paged_in(False, with_states=False):
            yield self

    @contextmanager
    def _paged_in(self, write_back: bool, with_states: bool):
        if self._resident:  # nested: the outer context pages out
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
            self._write_records(written, masters_in_memory=True)
        except BaseException:
            self._page_out(set())
            raise
        self._page_out(written)

    def _page_in(self, with_states: bool) -> None:
        self._resident = True
        for bucket in self.slot:
            master = self.masters[bucket]
            master.data = torch.empty(master.numel(), dtype=torch.float32)
        buffer = self.pool.acquire()
        try:
            for chunk in self.chunks:
                bucket, numel = chunk.bucket, self.buckets[chunk.bucket].shard_numel
                states = with_states and self.has_state[bucket]
                fd = self.files[self.slot[bucket]]
                self.io.read(fd, chunk.offset, self._record(chunk, buffer) if states
                             else self._master_region(chunk, buffer)).result()
                self.masters[bucket].narrow(0, chunk.start, chunk.numel).copy_(self._master(chunk, buffer))
                if not states:
                    continue
                state = self.optimizer.state[self.masters[bucket]]
                for key, region in self._states(chunk, buffer).items():
                    if not torch.is_tensor(state.get(key)) or state[key].numel() != numel:
                        state[key] = torch.empty(numel, dtype=region.dtype)
                    state[key].narrow(0, chunk.start, chunk.numel).copy_(region)
        finally:
            self.pool.release(buffer)

    def _write_records(self, buckets: set, masters_in_memory: bool) -> None:
        """Write the records of `buckets` to their spare slots: masters from memory (else as in the
        current slot), per-element states from `optimizer.state` where all are there (else as they were)."""
        buffer = None
        try:
            for chunk in self.chunks:
                if chunk.bucket not in buckets:
                    continue
                buffer = buffer if buffer is not None else self.pool.acquire()
                record, states = self._record(chunk, buffer), self._states_in_memory(chunk.bucket)
                if not (masters_in_memory and states):
                    self.io.read(self.files[self.slot[chunk.bucket]], chunk.offset, record).result()
                if masters_in_memory:
                    self._master(chunk, buffer).copy_(self.masters[chunk.bucket].narrow(0, chunk.start, chunk.numel))
                if states:
                    state = self.optimizer.state[self.masters[chunk.bucket]]
                    for key, region in self._states(chunk, buffer).items():
                        region.copy_(state[key].narrow(0, chunk.start, chunk.numel))
                self.io.write(self.files[1 - self.slot[chunk.bucket]], chunk.offset, record).result()
        finally:
            if buffer is not None:
                self.pool.release(buffer)

    def _page_out(self, written: set) -> None:
        """Flip the slots of `written` buckets; keep only scalar states (and no masters) in memory."""
        self._drop_kept(written)  # their records in the buffers are no longer the current ones
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
            if self._resident:
                master.data = master_placeholder(master.numel())
        self._resident = False

    def _adopt_states(self) -> None:
        """Per-element states someone put in `optimizer.state` outside resident_states go to disk."""
        written = {bucket for bucket in self.slot if self._states_in_memory(bucket)}
        self._write_records(written, masters_in_memory=False)
        self._page_out(written)

    # --- accounting ------------------------------------------------------------------
    def memory_split(self) -> dict[str, int]:
        """As OffloadOptimizer's, with the offloaded masters and per-element states counted under `nvme`
        (in host memory only while resident) and the I/O buffers under `host_buffers`."""
        split = super().memory_split()
        for bucket in self.slot:
            numel = self.buckets[bucket].shard_numel
            if not self._resident:
                split["host"] -= numel * 4  # OffloadOptimizer counts a host master: here a placeholder
            per_element = sum(d.itemsize for _, d, *_ in self.layouts[self.buckets[bucket].group_index])
            split["nvme"] += (4 + (per_element if self.has_state[bucket] else 0)) * numel
        split["host_buffers"] += self.pool.total_bytes()
        return split


def _cleanup(io: AsyncFileIO, directory: str) -> None:
    io.shutdown()
    shutil.rmtree(directory, ignore_errors=True)
