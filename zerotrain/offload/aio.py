"""Asynchronous file I/O through a bounded pool of aligned host buffers.

`AlignedBuffers` hands out at most `count` page-aligned byte buffers; a caller that
finds none free waits until a write behind returns one. `AsyncFileIO` runs positional
reads and writes (`os.preadv` / `os.pwritev`) on a thread pool and returns futures.
Files are opened with O_DIRECT when the filesystem takes it (probed once per directory
by `direct_io_supported`); otherwise a warning is given and buffered I/O is used.

DeepSpeed's `aio` keys, as they map onto threads instead of libaio: `block_size` is the
bytes of one system call (a request is cut into blocks that run in parallel),
`intra_op_parallelism` × `queue_depth` is the number of worker threads, i.e. of blocks in
flight at once. `single_submit` and `overlap_events` choose how libaio batches submissions
and reaps completions; a thread pool has neither step, so they are accepted and have no effect.
A free worker takes the oldest waiting read block before any waiting write block: a read holds
up the computation that waits for it, a write only the reuse of its buffer.

The GIL: `os.preadv`/`os.pwritev` release it for the whole system call, and every wait
(`Future.result`, a free buffer) is a `threading.Condition` wait, which releases it too.
No thread ever waits on I/O while holding the GIL, so the I/O workers always make progress
(the ZeRO-Infinity deadlock of PEERS.md cannot happen here).

Errors never get lost: a failed request raises `OffloadIOError` (naming the file, the
offset and the size; "no space left on device" said plainly) from the future's `result()`,
in the thread that waits on it, which is the training process's main thread.
"""
from __future__ import annotations

import errno
import os
import tempfile
import threading
import uuid
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace
from typing import Callable, Optional, Protocol

import torch

ALIGN = 4096  # bytes: page size and the largest common logical block size

# Module-level so tests can inject faults (see tests/offload/test_offload_nvme_failure.py).
_pread = os.preadv
_pwrite = os.pwritev


class OffloadIOError(RuntimeError):
    """A read or write of offloaded optimizer state failed; the step it belonged to was not applied."""


