"""Same-host transport: ranks on one machine read each other's tensors directly.

On gloo every byte of a reduce-scatter or all-gather goes through a loopback TCP socket:
copied into the kernel by the sender, out of it by the receiver, by gloo threads that
compete with compute for the same cores. When every rank of a group runs on this host,
this transport instead lets each rank read its peers' chunks straight out of their address
space with one copy (`process_vm_readv`, Linux cross-memory attach, as MPI's CMA transport
does): no socket, no staging buffer, no extra memory.

Protocol, per group (collectives are issued in the same order on every rank, as for any
collective; the n-th one is "op n"):

- a small shared-memory mailbox holds, per rank, a ring of `SLOTS` post records
  (op number, address, byte count) and per slot the number of the last op this rank has
  finished reading, plus a doorbell word and the rank's pid;
- posting op n writes the record of the source tensor into slot n % SLOTS (once every peer
  has finished reading the op that used that slot before) and rings the peers' doorbells;
- a rank reads each peer's part as soon as that peer's record of op n is up (at any call of
  the transport: post or wait), finishes the local part (the sum of a reduce-scatter), then
  acknowledges op n in its own slot;
- `wait()` returns when this rank has its result and every peer has acknowledged reading
  this rank's source: only then may the caller reuse or change the source tensor.

Waiting blocks on the doorbell with a futex (no GIL held, no spinning). Every rank that can
block also reads every op whose data is there, so no rank waits on a peer that waits on it.
A peer that dies (its pid is gone or a zombie) or does not answer within the group's timeout
ends the wait with an error naming that peer's rank.

Enabled when every rank of the group is on this host (same hostname, boot id and network
namespace: two network namespaces on one kernel are two hosts, whose traffic must cross their
link), on Linux x86-64 (its stores are seen in program order by other cores, which the records
rely on), every rank could open and map rank 0's mailbox (containers started with
`--network=host --pid=host` share hostname, boot id and pids but each have their own
`/dev/shm`), and a probe read of every peer succeeds (ptrace policy allows it: under Yama's
ptrace_scope 1 the ranks name their common parent as the one allowed ptracer, `allow_siblings`);
every rank learns every rank's answer before the verdict, so all keep gloo's sockets otherwise.
`ZEROTRAIN_SAME_HOST_TRANSPORT=0` turns it off.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import platform
import socket
import tempfile
import threading
import time
import uuid
from typing import Any, Callable, Optional, Protocol

import torch

SLOTS = 64
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SCRATCH_BYTES = 4 << 20  # reduce-scatter reads pieces of at most this size when it cannot read in place
_LIVENESS_SECONDS = 0.5

# Word layout of one rank's block in the mailbox (int64 words).
_DOORBELL, _PID = 0, 1
_POSTS = 2  # SLOTS records of (op, address, nbytes)
_ACKS = _POSTS + 3 * SLOTS  # SLOTS words: last op read from every peer in that slot
_BLOCK = _ACKS + SLOTS


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


class _TimeSpec(ctypes.Structure):
    _fields_ = [("seconds", ctypes.c_long), ("nanoseconds", ctypes.c_long)]


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                          ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
        libc.process_vm_readv.restype = ctypes.c_ssize_t
        libc.syscall.restype = ctypes.c_long
        _LIBC = libc
    return _LIBC


def supported_here() -> bool:
    """Whether this process could use the transport at all (before asking the peers)."""
    if os.environ.get("ZEROTRAIN_SAME_HOST_TRANSPORT", "1").lower() in ("0", "false", "no", "off"):
        return False
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            return file.read().strip()
    except OSError:
        return ""


def _net_namespace() -> str:
    """This process's network namespace (the inode of /proc/self/ns/net; "" where there is none)."""
    try:
        return str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        return ""


def _mailbox_bytes(size: int) -> int:
    return 8 * (1 + size * _BLOCK)


