"""ZeRO-Infinity parameter offload: stage-3 parameter shards kept off the device (`offload_param`).

Each non-persistent partitioned parameter's 1/N shard (training dtype) lives in a store
instead of device memory; persistent parameters (`stage3_param_persistence_threshold`)
stay whole on the device as before. A `PartitionedParam` whose shard a store keeps (its
owner's `store`: a store takes a shard with `detach_shard` and gives it back with
`restore_shard`, never setting anything on the parameter) reads its shard through it: `part.shard` is the host copy, `part.device_shard()` the copy a gather sends,
`part.write_shard(values)` takes new values (the optimizer's publish, a GatheredParameters
write, an initializer).

- `HostParamStore` (`device: cpu`): the shard is a host tensor, pinned when CUDA is present
  and `pin_memory` is set; a gather copies it to the device with `non_blocking`. On a
  CPU-only run the host tensor *is* the device tensor: no copy anywhere, and an fp32
  master may share its memory as it does without offload.
- `NvmeParamStore` (`device: nvme`): the shards live in one file per rank under
  `nvme_path` (each at an aligned offset), moved by `aio.AsyncFileIO` (O_DIRECT where the
  filesystem takes it). Writes go through a bounded pool of `buffer_count` aligned buffers
  (`aio.AlignedBuffers`) of at most `buffer_size` elements each: a larger shard is written in pieces, so
  the pool stays the same size whatever the model's largest tensor (the embedding);
  a read lands in an aligned host tensor of its own, which then is the shard (no copy). At
  most `max_in_cpu` elements of shards are cached in host memory (least recently used first
  out; less what `hold_back_cache` holds back for the norm's first pass); the rest are read
  when a gather needs them. The fetcher asks for reads ahead along its recorded order
  (`read_ahead`: forward, then backward's recompute and gradients), as many as fit in one
  largest shard's bytes, so the next layers' shards (a layer is many small ones) are on
  their way while this one computes. Writes after the optimizer step go
  out asynchronously; `flush()` (the engine calls it after every step) waits for them. Any
  failed read or write raises `aio.OffloadIOError` in the training process, naming the
  file, offset and rank. A shard dropped from the store (`remove`: e.g. a head tied to the
  embedding after zero.Init wrote both) frees its extent: `add` reuses free extents, the
  file is cut after its last live extent, and `compact` moves the last shards into holes,
  so the file holds the live shards (plus the holes no shard fits), never orphans.

`resident(write_back)` keeps every shard in host memory while inside (checkpoint save
and load address them as tensors) and, with `write_back`, writes them all out on exit.
"""
from __future__ import annotations

import os
import shutil
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from typing import Iterable, Optional

import torch

from ..zero.interfaces import ParamStore, ShardExtent
from ..zero.stage3.context import register_param_store_factory
from .aio import (AlignedBuffers, AsyncFileIO, OffloadIOError, aio_settings, aligned_empty, make_swap_root,
                  open_swap_directory, round_up)

PARAM_NVME_KEY = "zero_optimization.offload_param.nvme_path"


def _host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=pin and torch.cuda.is_available())


def _nbytes(part) -> int:
    return part.shard_numel * part.dtype.itemsize


def _extent(part) -> int:
    """Bytes of `part`'s extent in an NVMe parameter file (aligned for O_DIRECT)."""
    return round_up(max(_nbytes(part), 1))


class HostParamStore(ParamStore):
    """`offload_param.device = cpu`: every offloaded shard is a (pinned) host tensor."""

    kind = "cpu"

    def __init__(self, parts: list, pin_memory: bool = False):
        self.parts = parts
        self.stats: dict = {}  # no reads or writes to count: every shard is a host tensor
        self.pin = bool(pin_memory) and torch.cuda.is_available()
        self.hosts: dict[int, torch.Tensor] = {}
        for part in parts:
            shard = part.detach_shard()
            if shard.device.type != "cpu" or (self.pin and not shard.is_pinned()):
                host = _host_empty(shard.numel(), shard.dtype, self.pin)
                host.copy_(shard)
                shard = host
            self.hosts[id(part)] = shard

    def shares_device_memory(self, part) -> bool:
        """True when the host shard is on the training device itself (a CPU run): masters may alias it."""
        return part.device.type == "cpu"

    def host_shard(self, part) -> torch.Tensor:
        return self.hosts[id(part)]

    def device_shard(self, part) -> torch.Tensor:
        return self.hosts[id(part)].to(part.device, non_blocking=True)  # the host tensor itself on a CPU run

    def write(self, part, values: torch.Tensor) -> None:
        host = self.hosts[id(part)]
        if values.data_ptr() != host.data_ptr():
            host.copy_(values)

    def read_ahead(self, parts: Iterable) -> None:
        """Nothing to read: the host-to-device copy starts with the gather."""

    def flush(self) -> None:
        """Nothing pending: writes are plain copies."""

    def resident(self, write_back: bool = True):
        return nullcontext(self)

    def memory_split(self) -> dict[str, int]:
        return {"host": sum(_nbytes(part) for part in self.parts), "nvme": 0, "host_buffers": 0}

    def close(self) -> None:
        """Nothing to release."""