def round_up(value: int, multiple: int = ALIGN) -> int:
    return -(-value // multiple) * multiple


def aligned_empty(nbytes: int, align: int = ALIGN, pin: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` whose first byte is `align`-aligned."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
    skip = (-raw.data_ptr()) % align
    return raw[skip:skip + nbytes]


_DIRECT_CACHE: dict[str, bool] = {}


def direct_io_supported(directory: str) -> bool:
    """True when an aligned O_DIRECT write and read work in `directory` (tmpfs, for one, refuses)."""
    directory = os.path.realpath(directory)
    if directory in _DIRECT_CACHE:
        return _DIRECT_CACHE[directory]
    flag = getattr(os, "O_DIRECT", 0)
    ok = False
    if flag:
        probe = os.path.join(directory, f".zerotrain-odirect-{uuid.uuid4().hex}")
        block = aligned_empty(ALIGN)
        try:
            fd = os.open(probe, os.O_CREAT | os.O_RDWR | flag, 0o600)
            try:
                ok = os.pwritev(fd, [block.numpy()], 0) == ALIGN and os.preadv(fd, [block.numpy()], 0) == ALIGN
            finally:
                os.close(fd)
        except OSError:
            ok = False
        finally:
            try:
                os.unlink(probe)
            except OSError:
                pass
    _DIRECT_CACHE[directory] = ok
    return ok


class AlignedBuffers:
    """A fixed pool of `count` aligned buffers of `nbytes` each: the bound on I/O memory."""

    def __init__(self, count: int, nbytes: int, pin: bool = False):
        if count < 1:
            raise ValueError("the buffer pool needs at least one buffer")
        self.nbytes = round_up(nbytes)
        self._free = [aligned_empty(self.nbytes, pin=pin) for _ in range(count)]
        self.count = count
        self._cond = threading.Condition()

    def acquire(self, block: bool = True) -> Optional[torch.Tensor]:
        """A free buffer; waits (GIL released) for one if `block`, else None when none is free."""
        with self._cond:
            while not self._free:
                if not block:
                    return None
                self._cond.wait()
            return self._free.pop()

    def release(self, buffer: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buffer)
            self._cond.notify()

    def total_bytes(self) -> int:
        return self.count * self.nbytes

    def free_count(self) -> int:
        """Buffers in the pool now (not acquired)."""
        with self._cond:
            return len(self._free)


def _describe(error: OSError, what: str, path: str, offset: int, nbytes: int) -> OffloadIOError:
    if error.errno == errno.ENOSPC:
        return OffloadIOError(f"NVMe offload: no space left on device while {what} {nbytes} bytes at offset "
                              f"{offset} of {path}; free space under the nvme_path or point it elsewhere")
    return OffloadIOError(f"NVMe offload: {what} {nbytes} bytes at offset {offset} of {path} failed: {error}")


class _Request:
    """One read or write cut into blocks of `block_size` bytes; its future resolves when every block has."""

    def __init__(self, io: "AsyncFileIO", fd: int, offset: int, buffer: torch.Tensor, write: bool,
                 done: Optional[Callable[[], None]]):
        self.io, self.fd, self.offset, self.buffer, self.write, self.done = io, fd, offset, buffer, write, done
        self.future: Future = Future()
        self.future.set_running_or_notify_cancel()
        nbytes = buffer.numel()
        self.blocks = [(start, min(start + io.block_size, nbytes)) for start in range(0, nbytes, io.block_size)]
        self.pending = len(self.blocks)
        self.error: Optional[BaseException] = None
        self.lock = threading.Lock()

    def issue(self) -> None:
        if not self.blocks:
            self._finish()
        for start, end in self.blocks:
            self.io._queue_block(self, start, end)

    def prepare_then_issue(self, before: Callable[[], None]) -> None:
        try:
            before()
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread through the future
            self.error = error
            self._finish()
            return
        self.issue()

    def _block(self, start: int, end: int) -> None:
        error = None
        try:
            self.io._transfer(self.fd, self.offset + start, self.buffer[start:end], self.write)
        except OSError as caught:
            what = "writing" if self.write else "reading"
            error = _describe(caught, what, self.io._paths.get(self.fd, f"fd {self.fd}"), self.offset + start,
                              end - start)
        except BaseException as caught:  # noqa: BLE001
            error = caught
        with self.lock:
            self.pending -= 1
            self.error = self.error or error
            last = self.pending == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        try:
            if self.done is not None:
                self.done()
        finally:
            if self.error is not None:
                self.future.set_exception(self.error)
            else:
                self.io._count(self.buffer.numel(), self.write)
                self.future.set_result(self.buffer.numel())


class AsyncFileIO:
    """Positional reads and writes of aligned buffers, cut into blocks, on a pool of worker threads.

    `block_size` (aio.block_size) is the size of one system call; `threads` (aio.intra_op_parallelism)
    times `queue_depth` (aio.queue_depth) worker threads, so that many blocks are in flight at most.
    """

    def __init__(self, threads: int = 2, direct: bool = False, block_size: int = 1 << 20, queue_depth: int = 1):
        self.direct = direct
        self.block_size = round_up(max(int(block_size), ALIGN))
        self.in_flight = max(1, int(threads)) * max(1, int(queue_depth))
        self._pool = ThreadPoolExecutor(self.in_flight, thread_name_prefix="zerotrain-aio")
        self._waiting: tuple[deque, deque] = (deque(), deque())  # blocks of reads, of writes, not yet started
        self._paths: dict[int, str] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        self._lock = threading.Lock()

    def open(self, path: str, nbytes: int) -> int:
        """Create `path` with `nbytes` allocated on disk now, so a full disk shows up here, not mid-step."""
        flags = os.O_CREAT | os.O_RDWR | (getattr(os, "O_DIRECT", 0) if self.direct else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, nbytes)
            else:
                os.ftruncate(fd, nbytes)
        except OSError as error:
            os.close(fd)
            raise _describe(error, "allocating", path, 0, nbytes) from error
        self._paths[fd] = path
        return fd

    def extend(self, fd: int, offset: int, nbytes: int) -> None:
        """Allocate `nbytes` more of an open file at `offset` (its end), so a full disk shows up here."""
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, offset, nbytes)
            else:
                os.ftruncate(fd, offset + nbytes)
        except OSError as error:
            raise _describe(error, "allocating", self._paths.get(fd, f"fd {fd}"), offset, nbytes) from error

    def truncate(self, fd: int, nbytes: int) -> None:
        """Cut an open file to `nbytes` (the space after it goes back to the disk)."""
        os.ftruncate(fd, nbytes)

    def close(self, fd: int) -> None:
        self._paths.pop(fd, None)
        os.close(fd)

    def read(self, fd: int, offset: int, buffer: torch.Tensor,
             done: Optional[Callable[[], None]] = None) -> Future:
        return self._submit(fd, offset, buffer, write=False, before=None, done=done)

    def write(self, fd: int, offset: int, buffer: torch.Tensor, before: Optional[Callable[[], None]] = None,
              done: Optional[Callable[[], None]] = None) -> Future:
        """Write `buffer` at `offset`; `before` runs first on an I/O thread (e.g. a copy into the buffer)."""
        return self._submit(fd, offset, buffer, write=True, before=before, done=done)

    def _submit(self, fd, offset, buffer, write, before, done) -> Future:
        if self.direct and (offset % ALIGN or buffer.numel() % ALIGN or buffer.data_ptr() % ALIGN):
            raise ValueError("O_DIRECT needs aligned offsets, sizes and buffers")
        request = _Request(self, fd, offset, buffer, write, done)
        if before is None:
            request.issue()
        else:
            self._pool.submit(request.prepare_then_issue, before)
        return request.future

    def _queue_block(self, request: _Request, start: int, end: int) -> None:
        """Queue one block; a free worker takes the oldest waiting read block before any write block, since
        reads hold up the computation that waits for them and writes only hold up their buffer's reuse."""
        self._waiting[int(request.write)].append((request, start, end))
        self._pool.submit(self._run_next_block)

    def _run_next_block(self) -> None:
        reads, writes = self._waiting
        with self._lock:  # each block is queued before its task is submitted: one of the two is not empty
            request, start, end = (reads if reads else writes).popleft()
        request._block(start, end)

    @staticmethod
    def _transfer(fd: int, offset: int, buffer: torch.Tensor, write: bool) -> None:
        """One block: system calls (GIL released) until every byte moved."""
        view = memoryview(buffer.numpy())
        moved = 0
        while moved < len(view):
            chunk = view[moved:]
            count = _pwrite(fd, [chunk], offset + moved) if write else _pread(fd, [chunk], offset + moved)
            if count <= 0:
                raise OSError(errno.EIO, "short write" if write else "read past the end of the file")
            moved += count

    def _count(self, nbytes: int, write: bool) -> None:
        with self._lock:
            if write:
                self.bytes_written += nbytes
            else:
                self.bytes_read += nbytes

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        for fd in list(self._paths):
            self.close(fd)


class AioSettings(Protocol):
    """What the I/O reads of the `aio` config block (`zerotrain.config.schema.AioConfig`, or `aio_settings`)."""

    intra_op_parallelism: int
    block_size: int
    queue_depth: int


def aio_settings(block: Optional[dict] = None) -> AioSettings:
    """The `aio` settings of a raw config block (the config's defaults for missing keys; `thread_count` is the
    old name of `intra_op_parallelism`): for callers below `config` (zero.Init's store) and without a config."""
    block = dict(block or {})
    return SimpleNamespace(intra_op_parallelism=int(block.get("intra_op_parallelism", block.get("thread_count", 1))),
                           block_size=int(block.get("block_size", 1 << 20)),
                           queue_depth=int(block.get("queue_depth", 8)))


def make_swap_root(nvme_path: str, key: str) -> None:
    """Create `nvme_path` (and its parents) if absent; a path that cannot hold swap files (a file, a file among
    its parents, no permission) is an `OffloadIOError` naming the config key and the path, before anything is
    written (it used to surface as a bare FileExistsError from deep inside the engine's construction)."""
    try:
        os.makedirs(nvme_path, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise OffloadIOError(f"{key}: {nvme_path} or a parent of it is a file, not a directory for the swap "
                             "files") from None
    except OSError as error:
        raise OffloadIOError(f"{key}: cannot create {nvme_path}: {error.strerror}") from None


def open_swap_directory(nvme_path: str, prefix: str, aio_config: Optional[AioSettings], direct: Optional[bool],
                        what: str, key: str) -> tuple[str, "AsyncFileIO"]:
    """A fresh directory under `nvme_path` and an `AsyncFileIO` set up from the `aio` config block (None: its
    defaults). `key` (the config key that named the path) is in the error when the path cannot hold the files.

    `direct` None probes O_DIRECT in that directory, warning (with `what` and the path) when the
    file system does not take it and buffered I/O is used instead."""
    make_swap_root(nvme_path, key)
    try:
        directory = tempfile.mkdtemp(prefix=prefix, dir=nvme_path)
    except OSError as error:
        raise OffloadIOError(f"{key}: cannot create the swap directory under {nvme_path}: {error.strerror}") from None
    if direct is None:
        direct = direct_io_supported(directory)
        if not direct:
            warnings.warn(f"{what}: {nvme_path} does not take O_DIRECT; using buffered I/O")
    settings = aio_config if aio_config is not None else aio_settings()
    io = AsyncFileIO(threads=int(settings.intra_op_parallelism), direct=direct, block_size=int(settings.block_size),
                     queue_depth=max(2, int(settings.queue_depth)))
    return directory, io