def open_mailbox(path: str, size: int) -> Optional[mmap.mmap]:
    """Map the mailbox file at `path` for a group of `size` ranks; None when this rank cannot see it
    (another /dev/shm than rank 0's, another file system) or it is not the expected size."""
    try:
        with open(path, "r+b") as file:
            if os.fstat(file.fileno()).st_size != _mailbox_bytes(size):
                return None
            return mmap.mmap(file.fileno(), _mailbox_bytes(size))
    except (OSError, ValueError):
        return None


def read_from(pid: int, address: int, destination: torch.Tensor) -> None:
    """Copy destination.nbytes bytes at `address` in process `pid` into `destination` (contiguous)."""
    libc = _libc()
    total, done = destination.numel() * destination.element_size(), 0
    base = destination.data_ptr()
    while done < total:
        local = _IoVec(base + done, total - done)
        remote = _IoVec(address + done, total - done)
        got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        done += got


def _ptrace_scope() -> Optional[int]:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as file:
            return int(file.read().strip())
    except (OSError, ValueError):
        return None  # no Yama: same-uid processes may read each other


_PR_SET_PTRACER = 0x59616D61


def allow_siblings(ptrace_scope: Optional[int], parent_pids: list[int]) -> bool:
    """Under Yama's ptrace_scope 1 (Ubuntu's default) only a process's ancestors may read its memory,
    so sibling ranks could not. When every rank has the same parent (torchrun's agent, a
    forkserver), declare that parent as this process's ptracer: its descendants, i.e. the sibling
    ranks, may then read it, and no other process. Returns whether it did (the same on every rank)."""
    if ptrace_scope != 1 or len(set(parent_pids)) != 1:
        return False
    _libc().prctl(ctypes.c_int(_PR_SET_PTRACER), ctypes.c_ulong(parent_pids[0]), ctypes.c_ulong(0),
                  ctypes.c_ulong(0), ctypes.c_ulong(0))
    return True


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as file:
            state = file.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "x")


class _Op:
    """One posted collective: what to read from whom, and the local finish."""

    def __init__(self, number: int, source: torch.Tensor, reads: dict, finish: Optional[Callable[[], None]]):
        self.number = number
        self.source = source  # kept alive until every peer has read it
        self.reads = reads  # peer -> (offset into the peer's source, destination tensor, accumulate)
        self.finish = finish
        self.read_done = False
        self.done = False


