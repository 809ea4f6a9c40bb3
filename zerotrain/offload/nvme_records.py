"""The records of NVMe offload (`nvme.py`): where a chunk's master and states sit, and paging them in.

A chunk's record, in the swap file and in an I/O buffer, is its fp32 master (one aligned region)
followed by one aligned region per per-element optimizer state (the group's layout,
`probe_state_layout`). With `master_dtype` bf16 (`bf16.bf16_master_weights_and_grads`) the master region
is bf16, and with `state_dtype` bf16 (`bf16.bf16_optimizer_states`) so are the fp32 states: 6 bytes per
Adam parameter instead of 12. Such a record is stepped in fp32 (`widen`: an fp32 working copy in a
scratch buffer) and stored back rounded stochastically (`store`, `stochastic_round.py`); in host memory
(`paged_in`) masters and states are fp32 as always. A buffer holds one record of the largest size and, after it, one fp32
region for the chunk's gradient when it must be copied to the host. A bucket's shard is cut into
chunks of equal size (at most `chunk_numel` elements), so its records all have one size, and the
same-shaped shards of every layer share it: the record size classes are few.

One swap file per rank holds, packed, one extent per chunk (its current record) and `spare`
extra extents per size class: a ring of spare extents. A step never overwrites a current record:
it writes the chunk's new record into a free extent of its class and the chunk's index entry
(`location`) moves there only at the commit (`commit`), which frees the old extent. So disk use
is the records once (12 bytes per fp32 parameter with Adam) plus `spare` records per class,
whatever the model size; the two full slot files it replaces doubled it. When a class has no free
extent the oldest pending record of that class is committed early (its write is waited for), so
a step larger than the ring commits in order, as it goes: a failure then rolls back exactly the
chunks not committed yet, and the chunks committed early are remembered (`resume`) so that the
retried step (the same gradients: the engine keeps them) skips them, and the run goes on exactly
as if nothing had failed (`nvme.py`). A step whose chunks per class fit in the ring (`spare`
≥ chunks, e.g. small models) commits nothing early: it rolls back whole, as before.

`NvmeRecords` is what `NvmeOffloadOptimizer` holds its records in (a member, `optimizer.records`): the
swap directory, the file, the extents and the index, the I/O engine, the buffer pool and the records
still kept in it after a step (`nvme_stream.py`), the views of a record in a buffer, paging masters
and states into host memory for checkpoints (`paged_in`) and writing them back, and the memory
accounting of what lives on disk.
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
from .stochastic_round import round_bf16_, rounding_seed

DEFAULT_CHUNK_NUMEL = 1 << 22  # 4M elements: 16 MiB per fp32 region per chunk
# Spare extents per record size class. Two: a write of a class waits at most for the write of that class
# issued two records before it (the disk is saturated by two 48 MiB records in flight), and the spares cost
# two records per class (a transformer has ~4 classes of large records), whatever the model size.
DEFAULT_SPARE_RECORDS = 2


def master_placeholder(numel: int) -> torch.Tensor:
    """What an offloaded master holds between steps: one fp32 element broadcast to `numel` (no memory;
    writing into it fails loudly). The master tensor object stays, as the optimizer's key."""
    return torch.empty((), dtype=torch.float32).expand(numel)


class Chunk:
    """`numel` elements of bucket `bucket`'s shard from `start`; its record's size class is `size_class`
    (every chunk of a bucket has the bucket's: `(group, elements per chunk)`)."""

    empty = torch.empty(0)

    def __init__(self, bucket: int, index: int, start: int, numel: int, size_class: tuple[int, int]):
        self.bucket, self.index, self.start, self.numel = bucket, index, start, numel
        self.size_class = size_class
        self.param = torch.empty(0)  # a stable tensor: the shadow optimizer's key (its data: the buffer's master)