class NvmeParamStore(ParamStore):
    """`offload_param.device = nvme`: shards in a file per rank, a bounded host cache, async I/O."""

    kind = "nvme"

    def __init__(self, parts: list, nvme_path: str, rank: int, buffer_count: int = 5,
                 buffer_size: int = 100_000_000, max_in_cpu: int = 1_000_000_000,
                 pin_memory: bool = False, aio=None, direct: Optional[bool] = None):
        self.parts = parts
        self.rank = rank
        self.pin = bool(pin_memory) and torch.cuda.is_available()
        self.max_in_cpu = int(max_in_cpu)
        if int(buffer_size) < 1:
            raise ValueError(f"zero_optimization.offload_param.buffer_size: must be at least 1, got {buffer_size}")
        self.buffer_size = int(buffer_size)
        self.offsets: dict[int, int] = {}
        total = 0
        for part in parts:
            self.offsets[id(part)] = total
            total += _extent(part)
        self.size = total  # bytes of the file (add() extends it; freeing its end shrinks it)
        self.free: list[tuple[int, int]] = []  # (offset, bytes) of unused extents, sorted, merged
        make_swap_root(nvme_path, PARAM_NVME_KEY)
        free = shutil.disk_usage(nvme_path).free
        if total > free:
            raise OffloadIOError(f"NVMe parameter offload: rank {rank} needs {total / 2**20:.1f} MiB under "
                                 f"{nvme_path} for its parameter shards; only {free / 2**20:.1f} MiB are free")
        self.directory, self.io = open_swap_directory(nvme_path, f"zerotrain-param-r{rank}-", aio, direct,
                                                      "NVMe parameter offload", PARAM_NVME_KEY)
        self._finalizer = weakref.finalize(self, _cleanup, self.io, self.directory)
        self.fd = -1
        if parts:
            try:
                self.fd = self.io.open(os.path.join(self.directory, "params.swp"), total)
            except BaseException:
                self._finalizer()
                raise
        largest_bytes = round_up(max((_nbytes(part) for part in parts), default=1))
        self.pool = AlignedBuffers(max(1, int(buffer_count)), self._buffer_bytes(parts), pin=self.pin)
        self.cache: OrderedDict[int, torch.Tensor] = OrderedDict()  # id(part) -> host shard, LRU order
        self.cached_numel = 0
        self.held_back_numel = 0  # hold_back_cache: elements of max_in_cpu left to memory held elsewhere
        self.reads: OrderedDict[int, tuple[Future, torch.Tensor]] = OrderedDict()  # reads ahead not yet taken
        self._reading = 0  # bytes of those reads' landing tensors
        # bytes read ahead at most: the largest shard's, i.e. several layers of a transformer
        self.read_ahead_bytes = largest_bytes
        self.writes: dict[int, list[Future]] = {}  # a shard's writes in flight: one per piece
        self._resident: Optional[dict[int, torch.Tensor]] = None
        self.lent: set[int] = set()  # parts whose extent holds their spilled gradient until their next write
        self.stats = {"param_reads": 0, "param_writes": 0, "read_ahead": 0, "read_ahead_hits": 0,
                      "cache_hits": 0}
        self._by_id = {id(part): part for part in parts}
        for part in parts:
            shard = part.detach_shard()
            self.write(part, shard)
            self._remember(part, shard if shard.device.type == "cpu" else None)
        self.flush()

    def shares_device_memory(self, part) -> bool:
        return False

    # --- growing and shrinking (zero.Init hands shards in as it partitions) --------------------
    def add(self, part) -> None:
        """Take `part`'s shard: a new extent at the end of the file, written behind (not cached).

        zero.Init calls this as it partitions each module, so a model's shards never sit in host
        memory together; the pool grows (after the writes in flight) when a larger shard arrives."""
        if id(part) in self.offsets:
            return
        nbytes = _extent(part)
        free = shutil.disk_usage(self.directory).free
        if nbytes > free and not any(size >= nbytes for _, size in self.free):
            raise OffloadIOError(f"NVMe parameter offload: rank {self.rank} needs {nbytes / 2**20:.1f} MiB more "
                                 f"under {self.directory} for parameter {part.names[0]}; only "
                                 f"{free / 2**20:.1f} MiB are free")
        self.offsets[id(part)] = self._allocate(nbytes)
        if self._buffer_bytes([part]) > self.pool.nbytes:  # larger buffers: once no write in flight holds one
            self.resize_pool(self.pool.count, self.buffer_size, self._buffer_bytes([part]))
        self.read_ahead_bytes = max(self.read_ahead_bytes, nbytes)
        self.parts.append(part)
        self._by_id[id(part)] = part
        shard = part.detach_shard()
        self.write(part, shard)

    def _buffer_bytes(self, parts: Iterable) -> int:
        """Bytes of one write buffer: the largest shard's, at most `buffer_size` elements of it (a larger shard
        is written in pieces), so the pool does not grow with the model's largest tensor."""
        return round_up(max((min(_nbytes(part), self.buffer_size * part.dtype.itemsize) for part in parts),
                            default=1))

    def resize_pool(self, buffer_count: int, buffer_size: int, at_least: int = 0) -> None:
        """Write through `buffer_count` buffers of at most `buffer_size` elements from now on (initialize gives
        the budget's sizes to the store zero.Init built with the config's), each of at least `at_least` bytes."""
        for key in list(self.reads):
            self._forget_reads(key)
        self.flush()
        self.buffer_size = max(1, int(buffer_size))
        nbytes = max(self._buffer_bytes(self.parts), round_up(max(1, at_least)))
        if nbytes != self.pool.nbytes or int(buffer_count) != self.pool.count:
            self.pool = AlignedBuffers(max(1, int(buffer_count)), nbytes, pin=self.pin)

    def remove(self, part, keep_values: bool = True) -> None:
        """Give `part`'s shard back to it as a host tensor (a persistent parameter; another store), or with
        `keep_values` False drop it (a parameter the model no longer holds: replaced by a tied weight after
        zero.Init partitioned it). Its extent goes to the free list: a later `add` reuses it, and free space
        at the end of the file is given back to the disk at once (`compact` moves shards into the rest)."""
        key = id(part)
        if key not in self.offsets:
            return
        host = self.host_shard(part).clone() if keep_values else None
        self._wait_write(key)
        self._forget_reads(key)
        if key in self.cache:
            self.cached_numel -= self.cache.pop(key).numel()
        self._release_extent(self.offsets[key], _extent(part))
        del self.offsets[key], self._by_id[key]
        self.parts = [other for other in self.parts if other is not part]
        part.restore_shard(host)

    # --- extents: a free list, reused by add, given back at the end of the file by compact ---------
    def _allocate(self, nbytes: int) -> int:
        """The offset of an extent of `nbytes`: the smallest free one that holds it (its rest stays free),
        else new space at the end of the file (allocated now, so a full disk shows up here)."""
        fits = [index for index, (_, size) in enumerate(self.free) if size >= nbytes]
        if fits:
            index = min(fits, key=lambda i: self.free[i][1])
            offset, size = self.free[index]
            if size == nbytes:
                del self.free[index]
            else:
                self.free[index] = (offset + nbytes, size - nbytes)
            return offset
        if self.fd < 0:
            self.fd = self.io.open(os.path.join(self.directory, "params.swp"), nbytes)
        else:
            self.io.extend(self.fd, self.size, nbytes)
        offset, self.size = self.size, self.size + nbytes
        return offset

    def _release_extent(self, offset: int, nbytes: int) -> None:
        """Put an extent on the free list (kept sorted and merged with its neighbours); free space at the
        end of the file is cut off it (the file shrinks on disk)."""
        self.free.append((offset, nbytes))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for start, size in self.free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self.free = merged
        if self.free and sum(self.free[-1]) == self.size:
            self.size = self.free.pop()[0]
            self.io.truncate(self.fd, self.size)

    def compact(self) -> None:
        """Move the last shards of the file into free extents before them and cut the file after the last
        live one, until no free extent lower down holds the last shard: the file then holds the live shards
        and at most the holes no shard fits (initialize calls this after dropping stale shards)."""
        while self.free:
            last = max(self.parts, key=lambda part: self.offsets[id(part)], default=None)
            if last is None:
                break
            nbytes = _extent(last)
            if not any(size >= nbytes and start < self.offsets[id(last)] for start, size in self.free):
                break
            host = self.host_shard(last)
            key = id(last)
            self._wait_write(key)
            self._forget_reads(key)
            old = self.offsets[key]
            self.offsets[key] = self._allocate(nbytes)  # a free extent below it: never the end of the file
            self.write(last, host)
            self._wait_write(key)
            self._release_extent(old, nbytes)
        self.flush()

    def allocated_bytes(self) -> int:
        """Bytes of the parameter file: the live shards' extents plus the free list."""
        return self.size

    # --- reads ----------------------------------------------------------------------
    def host_shard(self, part) -> torch.Tensor:
        """The shard in host memory: from the resident set, the cache, a read ahead, or the file now."""
        key = id(part)
        if self._resident is not None and key in self._resident:
            return self._resident[key]
        if key in self.cache:  # (a lent part's host copy still holds its values)
            self.cache.move_to_end(key)
            self.stats["cache_hits"] += 1
            return self.cache[key]
        if key in self.lent:
            raise RuntimeError(f"NVMe parameter offload (rank {self.rank}): parameter {part.names[0]}'s extent "
                               "holds its gradient, spilled for clipping, until the optimizer step writes its new "
                               "values; run engine.step() after backward before the model is used again")
        if key in self.reads:
            self.stats["read_ahead_hits"] += 1
            host = self._finish_read(key)
        else:
            self._wait_write(key)
            raw = self._landing(part)
            self._read(part, raw).result()
            host = self._shard_of(part, raw)
        self._remember(part, host)
        return host

    def device_shard(self, part) -> torch.Tensor:
        return self.host_shard(part).to(part.device, non_blocking=True)  # no copy on a CPU run

    def read_ahead(self, parts: Iterable) -> None:
        """Start reads of upcoming shards, in order, while the bytes of reads ahead not yet taken stay within
        `read_ahead_bytes` (always at least one; never waits). A shard whose write is in flight is passed over.

        Each read lands in its own aligned host tensor, which becomes the shard itself (no copy out, no pool
        buffer held): the depth is bounded by bytes, not by a buffer count, so the many small shards of a
        layer (biases, norms) and the next layers' matrices are all on their way together. A finished read
        of a shard no longer within that window (its parameter stayed gathered, so it was never taken) goes
        to the cache instead of holding the window's bytes."""
        window, window_bytes = [], 0
        for part in parts:
            key = id(part)
            if key not in self.offsets or key in self.cache or key in self.writes or key in self.lent \
                    or (self._resident is not None and key in self._resident):
                continue
            nbytes = _extent(part)
            if window and window_bytes + nbytes > self.read_ahead_bytes:
                break
            window.append(part)
            window_bytes += nbytes
        wanted = {id(part) for part in window}
        for key in [key for key, (future, _) in self.reads.items() if key not in wanted and future.done()]:
            future, raw = self.reads.pop(key)
            self._reading -= raw.numel()
            if future.exception() is None:  # else: dropped; a read when it is needed raises, naming the file
                self._remember(self._part(key), self._shard_of(self._part(key), raw))
        for part in window:
            key = id(part)
            if key in self.reads:
                continue
            nbytes = _extent(part)
            if self.reads and self._reading + nbytes > self.read_ahead_bytes:
                return
            raw = self._landing(part)
            self.reads[key] = (self._read(part, raw), raw)
            self._reading += nbytes
            self.stats["read_ahead"] += 1

    def _landing(self, part) -> torch.Tensor:
        """An aligned host tensor a read of `part`'s extent lands in (O_DIRECT needs the alignment)."""
        return aligned_empty(_extent(part), pin=self.pin)

    @staticmethod
    def _shard_of(part, raw: torch.Tensor) -> torch.Tensor:
        return raw[:_nbytes(part)].view(part.dtype)

    def _read(self, part, raw: torch.Tensor) -> Future:
        self.stats["param_reads"] += 1
        return self.io.read(self.fd, self.offsets[id(part)], raw[:_extent(part)])

    def _finish_read(self, key: int) -> torch.Tensor:
        future, raw = self.reads.pop(key)
        self._reading -= raw.numel()
        future.result()
        return self._shard_of(self._part(key), raw)

    def _part(self, key: int):
        return self._by_id[key]

    def _acquire(self) -> torch.Tensor:
        """A free write buffer (reads do not hold any); waits for a write behind to free one."""
        return self.pool.acquire()

    def _remember(self, part, host: Optional[torch.Tensor]) -> None:
        """Cache `host` if it fits under the cache's bound, evicting the least recently used shards."""
        bound = self._cache_bound()
        if host is None or part.shard_numel > bound:
            return
        self._evict_to(bound - part.shard_numel)  # (a shard is remembered only when not cached: read, not hit)
        self.cache[id(part)] = host
        self.cached_numel += host.numel()

    def _cache_bound(self) -> int:
        """Elements the cache may hold: max_in_cpu less what is held back."""
        return max(0, self.max_in_cpu - self.held_back_numel)

    def _evict_to(self, numel: int) -> None:
        """Drop the least recently used shards until at most `numel` elements are cached."""
        while self.cached_numel > numel:  # (an empty cache counts 0)
            self.cached_numel -= self.cache.popitem(last=False)[1].numel()

    def hold_back_cache(self, nbytes: int) -> int:
        itemsize = self.parts[0].dtype.itemsize if self.parts else 1  # (one training dtype for every shard)
        self.held_back_numel = -(-int(nbytes) // itemsize)
        bound = self._cache_bound()
        self._evict_to(bound)
        return bound * itemsize

    # --- writes ---------------------------------------------------------------------
    def write(self, part, values: torch.Tensor) -> None:
        """Take new values: into the host copies at once, into the file asynchronously (see flush)."""
        key = id(part)
        self._wait_write(key)
        self._forget_reads(key)
        self.lent.discard(key)  # the new values replace a spilled gradient
        for copies in (self.cache, self._resident or {}):
            if key in copies and copies[key].data_ptr() != values.data_ptr():
                copies[key].copy_(values)
        flat = values.reshape(-1)
        pool = self.pool  # resize_pool may replace self.pool once nothing is in flight
        step = pool.nbytes // part.dtype.itemsize  # elements per piece (pool.nbytes is aligned)
        futures = self.writes[key] = []
        for start in range(0, part.shard_numel, step):
            count = min(step, part.shard_numel - start)
            buffer = self._acquire()
            try:
                buffer[:count * part.dtype.itemsize].view(part.dtype).copy_(flat[start:start + count])
            except BaseException:
                pool.release(buffer)
                raise
            futures.append(self.io.write(self.fd, self.offsets[key] + start * part.dtype.itemsize,
                                         buffer[:round_up(count * part.dtype.itemsize)],
                                         done=lambda buffer=buffer: pool.release(buffer)))
        self.stats["param_writes"] += 1

    def shard_extent(self, part) -> Optional[ShardExtent]:
        """The aligned extent of `part`'s shard in the parameter file."""
        key = id(part)
        return ShardExtent(self.io, self.fd, self.offsets[key], _extent(part)) if key in self.offsets else None

    def lend(self, part) -> None:
        """Lend `part`'s extent until its next `write` (see ParamStore.lend): its writes in flight are waited
        for, its read ahead dropped, and reading it from the file raises until then (a host copy in the cache
        keeps its values and still serves: `write` updates it; evicted, it is not read back)."""
        key = id(part)
        if key not in self.offsets:
            raise RuntimeError(f"NVMe parameter offload (rank {self.rank}): parameter {part.names[0]} is not in "
                               "the parameter file; no extent to lend")
        self._wait_write(key)
        self._forget_reads(key)
        self.lent.add(key)

    def _forget_reads(self, key: int) -> None:
        if key in self.reads:
            future, raw = self.reads.pop(key)
            self._reading -= raw.numel()
            try:
                future.result()
            except OffloadIOError:
                pass  # its values are being replaced anyway

    def _wait_write(self, key: int) -> None:
        for future in self.writes.pop(key, ()):
            future.result()

    def flush(self) -> None:
        """Wait for every write; raise the first failure (after all have finished: nothing left running)."""
        writes, self.writes = self.writes, {}
        error = None
        for future in (f for futures in writes.values() for f in futures):
            try:
                future.result()
            except BaseException as caught:  # noqa: BLE001 - the first one is raised below
                error = error or caught
        if error is not None:
            raise OffloadIOError(f"NVMe parameter offload (rank {self.rank}): {error}") from error

    # --- all shards in memory, for checkpoints -----------------------------------------
    @contextmanager
    def resident(self, write_back: bool = True):
        """Every shard in host memory while inside; with `write_back`, all written to the file on exit."""
        if self._resident is not None:  # nested: the outer one owns the set
            yield self
            return
        shards = {}
        for part in self.parts:
            shards[id(part)] = self.host_shard(part)
        self._resident = shards
        try:
            yield self
        finally:
            self._resident = None
        if write_back:
            for part in self.parts:
                self.write(part, shards[id(part)])
            self.flush()

    # --- accounting and shutdown -----------------------------------------------------------
    def memory_split(self) -> dict[str, int]:
        nbytes = sum(_nbytes(part) for part in self.parts)
        cached = sum(host.numel() * host.element_size() for host in self.cache.values())
        return {"host": cached, "nvme": nbytes, "host_buffers": self.pool.total_bytes()}

    def close(self) -> None:
        for key in list(self.reads):
            self._forget_reads(key)
        try:
            self.flush()
        finally:
            self._finalizer()


def _cleanup(io: AsyncFileIO, directory: str) -> None:
    io.shutdown()
    shutil.rmtree(directory, ignore_errors=True)


def build_param_store(parts: list, offload, aio, rank: int, early_stores: Iterable = ()):
    """The store `zero_optimization.offload_param` asks for, holding the non-persistent shards of `parts`.

    Shards zero.Init already wrote to an NVMe store (`init_param_store`; `early_stores`: those the parts'
    shards are in) stay there: that store is adopted, given the shards it lacks, and gives back the
    persistent ones. The caller hands the returned store to the parts' owner."""
    early = {id(store): store for store in early_stores if isinstance(store, NvmeParamStore)}
    offloaded = [part for part in parts if not part.persistent]
    if len(early) == 1 and offload is not None and offload.device == "nvme":
        store = next(iter(early.values()))
        engine_parts = {id(part) for part in parts}
        for stale in [part for part in store.parts if id(part) not in engine_parts]:
            store.remove(stale, keep_values=False)  # e.g. an embedding replaced by the tied head after Init
        for part in parts:
            if part.persistent and id(part) in store.offsets:
                store.remove(part)
        for part in offloaded:
            if not part.offloaded:
                store.add(part)
        store.max_in_cpu = int(offload.max_in_cpu)
        store.resize_pool(int(offload.buffer_count), int(offload.buffer_size))
        store.compact()  # the dropped shards' extents: reused by the moves, cut off the file's end
        return store
    for store in early.values():  # the engine's config keeps the shards elsewhere: take them back
        for part in list(store.parts):
            store.remove(part)
        store.close()
    if offload is None or offload.device == "none":
        return None
    if offload.device == "cpu":
        return HostParamStore(offloaded, pin_memory=bool(offload.pin_memory))
    return NvmeParamStore(offloaded, offload.nvme_path, rank, buffer_count=int(offload.buffer_count),
                          buffer_size=int(offload.buffer_size), max_in_cpu=int(offload.max_in_cpu),
                          pin_memory=bool(offload.pin_memory), aio=aio)


@contextmanager
def resident_model_states(zero_optimizer, store, write_back: bool = True):
    """Optimizer states and offloaded parameter shards in memory together (checkpoint save and load)."""
    from .cpu_optimizer import resident_states
    with resident_states(zero_optimizer, write_back=write_back):
        with (store.resident(write_back=write_back) if store is not None else nullcontext()):
            yield


def init_param_store(config: dict, rank: int) -> Optional[NvmeParamStore]:
    """The NVMe store zero.Init writes each shard to as it partitions, from a raw config dict (None unless
    `zero_optimization.offload_param.device` is "nvme"). Defaults are the config's (zerotrain.config.zero);
    read raw here because offload sits below config."""
    zero = config.get("zero_optimization") or {}
    offload = zero.get("offload_param") or {}
    if offload.get("device") != "nvme" or not offload.get("nvme_path"):
        return None
    aio = aio_settings(config.get("aio"))
    return NvmeParamStore([], str(offload["nvme_path"]), rank, buffer_count=int(offload.get("buffer_count", 5)),
                          buffer_size=int(offload.get("buffer_size", 100_000_000)),
                          max_in_cpu=int(offload.get("max_in_cpu", 1_000_000_000)),
                          pin_memory=bool(offload.get("pin_memory", False)), aio=aio)


register_param_store_factory(init_param_store)