class SameHostTransport:
    """Reduce-scatter and all-gather between the ranks of one group on one host (see module doc)."""

    def __init__(self, rank: int, size: int, pids: list[int], mailbox: mmap.mmap, timeout_seconds: float):
        """`mailbox`: the group's mailbox as mapped by `open_mailbox` (the transport owns it from here)."""
        self.rank, self.size, self.pids = rank, size, pids
        self.timeout_seconds = timeout_seconds
        self._map = mailbox
        self._words = (ctypes.c_int64 * (1 + size * _BLOCK)).from_buffer(self._map)
        self._base = ctypes.addressof(self._words)
        self._next_op = 1  # op 0 would match the mailbox's zeroed records
        self._pending: list[_Op] = []
        self._lock = threading.RLock()
        self._scratch: Optional[torch.Tensor] = None
        self._words[self._index(rank, _PID)] = os.getpid()

    # --- mailbox words ------------------------------------------------------------------------
    def _index(self, rank: int, word: int) -> int:
        return 1 + rank * _BLOCK + word

    def _posted(self, rank: int, slot: int) -> tuple[int, int, int]:
        at = self._index(rank, _POSTS + 3 * slot)
        return self._words[at], self._words[at + 1], self._words[at + 2]

    def _acked(self, rank: int, slot: int) -> int:
        return self._words[self._index(rank, _ACKS + slot)]

    def _doorbell_address(self, rank: int) -> int:
        return self._base + 8 * self._index(rank, _DOORBELL)  # low 32 bits (little-endian)

    def _ring(self) -> None:
        libc = _libc()
        for peer in range(self.size):
            if peer != self.rank:
                at = self._index(peer, _DOORBELL)
                self._words[at] = (self._words[at] + 1) & 0x7FFFFFFF
                libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(self._doorbell_address(peer)),
                             ctypes.c_int(_FUTEX_WAKE), ctypes.c_int(2 ** 31 - 1), None, None, ctypes.c_int(0))

    def _sleep(self, bell: int, seconds: float) -> None:
        timeout = _TimeSpec(int(seconds), int((seconds % 1) * 1e9))
        _libc().syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(self._doorbell_address(self.rank)),
                        ctypes.c_int(_FUTEX_WAIT), ctypes.c_int(bell), ctypes.byref(timeout), None, ctypes.c_int(0))

    # --- posting and progress -------------------------------------------------------------------
    def post(self, source: torch.Tensor, reads: dict, finish: Optional[Callable[[], None]], kind: str) -> "_Handle":
        """Offer `source` to the peers as this rank's part of the next op; read `reads` from theirs.

        `reads` maps peer -> (byte offset into that peer's source, destination tensor,
        accumulate): the destination receives (or, with accumulate, is increased by) the bytes."""
        with self._lock:
            op = _Op(self._next_op, source, reads, finish)
            self._next_op += 1
            slot = op.number % SLOTS
            previous = op.number - SLOTS
            self._block_until(lambda: all(self._acked(peer, slot) >= previous for peer in self._peers()),
                              kind, waiting_for="acknowledge an earlier op")
            at = self._index(self.rank, _POSTS + 3 * slot)
            self._words[at + 1] = source.data_ptr()
            self._words[at + 2] = source.numel() * source.element_size()
            self._words[at] = op.number  # last: peers read the record once they see its number
            self._pending.append(op)
            self._ring()
            self._progress()
        return _Handle(self, op, kind)

    def _peers(self) -> list[int]:
        return [peer for peer in range(self.size) if peer != self.rank]

    def _progress(self) -> None:
        """Read every pending op whose peers have posted; retire ops every peer has read."""
        finished_reading = False
        for op in self._pending:
            if op.read_done:
                continue
            slot = op.number % SLOTS
            records = {peer: self._posted(peer, slot) for peer in op.reads}
            if any(number != op.number for number, _, _ in records.values()):
                continue
            for peer, (offset, destination, accumulate) in op.reads.items():
                _, address, nbytes = records[peer]
                if offset + destination.numel() * destination.element_size() > nbytes:
                    raise RuntimeError(f"rank {peer} posted {nbytes} bytes for op {op.number}; rank {self.rank} "
                                       f"expected at least {offset + destination.nbytes} (collectives out of order?)")
                self._read(peer, address + offset, destination, accumulate)
            if op.finish is not None:
                op.finish()
            op.read_done = True
            self._words[self._index(self.rank, _ACKS + slot)] = op.number
            finished_reading = True
        if finished_reading:
            self._ring()
        for op in self._pending:
            if op.read_done:
                slot = op.number % SLOTS
                op.done = all(self._acked(peer, slot) >= op.number for peer in self._peers())
        for op in self._pending:
            if op.done:
                op.source = op.reads = op.finish = None
        self._pending = [op for op in self._pending if not op.done]

    def _read(self, peer: int, address: int, destination: torch.Tensor, accumulate: bool) -> None:
        if not accumulate:
            read_from(self.pids[peer], address, destination)
            return
        flat = destination.view(-1)
        piece = max(1, _SCRATCH_BYTES // destination.element_size())
        if self._scratch is None or self._scratch.dtype != destination.dtype:
            self._scratch = torch.empty(piece, dtype=destination.dtype)
        for start in range(0, flat.numel(), piece):
            part = flat[start:start + piece]
            scratch = self._scratch[:part.numel()]
            read_from(self.pids[peer], address + start * destination.element_size(), scratch)
            part.add_(scratch)

    def _block_until(self, condition: Callable[[], bool], kind: str, waiting_for: str) -> None:
        """Progress (and sleep on the doorbell) until `condition()`; a dead or silent peer raises."""
        start = last_check = time.monotonic()
        bell_index = self._index(self.rank, _DOORBELL)
        while True:
            bell = int(self._words[bell_index])
            self._progress()
            if condition():
                return
            now = time.monotonic()
            if now - last_check >= _LIVENESS_SECONDS:
                last_check = now
                dead = [peer for peer in self._peers() if not _alive(self.pids[peer])]
                if dead:
                    raise ConnectionError(f"{kind}: rank(s) {dead} of this group died (waiting for them to "
                                          f"{waiting_for})")
                if now - start > self.timeout_seconds:
                    raise TimeoutError(f"{kind}: no answer from the peers within {self.timeout_seconds:.0f} s "
                                       f"(waiting for them to {waiting_for})")
            self._lock.release()
            try:
                self._sleep(bell, min(_LIVENESS_SECONDS, 0.05 + (now - start)))
            finally:
                self._lock.acquire()

    def wait(self, op: _Op, kind: str) -> None:
        with self._lock:
            self._block_until(lambda: op.done, kind, waiting_for="post or read their part")

    def close(self) -> None:
        try:
            del self._words
            self._map.close()
        except (BufferError, AttributeError):  # a handle still refers to the mapping: leave it to exit
            pass


class _Handle:
    """Async handle of one transport op (wait() as for torch.distributed work)."""

    def __init__(self, transport: SameHostTransport, op: _Op, kind: str):
        self._transport, self._op, self._kind = transport, op, kind

    def wait(self) -> bool:
        if not self._op.done:
            self._transport.wait(self._op, self._kind)
        return True

    def is_completed(self) -> bool:
        return self._op.done


class SetupExchange(Protocol):
    """The group's own collectives the setup needs (a `Comm`'s: so a peer that never arrives is named)."""

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's picklable `obj`, in rank order."""

    def barrier(self) -> None:
        """Wait until every rank of the group gets here."""


def connect(group: SetupExchange, rank: int, size: int, timeout_seconds: float) -> Optional[SameHostTransport]:
    """Collective over `group` (its exchange, not torch.distributed directly: `comm.core` calls the collectives):
    a transport when every rank is on this host, maps the mailbox and can read the others, else None (on every
    rank: the verdict is agreed)."""
    here = supported_here()
    probe = torch.tensor([rank * 7919 + 12345], dtype=torch.int64)
    mailbox = None
    if rank == 0 and here:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        mailbox = os.path.join(directory, f"zerotrain-mailbox-{uuid.uuid4().hex}")
        with open(mailbox, "wb") as file:
            file.truncate(_mailbox_bytes(size))
    mapped: Optional[mmap.mmap] = None
    try:
        info = (here, (socket.gethostname(), _boot_id(), _net_namespace()), os.getpid(), probe.data_ptr(), mailbox,
                os.getppid())
        everyone = group.all_gather_object(info)
        same_host = everyone[0][4] is not None and all(entry[0] and entry[1] == everyone[0][1] for entry in everyone)
        if same_host:  # the same host by every name, but perhaps not the same /dev/shm: this rank must see the file
            mapped = open_mailbox(everyone[0][4], size)
        readable = False
        if same_host and allow_siblings(_ptrace_scope(), [entry[5] for entry in everyone]):
            group.barrier()  # every rank allows its siblings before anyone probes
        if mapped is not None:
            try:
                for peer in range(size):
                    value = torch.empty(1, dtype=torch.int64)
                    read_from(everyone[peer][2], everyone[peer][3], value)
                    readable = int(value) == peer * 7919 + 12345
                    if not readable:
                        break
            except OSError:  # ptrace policy (e.g. Yama) forbids it, or the pid is not ours
                readable = False
        verdicts = group.all_gather_object(readable)
        transport = None
        if all(verdicts):
            pids = [entry[2] for entry in everyone]
            transport, mapped = SameHostTransport(rank, size, pids, mapped, timeout_seconds), None
        group.barrier()  # every rank has mapped the mailbox (or given up) before it goes away
    finally:
        if mapped is not None:  # mapped, but some rank could not: sockets for all
            mapped.close()
        if mailbox is not None:
            os.unlink(mailbox)
    return transport