class NvmeRecords:
    """The records of the offloaded buckets: files, slots, the buffer pool, views and paging.

    `buckets`, `masters` and `optimizer` are the optimizer's (masters are keyed in `optimizer.state`);
    `offloaded[i]`: whether bucket i lives on disk. The files are allocated in full here, so a disk too
    small fails at once with the sizes."""

    def __init__(self, buckets: Sequence, masters: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                 offloaded: Sequence[bool], *, nvme_path: str, rank: int, buffer_count: int = 4, aio=None,
                 chunk_numel: Optional[int] = None, direct: Optional[bool] = None, pin_memory: bool = False,
                 spare: Optional[int] = None, master_dtype: torch.dtype = torch.float32,
                 state_dtype: Optional[torch.dtype] = None):
        self.buckets, self.masters, self.optimizer, self.rank = buckets, masters, optimizer, rank
        # what the records store: the master's dtype, and the fp32 states' (None: the optimizer's own)
        self.master_dtype, self.state_dtype = master_dtype, state_dtype
        self.narrow_records = master_dtype != torch.float32 or state_dtype not in (None, torch.float32)
        self._scratch: Optional[torch.Tensor] = None  # fp32 working copy of a narrow record (`widen`)
        shards = [b.shard_numel for b, off in zip(buckets, offloaded) if off] or [1]
        self.chunk_numel = round_up(min(chunk_numel or DEFAULT_CHUNK_NUMEL, max(shards)), ALIGN // 4)
        self.region = round_up(self.chunk_numel * 4)  # one fp32 chunk: the master, the gradient
        self.layouts: dict[int, list[tuple[str, torch.dtype, int, int]]] = {}  # key, stored dtype, offset, bytes
        self.memory_dtypes: dict[int, dict[str, torch.dtype]] = {}  # group -> key -> the optimizer's own dtype
        self.record_bytes: dict[int, int] = {}  # the largest record of each group (chunk_numel elements)
        self._probed: dict[int, list[tuple[str, torch.dtype]]] = {}
        for group in {b.group_index for b, off in zip(buckets, offloaded) if off}:
            self._probed[group] = probe_state_layout(optimizer, group)
            self.memory_dtypes[group] = dict(self._probed[group])
            self.layouts[group], self.record_bytes[group] = self._layout(group, self.chunk_numel)
        self._class_layouts: dict[tuple[int, int], tuple[list, int]] = {}  # size class -> (layout, record bytes)
        self.chunks: list[Chunk] = []
        for index, (bucket, off) in enumerate(zip(buckets, offloaded)):
            if not off:
                continue
            pieces = -(-bucket.shard_numel // self.chunk_numel)  # equal chunks: one record size per bucket
            per = round_up(-(-bucket.shard_numel // pieces), ALIGN // 4)
            size_class = (bucket.group_index, per)
            if size_class not in self._class_layouts:
                self._class_layouts[size_class] = self._layout(bucket.group_index, per)
            for number, start in enumerate(range(0, bucket.shard_numel, per)):
                self.chunks.append(Chunk(index, number, start, min(per, bucket.shard_numel - start), size_class))
        self.spare = max(1, int(DEFAULT_SPARE_RECORDS if spare is None else spare))
        self.directory, self.io = open_swap_directory(nvme_path, f"zerotrain-optim-r{rank}-", aio, direct,
                                                      "NVMe offload", "zero_optimization.offload_optimizer.nvme_path")
        self._finalizer = weakref.finalize(self, _cleanup, self.io, self.directory)
        self.files: tuple[int, ...] = ()  # the swap file (a tuple: what tests inject faults into)
        self.extent_offsets: list[int] = []  # byte offset of each extent in the file
        self.location: dict[Chunk, int] = {}  # the extent holding each chunk's current record
        self.free: dict[tuple[int, int], list[int]] = {}  # free extents per size class (the ring of spares)
        self._open_files()
        self.on_disk = sorted({chunk.bucket for chunk in self.chunks})  # the offloaded buckets
        self.has_state = {bucket: False for bucket in self.on_disk}
        largest = max(self.record_bytes.values(), default=ALIGN)
        self.pool = AlignedBuffers(max(2, int(buffer_count)), largest + self.region, pin=pin_memory)
        self.resident = False  # masters hold their values (inside paged_in)
        self.kept: dict[Chunk, torch.Tensor] = {}  # records still in pool buffers after a step (nvme_stream.py)
        self.prefetched: dict[Chunk, tuple] = {}  # (buffer, read) of records read ahead in a streamed step
        # chunks a failed step committed early, with the step's scalar states, for its retry (nvme.py)
        self.resume: set[Chunk] = set()
        self.resume_scalars: dict[int, dict] = {}

    def _layout(self, group: int, numel: int) -> tuple[list[tuple[str, torch.dtype, int, int]], int]:
        """The layout of a record of `numel` elements of `group`: the master first, then each state."""
        offset, layout = round_up(numel * self.master_dtype.itemsize), []
        for key, dtype in self._probed[group]:
            if dtype == torch.float32 and self.state_dtype is not None:
                dtype = self.state_dtype
            size = round_up(numel * dtype.itemsize)
            layout.append((key, dtype, offset, size))
            offset += size
        return layout, offset

    def _open_files(self) -> None:
        """The swap file: one extent per chunk (packed), then `spare` extents per size class."""
        size = 0
        for chunk in self.chunks:
            self.location[chunk] = len(self.extent_offsets)
            self.extent_offsets.append(size)
            size += self.record_nbytes(chunk)
        for size_class, (_, nbytes) in self._class_layouts.items():
            self.free[size_class] = []
            for _ in range(self.spare):
                self.free[size_class].append(len(self.extent_offsets))
                self.extent_offsets.append(size)
                size += nbytes
        needed, free = size, shutil.disk_usage(self.directory).free
        if needed > free:
            self.close()
            raise OffloadIOError(f"NVMe offload: rank {self.rank} needs {needed / 2**20:.1f} MiB under "
                                 f"{os.path.dirname(self.directory)} for its fp32 masters and optimizer states; "
                                 f"only {free / 2**20:.1f} MiB are free")
        self.file_bytes = size
        try:
            if self.chunks:
                self.files = (self.io.open(os.path.join(self.directory, "states.ring"), size),)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the I/O threads and remove the swap directory."""
        self._finalizer()

    # --- the extents and the index ------------------------------------------------------
    @property
    def fd(self) -> int:
        return self.files[0]

    def current(self, chunk: Chunk) -> int:
        """The byte offset of the chunk's current record in the file."""
        return self.extent_offsets[self.location[chunk]]

    def claim(self, chunk: Chunk) -> Optional[int]:
        """A free extent of the chunk's size class for its next record, or None when the ring is empty."""
        free = self.free[chunk.size_class]
        return free.pop() if free else None

    def commit(self, chunk: Chunk, extent: int) -> None:
        """The chunk's current record is now the one in `extent` (written); its old extent is free."""
        self.free[chunk.size_class].append(self.location[chunk])
        self.location[chunk] = extent

    def abort(self, chunk: Chunk, extent: int) -> None:
        """A record written to `extent` is not committed: the extent is free again."""
        self.free[chunk.size_class].append(extent)

    def rewrite(self, chunk: Chunk, record: torch.Tensor) -> None:
        """Write the chunk's new record (outside a step) to a free extent and commit it once written."""
        extent = self.claim(chunk)
        if extent is None:  # every step commits or aborts all it claimed: a free extent is always there
            raise RuntimeError(f"NVMe offload: no free extent for chunk {chunk.index} of bucket {chunk.bucket}")
        try:
            self.io.write(self.fd, self.extent_offsets[extent], record).result()
        except BaseException:
            self.abort(chunk, extent)
            raise
        self.commit(chunk, extent)

    def disk_bytes(self) -> int:
        """Bytes of the swap file: the records once plus the spare extents."""
        return self.file_bytes

    def drop_prefetched(self) -> None:
        """Wait for the reads ahead not taken by the step and give their buffers back (a step's end)."""
        for buffer, future in self.prefetched.values():
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - a record not stepped: its failed read changes nothing
                pass
            self.pool.release(buffer)
        self.prefetched.clear()

    def drop_kept(self, buckets: Optional[Iterable[int]] = None) -> None:
        """Give the buffers of the kept records (of `buckets`, else all) back to the pool: their chunks'
        current records changed outside a step, or a step did not commit."""
        wanted = None if buckets is None else set(buckets)
        for chunk in [c for c in self.kept if wanted is None or c.bucket in wanted]:
            self.pool.release(self.kept.pop(chunk))

    # --- views into a buffer ---------------------------------------------------------
    def group(self, chunk: Chunk) -> int:
        return self.buckets[chunk.bucket].group_index

    def record_nbytes(self, chunk: Chunk) -> int:
        return self._class_layouts[chunk.size_class][1]

    def record(self, chunk: Chunk, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[:self.record_nbytes(chunk)]

    def master_region(self, chunk: Chunk, buffer: torch.Tensor) -> torch.Tensor:
        """The aligned bytes of the chunk's master at the start of its record (what a master-only read fills)."""
        return buffer[:round_up(chunk.size_class[1] * self.master_dtype.itemsize)]

    def master(self, chunk: Chunk, buffer: torch.Tensor) -> torch.Tensor:
        """The chunk's master in the buffer, in the records' dtype."""
        return self.master_region(chunk, buffer).view(self.master_dtype)[:chunk.numel]

    def widen(self, chunk: Chunk, buffer: torch.Tensor, fresh: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """fp32 working copies of the chunk's master and states in the buffer's narrow record, in a scratch
        buffer (one: the steps run one at a time); states zero where `fresh`. `store` writes them back."""
        count = 1 + len(self.states(chunk, buffer))
        if self._scratch is None or self._scratch.numel() < count * self.chunk_numel:
            self._scratch = torch.empty(count * self.chunk_numel, dtype=torch.float32)
        views = [self._scratch[i * self.chunk_numel:i * self.chunk_numel + chunk.numel] for i in range(count)]
        master = views[0].copy_(self.master(chunk, buffer))
        memory = self.memory_dtypes[self.group(chunk)]
        states = {}
        for view, (key, region) in zip(views[1:], self.states(chunk, buffer).items()):
            if region.dtype == memory[key]:  # stored as the optimizer keeps it: stepped in place
                view = region
            states[key] = view.zero_() if fresh else view.copy_(region)
        return master, states

    def store(self, chunk: Chunk, buffer: torch.Tensor, master: torch.Tensor, states: dict[str, torch.Tensor],
              step: int) -> None:
        """The stepped fp32 `master` and `states` (from `widen`) into the buffer's record: bf16 regions rounded
        stochastically with a seed of (rank, chunk, optimizer step), so a repeated step stores the same bits."""
        regions = self.states(chunk, buffer)
        pairs = [(self.master(chunk, buffer), master)] + [(regions[key], states[key]) for key in regions]
        for which, (region, value) in enumerate(pairs):
            if region.dtype == torch.bfloat16 and value.dtype == torch.float32:
                round_bf16_(value, region, rounding_seed(self.rank, chunk.bucket, chunk.index, step, which))
            else:
                region.copy_(value)

    def states(self, chunk: Chunk, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of the chunk's per-element states in the buffer's record."""
        return {key: buffer[offset:offset + size].view(dtype)[:chunk.numel]
                for key, dtype, offset, size in self._class_layouts[chunk.size_class][0]}

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
        what is in memory on exit is written, each chunk's record committed once written (a checkpoint
        load: a failed write leaves the records partly loaded, and the load must be repeated). On an
        exception inside, or a failed read, the files are left as they were."""
        if self.resident:  # nested: the outer context pages out
            yield
            return
        try:
            self._page_in(with_states)
            yield
        except BaseException:
            self._page_out(set())
            raise
        written = set(self.on_disk) if write_back else set()
        try:
            self.write_records(written, masters_in_memory=True)
        except BaseException:
            self._page_out(set())
            raise
        self._page_out(written)

    def _page_in(self, with_states: bool) -> None:
        self.resident = True
        for bucket in self.on_disk:
            master = self.masters[bucket]
            master.data = torch.empty(master.numel(), dtype=torch.float32)
        buffer = self.pool.acquire()
        try:
            for chunk in self.chunks:
                bucket, numel = chunk.bucket, self.buckets[chunk.bucket].shard_numel
                states = with_states and self.has_state[bucket]
                self.io.read(self.fd, self.current(chunk), self.record(chunk, buffer) if states
                             else self.master_region(chunk, buffer)).result()
                self.masters[bucket].narrow(0, chunk.start, chunk.numel).copy_(self.master(chunk, buffer))
                if not states:
                    continue
                state = self.optimizer.state[self.masters[bucket]]
                for key, region in self.states(chunk, buffer).items():
                    dtype = self.memory_dtypes[self.buckets[bucket].group_index][key]
                    if not torch.is_tensor(state.get(key)) or state[key].numel() != numel:
                        state[key] = torch.empty(numel, dtype=dtype)
                    state[key].narrow(0, chunk.start, chunk.numel).copy_(region)
        finally:
            self.pool.release(buffer)

    def write_records(self, buckets: set, masters_in_memory: bool) -> None:
        """Write the records of `buckets`, each committed once written: masters from memory (else as in the
        current record), per-element states from `optimizer.state` where all are there (else as they were)."""
        buffer = None
        try:
            for chunk in self.chunks:
                if chunk.bucket not in buckets:
                    continue
                buffer = buffer if buffer is not None else self.pool.acquire()
                record, states = self.record(chunk, buffer), self._states_in_memory(chunk.bucket)
                if not (masters_in_memory and states):
                    self.io.read(self.fd, self.current(chunk), record).result()
                if masters_in_memory:
                    self.master(chunk, buffer).copy_(self.masters[chunk.bucket].narrow(0, chunk.start, chunk.numel))
                if states:
                    state = self.optimizer.state[self.masters[chunk.bucket]]
                    for key, region in self.states(chunk, buffer).items():
                        region.copy_(state[key].narrow(0, chunk.start, chunk.numel))
                self.rewrite(chunk, record)
        finally:
            if buffer is not None:
                self.pool.release(buffer)

    def _page_out(self, written: set) -> None:
        """After `written` buckets were written back: keep only scalar states (and no masters) in memory."""
        self.drop_kept(written)  # their records in the buffers are no longer the current ones
        if written:  # everything was rewritten (a checkpoint load): no failed step is waiting for its retry
            self.resume.clear()
            self.resume_scalars.clear()
        for bucket in self.on_disk:
            master = self.masters[bucket]
            state = self.optimizer.state.get(master)
            if bucket in written:
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
        written = {bucket for bucket in self.on_disk if self._states_in_memory(bucket)}
        self.write_records(written, masters_in_memory=False)
        self._page_out(written)

    # --- accounting ------------------------------------------------------------------
    def account(self, split: dict[str, int]) -> dict[str, int]:
        """An OffloadOptimizer memory split, corrected: the offloaded masters and per-element states counted
        under `nvme` (in host memory only while resident; in the records' dtypes) and the I/O buffers (and
        the fp32 scratch of narrow records) under `host_buffers`."""
        for bucket in self.on_disk:
            numel = self.buckets[bucket].shard_numel
            if not self.resident:
                split["host"] -= numel * 4  # OffloadOptimizer counts a host master: here a placeholder
            per_element = sum(d.itemsize for _, d, *_ in self.layouts[self.buckets[bucket].group_index])
            split["nvme"] += (self.master_dtype.itemsize + (per_element if self.has_state[bucket] else 0)) * numel
        split["host_buffers"] += self.pool.total_bytes()
        if self._scratch is not None:
            split["host_buffers"] += self._scratch.numel() * 4
        return split


def _cleanup(io: AsyncFileIO, directory: str) -> None:
    io.shutdown()
    shutil.rmtree(directory, ignore_errors=True)


class GradientSpill:
    """Clipping without the whole model's gradients in host memory: each offloaded chunk's final gradient
    shard written, in the dtype it was reduced in (lossless), to disk while the backward goes on; the step
    (`nvme_stream.py`) reads it back into the buffer's gradient region with the chunk's record, once the norm
    and so the clip multiplier are known (`nvme.py`).

    Where it is written: a parameter whose shard an NVMe parameter store keeps (offload_param nvme, stage 3:
    one parameter per bucket) lends its shard's extent (`slots`): after the parameter's final gradient the
    bf16/fp16 values there are not needed until the step writes the new ones (the master holds the truth
    and the publish rewrites the extent from it), and the gradient comes in the parameter's dtype, so it has
    the same size: no extra disk. The others (persistent parameters, params on the device, an extent too
    small for a chunk's aligned read) get extents in a spill file beside the records. Accumulation > 1, fp16
    and the bf16 overflow check do not spill (`nvme.spills_gradients`: the gradients are held).

    Where the parameters are on NVMe too the default is no longer the spill but the norm from a first pass
    (`nvme.takes_norm_first`, `offload_optimizer.norm_first_pass` "auto"): the disk-bound step then keeps its
    overlap with backward at the cost of one more backward's parameter reads (benchmarks/RESULTS_scale.md, "The
    norm from a first pass"); the spill remains for the other runs and for `norm_first_pass: false`.

    Why a spill and not speculation or a first pass (as first weighed): the clip acts on most steps early in training (every
    step of our 2.4B/7B runs), so SuperOffload's speculate-then-validate would redo nearly every step and
    needs the gradients kept for the redo anyway, and its rollback needs the old records, which the ring
    of spares keeps only for small models; a first pass for the norm doubles the forward and backward. Weighed
    again for the step time (issue 43, benchmarks/RESULTS_scale.md "Where the clipped step's time goes"): the
    exact fix-up of a step taken during backward with multiplier 1 (m += (1-b1)(c-1)g, v += (1-b2)(c²-1)g²,
    p += lr(u_spec - u), no second copy of the records) reads and writes every record again once the norm says
    c < 1 (the same bytes as the step after the norm, plus the speculative pass's own), and the speculative
    publish overwrites the parameter extent that holds the gradient (a spill file then: +2 B/param on disk,
    over the 14.5 target); so it is slower on every clipped step and only wins where the norm stays under the
    threshold. Reordering buys nothing either: the first `pool.count - 1` chunks of a step are the kept
    records (no read), and with O_DIRECT no spilled gradient is in the page cache. The
    spill adds one write and one read of the gradient (2 bytes per parameter in bf16 training, 4 in
    fp32) to a step that moves 24 (fp32 records) or 12 (bf16 records) bytes per parameter; host memory for
    gradients is the handed-over shards not written yet (bounded like the streamed step's) plus two aligned
    staging buffers."""

    def __init__(self, records: NvmeRecords, dtypes: dict[int, torch.dtype],
                 extents: Optional[dict[int, object]] = None):
        """`dtypes`: bucket -> the dtype its reduced gradient shard comes in (the extents' element size);
        `extents`: bucket -> its parameter shard's `ShardExtent` where an NVMe parameter store keeps it."""
        self.records, self.dtypes = records, dtypes
        self.slots = {bucket for bucket, extent in (extents or {}).items()
                      if extent is not None and self._fits(bucket, extent)}
        self.lent: dict[int, object] = {}  # bucket -> the ShardExtent lent for this step (`lend`)
        self._lead: dict[Chunk, int] = {}  # bytes before a slot chunk's gradient in its aligned read
        self.offsets: dict[Chunk, int] = {}
        size = 0
        for chunk in records.chunks:
            if chunk.bucket not in self.slots:
                self.offsets[chunk] = size
                size += self._nbytes(chunk)
        self.file_bytes = size
        self.slot_bytes_read = self.slot_bytes_written = 0  # through the parameter store's files
        self.ready: set[Chunk] = set()  # chunks whose spilled gradient is this step's
        self.staging = AlignedBuffers(2, max((self._nbytes(c) for c in records.chunks), default=ALIGN),
                                      pin=False)
        self._scratch: Optional[torch.Tensor] = None  # fp32 cast of a narrow spilled gradient
        free = shutil.disk_usage(records.directory).free
        if size > free:
            raise OffloadIOError(f"NVMe offload: rank {records.rank} needs {size / 2**20:.1f} MiB more under "
                                 f"{os.path.dirname(records.directory)} to spill the gradients for clipping "
                                 f"(gradient_clipping > 0); only {free / 2**20:.1f} MiB are free")
        self.fd = records.io.open(os.path.join(records.directory, "grads.spill"), max(size, ALIGN)) if size else -1

    def _fits(self, bucket: int, extent) -> bool:
        """Whether every chunk of `bucket` reads back from the extent, aligned, into a buffer's gradient region."""
        isz = self.dtypes[bucket].itemsize
        for chunk in (c for c in self.records.chunks if c.bucket == bucket):
            lo = chunk.start * isz
            if round_up(lo % ALIGN + chunk.numel * isz) > self.records.region or \
                    round_up(lo + chunk.numel * isz) > extent.nbytes:
                return False
        return True

    def _nbytes(self, chunk: Chunk) -> int:
        return round_up(chunk.size_class[1] * self.dtypes[chunk.bucket].itemsize)

    def lend(self, bucket: int, extent) -> None:
        """This step's gradient of slot bucket `bucket` goes to `extent` (lent by its store until it is written)."""
        self.lent[bucket] = extent

    def write_shard(self, bucket: int, grad: torch.Tensor) -> list:
        """Spill bucket `bucket`'s whole gradient shard `grad`: into its lent extent (aligned pieces of a staging
        buffer) or, chunk by chunk, into the spill file; the writes' futures."""
        if grad.dtype != self.dtypes[bucket]:
            raise RuntimeError(f"NVMe offload: bucket {bucket}'s gradient came in {grad.dtype}, its spill "
                               f"extents hold {self.dtypes[bucket]}")
        chunks = [c for c in self.records.chunks if c.bucket == bucket]
        if bucket not in self.slots:
            return [self._write(self.records.io, self.fd, self.offsets[c], grad.narrow(0, c.start, c.numel))
                    for c in chunks]
        extent = self.lent[bucket]
        step = self.staging.nbytes // grad.element_size()  # elements per piece (the staging size is aligned)
        writes = []
        for start in range(0, grad.numel(), step):
            piece = grad.narrow(0, start, min(step, grad.numel() - start))
            writes.append(self._write(extent.io, extent.fd, extent.offset + start * grad.element_size(), piece))
        self.slot_bytes_written += self.write_bytes(bucket)
        return writes

    def write_bytes(self, bucket: int) -> int:
        """The bytes `write_shard` writes for bucket `bucket`'s shard (aligned pieces or aligned chunks)."""
        chunks = [c for c in self.records.chunks if c.bucket == bucket]
        isz = self.dtypes[bucket].itemsize
        if bucket not in self.slots:
            return sum(round_up(c.numel * isz) for c in chunks)
        numel, step = sum(c.numel for c in chunks), self.staging.nbytes // isz
        return sum(round_up(min(step, numel - start) * isz) for start in range(0, numel, step))

    def _write(self, io, fd: int, offset: int, grad: torch.Tensor):
        buffer = self.staging.acquire()
        try:
            region = buffer[:round_up(grad.numel() * grad.element_size())]
            region.view(grad.dtype)[:grad.numel()].copy_(grad)
            return io.write(fd, offset, region, done=lambda b=buffer: self.staging.release(b))
        except BaseException:
            self.staging.release(buffer)
            raise

    def read(self, chunk: Chunk, buffer: torch.Tensor):
        """Start reading the chunk's spilled gradient into `buffer`'s gradient region; its future."""
        start = max(self.records.record_bytes.values())
        if chunk.bucket not in self.slots:
            self._lead[chunk] = 0
            return self.records.io.read(self.fd, self.offsets[chunk], buffer[start:start + self._nbytes(chunk)])
        extent, isz = self.lent[chunk.bucket], self.dtypes[chunk.bucket].itemsize
        lo = chunk.start * isz
        lead = self._lead[chunk] = lo % ALIGN  # O_DIRECT: the read starts at the aligned byte before the chunk
        nbytes = round_up(lead + chunk.numel * isz)
        self.slot_bytes_read += nbytes
        return extent.io.read(extent.fd, extent.offset + lo - lead, buffer[start:start + nbytes])

    def gradient(self, chunk: Chunk, buffer: torch.Tensor) -> torch.Tensor:
        """The chunk's gradient read by `read`, in fp32: the region itself, or a cast into a scratch tensor
        (one: the chunks are stepped one at a time)."""
        dtype = self.dtypes[chunk.bucket]
        start = max(self.records.record_bytes.values()) + self._lead.pop(chunk, 0)
        stored = buffer[start:start + chunk.numel * dtype.itemsize].view(dtype)
        if stored.dtype == torch.float32:
            return stored
        if self._scratch is None:
            self._scratch = torch.empty(self.records.chunk_numel, dtype=torch.float32)
        return self._scratch[:chunk.numel].copy_(stored)

    def host_bytes(self) -> int:
        """Host memory the spill holds: its staging buffers and the fp32 scratch."""
        return self.staging.total_bytes() + (self._scratch.numel() * 4 if self._scratch is not None else 0)
