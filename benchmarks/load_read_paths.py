"""#50 item 2 (load path): per-byte cost of the candidate verified-load read paths, cold page cache.

One rank's share as one file of SIZE MiB; the destination is an already-touched tensor (a resumed
optimizer's state). Each round evicts the file from the page cache (posix_fadvise DONTNEED after
fsync; no root needed) and runs every variant once, the order rotated per round:

  current   mmap crc32 chunk by chunk (the cold read), then pread from the page cache into the destination
  inplace   pread straight into the destination chunk by chunk, crc32 of each chunk as it lands
            (lower bound: no rollback kept)
  rollback  a copy of the destination kept first (fresh buffer: its page faults counted), then as inplace
  rollback_warm  as rollback, the copy into a buffer that already exists (an async save's snapshot buffers)
  fresh     pread into a fresh tensor with crc32 per chunk (the design's 'new state tensors swapped in after
            the check'; the swap itself is free)
  current_empty  today's path into new state tensors made with torch.empty instead of zeros (tried in run 23, dropped)
  current_new / inplace_new  today's path / the design into state tensors the optimizer did not have
            (a fresh process resuming: the new zeros are the rollback, nothing to copy)
  pipelined current's two passes overlapped: a thread maps and checksums chunk i+1 while chunk i is copied
            (still verified-before-applied only if the destination is a staging tensor: shown as a bound)

Usage: python benchmarks/load_read_paths.py [--size-mib 384] [--rounds 5] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import threading
import time

import torch

from zerotrain.checkpoint.format import crc32

from checkpoint_speed import _drop_cache_file as evict  # fsync, then drop the file from the page cache

CHUNK = 8 << 20


def mapped_crc(fd: int, offset: int, length: int) -> int:
    with mmap.mmap(fd, length, access=mmap.ACCESS_READ, offset=offset) as mapped:
        with memoryview(mapped) as view:
            return crc32(view)


def current(fd: int, size: int, dest: torch.Tensor) -> int:
    crc = 0
    for offset in range(0, size, CHUNK):
        with mmap.mmap(fd, min(CHUNK, size - offset), access=mmap.ACCESS_READ, offset=offset) as mapped:
            with memoryview(mapped) as view:
                crc = crc32(view, crc)
    out = dest.numpy()
    for offset in range(0, size, CHUNK):
        os.preadv(fd, [out[offset:offset + CHUNK]], offset)
    return crc


def inplace(fd: int, size: int, dest: torch.Tensor) -> int:
    out, crc = dest.numpy(), 0
    for offset in range(0, size, CHUNK):
        piece = out[offset:offset + CHUNK]
        os.preadv(fd, [piece], offset)
        crc = crc32(piece, crc)
    return crc


def rollback(fd: int, size: int, dest: torch.Tensor) -> int:
    kept = dest.clone()  # what a failed verdict would restore
    crc = inplace(fd, size, dest)
    del kept
    return crc


_POOL: dict = {}


def rollback_warm(fd: int, size: int, dest: torch.Tensor) -> int:
    """as rollback, the copy kept in a buffer that already exists (touched): e.g. an async checkpointer's
    snapshot buffers; separates the copy's cost from the page faults of a fresh buffer."""
    kept = _POOL.setdefault(size, torch.ones(size, dtype=torch.uint8))
    kept.copy_(dest)
    return inplace(fd, size, dest)


def fresh(fd: int, size: int, dest: torch.Tensor) -> int:
    new = torch.empty(size, dtype=torch.uint8)
    return inplace(fd, size, new)


def pipelined(fd: int, size: int, dest: torch.Tensor) -> int:
    offsets = list(range(0, size, CHUNK))
    crcs = [0] * len(offsets)
    done = [threading.Event() for _ in offsets]

    def checker():
        for i, offset in enumerate(offsets):
            crcs[i] = mapped_crc(fd, offset, min(CHUNK, size - offset))
            done[i].set()

    thread = threading.Thread(target=checker)
    thread.start()
    out = dest.numpy()
    for i, offset in enumerate(offsets):
        done[i].wait()
        os.preadv(fd, [out[offset:offset + CHUNK]], offset)
    thread.join()
    return crcs[0]  # per-chunk crcs (joining them is crc32_combine's job in the real path; not timed)


def current_new(fd: int, size: int, dest: torch.Tensor) -> int:
    """today's path when the optimizer has no state yet (a fresh process resuming): `_state_tensor`
    allocates zeros, then checksum pass + copy."""
    return current(fd, size, torch.zeros(size, dtype=torch.uint8))


def current_empty(fd: int, size: int, dest: torch.Tensor) -> int:
    """today's path into new state tensors made with torch.empty instead of `_state_tensor`'s zeros:
    checksum pass + copy, no memset pass first (run 23: not faster, dropped)."""
    return current(fd, size, torch.empty(size, dtype=torch.uint8))


def inplace_new(fd: int, size: int, dest: torch.Tensor) -> int:
    """the design for the same tensors: they did not exist before the load, so dropping them is the
    rollback; read + crc32 straight into the new zeros."""
    return inplace(fd, size, torch.zeros(size, dtype=torch.uint8))


VARIANTS = {"current": current, "inplace": inplace, "rollback": rollback, "rollback_warm": rollback_warm, "fresh": fresh, "pipelined": pipelined,
            "current_new": current_new, "current_empty": current_empty, "inplace_new": inplace_new}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; 'current' is always run")
    args = parser.parse_args()
    size = args.size_mib << 20
    path = os.path.join(args.dir, f"load_read_paths_{os.getpid()}.bin")
    data = torch.randint(0, 256, (size,), dtype=torch.uint8)
    with open(path, "wb") as handle:
        handle.write(data.numpy().tobytes())
    expected = crc32(data.numpy())
    dest = torch.zeros(size, dtype=torch.uint8)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = ["current"] + [name for name in args.variants.split(",") if name in VARIANTS and name != "current"]
    times = {name: [] for name in names}
    try:
        fd = os.open(path, os.O_RDONLY)
        for round_ in range(args.rounds):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in order:
                evict(path)
                dest.fill_(0)
                begin = time.perf_counter()
                crc = VARIANTS[name](fd, size, dest)
                times[name].append(time.perf_counter() - begin)
                if name != "pipelined" and crc != expected:
                    raise SystemExit(f"{name}: crc32 mismatch")
                if name not in ("fresh", "current_new", "current_empty", "inplace_new") and not torch.equal(dest, data):
                    raise SystemExit(f"{name}: destination differs from the file")
            print(f"round {round_}: " + ", ".join(f"{n} {times[n][-1]:.3f}" for n in names), flush=True)
        os.close(fd)
    finally:
        os.unlink(path)
    base = statistics.median(times["current"])
    print(f"\n{args.size_mib} MiB, {args.rounds} rounds, load average {os.getloadavg()[0]:.1f}")
    print("| variant | median s | range s | GB/s | / current |")
    print("|---|---|---|---|---|")
    for name in names:
        med = statistics.median(times[name])
        print(f"| {name} | {med:.3f} | {min(times[name]):.3f}-{max(times[name]):.3f} | {size / med / 1e9:.2f} | "
              f"{med / base:.2f} |")


if __name__ == "__main__":
    main()
