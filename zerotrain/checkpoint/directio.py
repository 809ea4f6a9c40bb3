"""File I/O that keeps up with the disk: O_DIRECT through page-aligned buffers, both ways.

Measured on this project's machine (512 MiB, 8 MiB requests): buffered writes into a
cold page cache ran at 0.35 GB/s (0.31 GB/s with fsync; the VM's first touch of
page-cache memory is slow), warm at 4.6 GB/s but 1.9 GB/s once fsynced; O_DIRECT
writes ran at 2.1 GB/s every time. Reading a file that is not cached: buffered 0.56
GB/s, O_DIRECT 1.1 GB/s (0.88 GB/s with crc32). A checkpoint is written once, must be
fsynced, and is read back once, so the page cache only costs memory and time.

A save writes through `PlacedWriter`: every rank writes its own pieces at their offsets in files the
other ranks write too (no exchange of bytes between ranks), through the same two aligned buffers and
writer thread as `DurableFile`; a run's whole blocks go O_DIRECT, the partial block at either end of a
run (shared with another rank's run) through the page cache, so no block is written both ways.

`DurableFile` (files written by one process: merges, conversions, LoCo buffers) writes sequentially through two aligned buffers (the bytes are copied
into one, a memcpy far faster than the disk, while the file's writer thread computes
the other's crc32 and writes it: copy, checksum and disk overlap); the last partial
block is written padded and the file truncated to its real length. `DirectReader` reads any byte
range through an aligned buffer (the covering aligned blocks, then the wanted bytes
are copied out) and streams whole files (`integrity.file_crc32`). Filesystems that refuse
O_DIRECT (tmpfs, some network filesystems) get ordinary buffered I/O;
`ZEROTRAIN_CHECKPOINT_ODIRECT=0` forces it.

Loading a trained engine reads through the page cache instead (`SharedFiles`, `run_parallel`): a load
checks every byte's crc32 before it may touch the engine, and that checking pass
(`integrity.checksum_share`, the kernel's readahead of a sequential mapping) is the
one read from the disk; the load's own reads then find the bytes in memory and copy
them straight into the engine's tensors, READ_THREADS at once. An O_DIRECT read would
go to the disk a second time. A resume at start-up (new optimizer states: nothing to roll back)
reads those states once, O_DIRECT, straight into them (`CheckedReads`: READ_THREADS requests in
flight per rank, crc32 on the landed bytes). (Cold reads, two ranks at once, run 27, 0.42 GB each:
the mapping 0.42-0.60 s, O_DIRECT 8 MiB requests one at a time 0.62-0.82 s, four at a time
0.48-0.63 s, buffered `preadv` one at a time 0.72-1.19 s.)
"""
from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Optional

import numpy

_BLOCK = max(4096, mmap.PAGESIZE)  # O_DIRECT's alignment, and a page: no page is written both ways
_BUFFER = 8 << 20
_BUFFERS = 2       # a DurableFile's aligned buffers: one filled by the caller while the other is written
WRITE_BUFFERS = 4  # a PlacedWriter's: one filled by the caller while up to three are written (run 27)
READ_THREADS = 4   # concurrent reads per rank while a load applies cold (without checks): the disk's queue depth
READ_CHUNK = 8 << 20


def _direct_enabled() -> bool:
    return hasattr(os, "O_DIRECT") and os.environ.get("ZEROTRAIN_CHECKPOINT_ODIRECT", "1") != "0"


class DurableFile:
    """Write bytes sequentially to a new file; `close()` fsyncs it and returns its size.

    With O_DIRECT the bytes are copied into one of two aligned buffers; a full buffer goes to this file's
    writer thread, which computes its crc32 (with `checksum`) and writes it while the caller fills the other
    one, so the copy, the checksum and the disk overlap (the write and crc32 release the GIL). `crc` is the
    crc32 of every byte written, in order, once `close()` returned (0 without `checksum`). An error of the
    writer thread is raised by the next `write` or by `close`.
    """

    def __init__(self, path: str, checksum: bool = False, crc32: Optional[Callable] = None):
        self.path = path
        self.size = 0
        self.crc = 0
        self._crc32 = crc32 if checksum else None
        self._fd = None
        self._handle = None
        if checksum and crc32 is None:
            raise ValueError("DurableFile: checksum=True needs the crc32 function")
        if _direct_enabled():
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            except OSError:
                self._fd = None
        if self._fd is None:
            self._handle = open(path, "wb")
            return
        self._buffers = [mmap.mmap(-1, _BUFFER) for _ in range(_BUFFERS)]
        self._views = [memoryview(buffer) for buffer in self._buffers]
        self._pending: list = [None] * _BUFFERS  # the writer thread's future for each buffer
        self._current = 0
        self._view = self._views[0]
        self._used = 0
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerotrain-write")

    def write(self, data) -> None:
        data = memoryview(data).cast("B")
        self.size += len(data)
        if self._handle is not None:
            self._handle.write(data)
            if self._crc32 is not None:
                self.crc = self._crc32(data, self.crc)
            return
        while len(data):
            take = min(len(data), _BUFFER - self._used)
            self._view[self._used:self._used + take] = data[:take]
            self._used += take
            data = data[take:]
            if self._used == _BUFFER:
                self._submit(_BUFFER, _BUFFER)

    def _submit(self, length: int, padded: int) -> None:
        """Hand the current buffer's first `padded` bytes (`length` of them data) to the writer thread; switch to
        the other buffer once its own write is done."""
        index = self._current
        self._pending[index] = self._writer.submit(self._flush, self._views[index], length, padded)
        self._current = (index + 1) % _BUFFERS
        self._view = self._views[self._current]
        self._used = 0
        self._wait(self._current)

    def _wait(self, index: int) -> None:
        future, self._pending[index] = self._pending[index], None
        if future is not None:
            future.result()

    def _flush(self, view: memoryview, length: int, padded: int) -> None:
        """The writer thread: crc32 of the data, then the (block-aligned) write of the buffer."""
        if self._crc32 is not None:
            self.crc = self._crc32(view[:length], self.crc)  # one thread, buffers in order: the file's crc32
        written = 0
        while written < padded:
            count = os.write(self._fd, view[written:padded])
            if count <= 0:
                raise OSError(f"{self.path}: write returned {count}")
            written += count

    def close(self) -> int:
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None
            return self.size
        if self._fd is None:
            return self.size
        try:
            for index in range(_BUFFERS):
                self._wait(index)
            if self._used:  # the last partial buffer, padded to whole blocks, written here (after the others)
                used = self._used
                padded = -(-used // _BLOCK) * _BLOCK
                self._view[used:padded] = bytes(padded - used)
                self._flush(self._view, used, padded)
            if self.size % _BLOCK:
                os.ftruncate(self._fd, self.size)
            os.fsync(self._fd)
        finally:
            self._release()
        return self.size

    def abort(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        elif self._fd is not None:
            self._release()

    def _release(self) -> None:
        """Wait for the writer thread (its errors are the caller's to report, not this cleanup's), then free."""
        self._writer.shutdown(wait=True)
        self._pending = [None] * _BUFFERS
        os.close(self._fd)
        self._fd = None
        for view, buffer in zip(self._views, self._buffers):
            view.release()
            buffer.close()


FSYNC_THREADS = 8  # fsyncs in flight at once: a journaling file system commits them together


def fsync_all(targets: Iterable, threads: int = FSYNC_THREADS) -> None:
    """fsync every target at once, each on its own thread (up to `threads`): a path (a file or a directory,
    opened read-only for it) or a (path, open descriptor) pair. A journaling file system commits the fsyncs
    in flight together (ext4 on this project's VM: six small files one after another 40 ms, at once 9 ms;
    each fsync here is a journal commit and a flush of the disk's cache, ~4 ms). Returns when every target
    is durable; the first failure, naming its path, is raised after all have finished."""
    targets = [(target, None) if isinstance(target, str) else tuple(target) for target in targets]

    def sync(path: str, fd: Optional[int]) -> None:
        owned = fd is None
        try:
            if owned:
                fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else 0))
            os.fsync(fd)
        except OSError as error:
            raise with_path(error, path) from error
        finally:
            if owned and fd is not None:
                os.close(fd)

    run_parallel([lambda target=target: sync(*target) for target in targets], threads)


def aligned_bytes(size: int) -> numpy.ndarray:
    """A new uint8 array of `size` bytes whose first byte is page-aligned (an O_DIRECT buffer)."""
    raw = numpy.empty(size + _BLOCK, dtype=numpy.uint8)
    skip = -raw.ctypes.data % _BLOCK
    return raw[skip:skip + size]


def with_path(error: OSError, path: str) -> OSError:
    """`error` naming `path` (raw writes and truncations on a descriptor carry no file name)."""
    return error if error.filename else OSError(error.errno, error.strerror, path)


class PlacedWriter:
    """One process's byte runs written in place into files that other processes write too (a save without
    the ZeRO-3 exchange: every rank writes its own pieces at their offsets in the shared files).

    `open(path, size)` creates the file if needed and sets its length (every writer sets the same one, so no
    writer ever cuts another's bytes; the file is never truncated below it); `begin(path, offset)` starts a
    run, `write(data)` appends to it, and `close()` fsyncs every file this process wrote and returns one
    (file path, offset, length, crc32) per run. The bytes are copied into one of `buffers` aligned buffers;
    each full buffer goes to its own writer thread, which computes the crc32 of its bytes and writes them,
    so the copy, the checksums and `buffers - 1` writes are in flight at once (run 27, two processes writing
    0.42 GB each O_DIRECT from memory: one request at a time 0.57 s, four 0.52 s; the copy into the buffers
    is the larger cost, and with more buffers it runs further ahead of the disk); a run's crc32 is its
    buffers' crc32s joined with `combine` (`crc32_combine`). With O_DIRECT, the whole blocks of a run go through the direct
    descriptor; a run's first and last partial block (which another process's run shares) go through an
    ordinary descriptor (page cache), so no block is ever written both ways or by two direct writes; the
    fsync covers both. An error of a writer thread is raised by a later `write`, `begin` or by `close`.
    """

    def __init__(self, crc32: Callable, combine: Callable[[int, int, int], int], buffer_bytes: int = _BUFFER,
                 buffers: int = WRITE_BUFFERS):
        if buffer_bytes % _BLOCK:
            raise ValueError(f"PlacedWriter: buffer_bytes {buffer_bytes} is not a multiple of {_BLOCK}")
        if buffers < 2:
            raise ValueError(f"PlacedWriter: buffers {buffers} is less than 2")
        self._crc32 = crc32
        self._combine = combine
        self._size = buffer_bytes
        self._count = buffers
        self._files: dict[str, tuple[int, Optional[int]]] = {}  # path -> (buffered fd, direct fd or None)
        self._runs: list[list] = []  # [path, offset, length, {offset in run: (length, crc32)}] per run, in order
        self._buffers = [mmap.mmap(-1, buffer_bytes) for _ in range(buffers)]
        self._views = [memoryview(buffer) for buffer in self._buffers]
        self._pending: list = [None] * buffers
        self._current = 0
        self._run: Optional[list] = None
        self._base = 0   # the file offset of the current buffer's first byte (block-aligned)
        self._used = 0   # bytes of the current buffer filled, counted from its first byte
        self._start = 0  # where this buffer's data begins (a run that begins inside a block)
        self._writer = ThreadPoolExecutor(max_workers=buffers - 1, thread_name_prefix="zerotrain-write")

    def open(self, path: str, size: int) -> None:
        """Create `path` if it is not there and give it `size` bytes (a hole until written)."""
        if path in self._files:
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        direct = None
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            if _direct_enabled():
                try:
                    direct = os.open(path, os.O_WRONLY | os.O_DIRECT)
                except OSError:
                    direct = None  # the filesystem refuses O_DIRECT: everything through the page cache
        except OSError as error:
            os.close(fd)
            raise with_path(error, path) from error
        self._files[path] = (fd, direct)

    def begin(self, path: str, offset: int) -> None:
        """Start a run at byte `offset` of `path` (opened); the previous run ends here, unless this one
        continues it (same file, the next byte): then the bytes join it, with no partial block between."""
        run = self._run
        if run is not None and run[0] == path and run[1] + run[2] == offset:
            return
        self.end()
        self._run = [path, offset, 0, {}]
        self._runs.append(self._run)
        self._base = offset - offset % _BLOCK
        self._start = self._used = offset - self._base

    def write(self, data) -> None:
        """Append `data` (bytes-like) to the current run."""
        data = memoryview(data).cast("B")
        self._run[2] += len(data)
        while len(data):
            take = min(len(data), self._size - self._used)
            self._views[self._current][self._used:self._used + take] = data[:take]
            self._used += take
            data = data[take:]
            if self._used == self._size:
                self._submit()

    def end(self) -> None:
        """Hand the current run's last partial buffer to a writer thread."""
        if self._run is not None and self._used > self._start:
            self._submit()
        self._run = None

    def _submit(self) -> None:
        index, run = self._current, self._run
        fds = self._files[run[0]]
        self._pending[index] = self._writer.submit(self._flush, self._views[index], fds, run, self._base,
                                                   self._start, self._used)
        self._current = (index + 1) % self._count
        self._base += self._size
        self._start = self._used = 0
        self._wait(self._current)

    def _wait(self, index: int) -> None:
        future, self._pending[index] = self._pending[index], None
        if future is not None:
            future.result()

    def _flush(self, view: memoryview, fds: tuple, run: list, base: int, start: int, stop: int) -> None:
        """A writer thread: crc32 of bytes [start, stop) of the buffer (some of the run's bytes), recorded
        under their place in the run, then their writes: whole blocks direct, the partial blocks at either
        end through the page cache."""
        run[3][base + start - run[1]] = (stop - start, self._crc32(view[start:stop]))
        buffered, direct = fds
        if direct is None:
            self._pwrite(buffered, view, start, stop, base, run[0])
            return
        first = -(-start // _BLOCK) * _BLOCK
        last = stop - stop % _BLOCK
        if first >= last:
            self._pwrite(buffered, view, start, stop, base, run[0])
            return
        if start < first:
            self._pwrite(buffered, view, start, first, base, run[0])
        self._pwrite(direct, view, first, last, base, run[0])
        if last < stop:
            self._pwrite(buffered, view, last, stop, base, run[0])

    @staticmethod
    def _pwrite(fd: int, view: memoryview, start: int, stop: int, base: int, path: str) -> None:
        while start < stop:
            try:
                count = os.pwrite(fd, view[start:stop], base + start)
            except OSError as error:
                raise with_path(error, path) from error
            if count <= 0:
                raise OSError(f"{path}: write returned {count}")
            start += count

    def _run_crc(self, run: list) -> int:
        """The crc32 of a whole run, from its buffers' crc32s (in the order of their bytes)."""
        crc, position = 0, 0
        for offset in sorted(run[3]):
            length, piece = run[3][offset]
            if offset != position:
                raise OSError(f"{run[0]}: the run at byte {run[1]} lost bytes {position} to {offset}")
            crc = self._combine(crc, piece, length) if position else piece
            position += length
        if position != run[2]:
            raise OSError(f"{run[0]}: the run at byte {run[1]} wrote {position} of its {run[2]} bytes")
        return crc

    def close(self, also: Iterable[str] = ()) -> list[tuple[str, int, int, int]]:
        """Finish the last run, fsync every file (and the files `also` names, written by the caller: one batch of
        fsyncs in flight at once, `fsync_all`), close them; (path, offset, length, crc32) of every run."""
        try:
            self.end()
            for index in range(self._count):
                self._wait(index)
            # each file's dirty pages (this process's partial blocks) and its length, with the caller's files
            fsync_all([(path, buffered) for path, (buffered, _) in self._files.items()] + list(also))
            runs = [(run[0], run[1], run[2], self._run_crc(run)) for run in self._runs]
        finally:
            self._release()
        return runs

    def abort(self) -> None:
        """Stop without fsyncing (the save failed; its directory is removed)."""
        self._release()

    def _release(self) -> None:
        if self._writer is None:
            return
        self._writer.shutdown(wait=True)
        self._writer = None
        self._pending = [None] * self._count
        for buffered, direct in self._files.values():
            os.close(buffered)
            if direct is not None:
                os.close(direct)
        self._files.clear()
        for view, buffer in zip(self._views, self._buffers):
            view.release()
            buffer.close()


class DirectReader:
    """Byte ranges of one file, read with O_DIRECT when the filesystem allows it."""

    def __init__(self, path: str):
        self.path = path
        self._direct = False
        if _direct_enabled():
            try:
                self._fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                self._direct = True
            except OSError:
                pass
        if not self._direct:
            self._fd = os.open(path, os.O_RDONLY)
        self._buffer = mmap.mmap(-1, _BUFFER + 2 * _BLOCK)
        self._view = memoryview(self._buffer)

    def __enter__(self) -> "DirectReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def chunks(self, offset: int, length: int, granule: int = 1):
        """Yield memoryviews covering bytes [offset, offset+length) in order, each a multiple of `granule`.

        Each view is valid only until the next one is requested.
        """
        step = max(granule, (_BUFFER // granule) * granule)
        end = offset + length
        while offset < end:
            want = min(step, end - offset)
            start = offset - offset % _BLOCK if self._direct else offset
            stop = -(-(offset + want) // _BLOCK) * _BLOCK if self._direct else offset + want
            got = self._pread(start, stop - start)
            if got < offset + want - start:
                raise OSError(f"{self.path}: file ends at byte {start + got}, needed bytes up to {offset + want}")
            piece = self._view[offset - start:offset - start + want]
            try:
                yield piece
            finally:
                piece.release()  # the buffer is reused: no view of it may outlive the next read
            offset += want

    def _pread(self, start: int, length: int) -> int:
        filled = 0
        while filled < length:
            count = os.preadv(self._fd, [self._view[filled:length]], start + filled)
            if count <= 0:
                break
            filled += count
        return filled

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._view.release()
            self._buffer.close()


class CheckedReads:
    """Byte ranges of files read straight into their destinations with a crc32 of each landed chunk: the
    reads of a load that nothing needs to roll back (new optimizer states at start-up), `threads` requests
    in flight per process.

    `add(label, path, offset, out, claims)` plans bytes [offset, offset + len(out)) of `path` into the
    writable bytes `out`, and the crc32 of the `claims` (file byte ranges inside it) computed on `out` as
    the bytes land; `run()` reads everything, READ_CHUNK at a time, on `threads` threads, and returns one
    (label, offset, length, crc32) piece per claimed part of a chunk (adjacent pieces join with
    `crc32_combine`, as `integrity` does). With O_DIRECT each chunk's covering blocks are read into the
    thread's aligned buffer and copied into `out` (a tensor inside a safetensors file is not aligned as
    O_DIRECT needs): one copy, no page cache, and the disk's queue kept deep (run 27: one stream of 8 MiB
    requests reads at 1.1-1.4 GB/s for two processes, four at once 1.5-1.6 GB/s; buffered, one stream 1.0).
    Without O_DIRECT: buffered reads straight into `out`. An OSError names the file.
    """

    def __init__(self, crc32: Callable, threads: int = READ_THREADS, chunk: int = READ_CHUNK):
        self._crc32 = crc32
        self._threads = max(1, threads)
        self._chunk = chunk
        self._jobs: list[tuple] = []

    def add(self, label, path: str, offset: int, out, claims: Iterable[tuple[int, int]]) -> None:
        """Plan `len(out)` bytes of `path` from `offset` into `out`, with the crc32 of `claims`."""
        out = memoryview(out).cast("B")
        claims = [(first, last) for first, last in claims if first < last]
        for first, last in claims:
            if first < offset or last > offset + len(out):
                raise ValueError(f"{path}: claimed bytes {first} to {last} are outside the read "
                                 f"{offset} to {offset + len(out)}")
        self._jobs.append((label, path, offset, out, claims))

    def run(self) -> list[tuple]:
        """Read every planned range; the crc32 pieces of the claims, in file order per label."""
        tasks = [(job, low, min(job[2] + len(job[3]), low + self._chunk))
                 for job in self._jobs for low in range(job[2], job[2] + len(job[3]), self._chunk)]
        if not tasks:
            return []
        fds: dict[str, tuple[int, bool]] = {}
        local = threading.local()
        lock = threading.Lock()

        def open_fd(path: str) -> tuple[int, bool]:
            with lock:
                if path not in fds:
                    try:
                        fds[path] = (os.open(path, os.O_RDONLY | os.O_DIRECT), True) if _direct_enabled() \
                            else (os.open(path, os.O_RDONLY), False)
                    except OSError:
                        try:  # the filesystem refuses O_DIRECT: through the page cache
                            fds[path] = (os.open(path, os.O_RDONLY), False)
                        except OSError as error:
                            raise with_path(error, path) from error
                return fds[path]

        def task(item) -> list[tuple]:
            (label, path, offset, out, claims), low, high = item
            fd, direct = open_fd(path)
            piece = numpy.frombuffer(out[low - offset:high - offset], dtype=numpy.uint8)
            if direct:
                buffer = getattr(local, "buffer", None)
                if buffer is None:
                    buffer = local.buffer = aligned_bytes(self._chunk + 2 * _BLOCK)
                start = low - low % _BLOCK
                stop = min(-(-high // _BLOCK) * _BLOCK, start + len(buffer))
                filled = 0
                while start + filled < high:
                    try:
                        count = os.preadv(fd, [buffer[filled:stop - start]], start + filled)
                    except OSError as error:
                        raise with_path(error, path) from error
                    if count <= 0:
                        raise OSError(f"{path}: file ends at byte {start + filled}, needed bytes up to {high}")
                    filled += count
                numpy.copyto(piece, buffer[low - start:high - start])  # numpy's copy releases the GIL
            else:
                read_exactly(fd, path, low, memoryview(piece))
            pieces = []
            for first, last in claims:
                first, last = max(first, low), min(last, high)
                if first < last:
                    pieces.append((label, first, last - first, self._crc32(out[first - offset:last - offset])))
            return pieces

        try:
            results = run_parallel([lambda item=item: task(item) for item in tasks], self._threads)
        finally:
            for fd, _ in fds.values():
                os.close(fd)
        self._jobs = []
        return [piece for pieces in results for piece in pieces]


class SharedFiles:
    """Byte ranges of files through the page cache; one descriptor per file, safe to read from many threads."""

    def __init__(self):
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> "SharedFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def read_into(self, path: str, offset: int, buffer) -> None:
        """Fill the writable `buffer` with the file's bytes from `offset` (OSError if the file ends first)."""
        read_exactly(self._fd(path), path, offset, memoryview(buffer).cast("B"))

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def read_exactly(fd: int, path: str, offset: int, view: memoryview) -> None:
    """pread until `view` is full (the GIL is released while the kernel copies)."""
    filled, length = 0, len(view)
    while filled < length:
        count = os.preadv(fd, [view[filled:]], offset + filled)
        if count <= 0:
            raise OSError(f"{path}: file ends at byte {offset + filled}, needed bytes up to {offset + length}")
        filled += count


def copy_threads(processes_per_host: int) -> int:
    """Threads per rank for copies from the page cache (a verified load's apply): CPU-bound, so no more
    than this host's cores per process, at most READ_THREADS. Measured (70m, two ranks on two cores,
    0.43 GB each from the page cache): 0.10 s of CPU per rank with 1-2 threads, 0.12-0.13 s with 4."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(READ_THREADS, cpus // max(1, processes_per_host)))


def run_parallel(tasks: Iterable[Callable[[], object]], threads: int = READ_THREADS) -> list:
    """Run `tasks` on `threads` threads; their results in order, or the first failed task's exception
    (raised after every task has finished, so nothing still writes once the caller sees it)."""
    tasks = list(tasks)
    if threads <= 1 or len(tasks) <= 1:
        return [task() for task in tasks]
    with ThreadPoolExecutor(max_workers=min(threads, len(tasks)), thread_name_prefix="zerotrain-read") as pool:
        futures = [pool.submit(task) for task in tasks]
        errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error
    return [f.result() for f in futures]
