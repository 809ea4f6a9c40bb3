"""#50 (run 27): is a checkpoint's cold read / durable write limited by queue depth rather than by bytes?

Each of PROCS processes (two = two ranks at once, sharing the disk) owns one file of SIZE MiB. Every round
runs every variant once, the order rotated per round; before a read variant the file is fsynced and dropped
from the page cache (posix_fadvise DONTNEED, as checkpoint_speed.py does); a write variant writes a new file
(set to its length first, as `directio.PlacedWriter` does) and fsyncs it; the time is the slower process's,
from a barrier to its last byte (reads: crc32 verified against the source; writes: crc32 of what was written).

Reads (into a destination tensor that already exists, page-aligned):
  mmap        today's checksum pass: the file mapped 8 MiB at a time, crc32 over the mapping (page faults =
              the disk read: readahead-sized requests, one stream), then nothing copied (a lower bound of
              today's pass + copy)
  buf1        one stream of buffered 8 MiB preadv straight into the destination, crc32 per landed chunk
              (ckpt5's start-up read)
  dio_tN_cM   N threads, O_DIRECT preadv of M MiB chunks straight into the destination (thread i takes
              the next chunk from a shared counter), crc32 of each landed chunk in the same thread, the
              chunks' crc32 joined with crc32_combine
  buf_tN_cM   as dio, buffered (through the page cache)
  mmapcopy    as mmap, each mapped chunk copied into the destination, crc32 on the destination
  bounce_tN_cM  as dio, each thread reading into its own aligned buffer and copying into the destination
              (a tensor's bytes inside a safetensors file are not aligned as O_DIRECT needs)
Writes (from a source tensor, page-aligned):
  wplaced     the save's `directio.PlacedWriter` with two aligned 8 MiB buffers (main before run 27: copy
              into one, crc32 + O_DIRECT write of the other on one writer thread), fsync
  wplaced_bN  the same with N buffers, N - 1 writes in flight (run 27)
  wbuf        buffered write of the whole tensor, then fsync (DeepSpeed's torch.save + fsync, less pickling)
  wdio_tN_cM  N threads, O_DIRECT pwritev of M MiB chunks straight from the source, crc32 per chunk in the
              same thread, then fsync
  wfdio_tN_cM as wdio, the file's blocks allocated first (posix_fallocate) instead of left a hole

Usage: python benchmarks/io_depth.py [--size-mib 400] [--procs 2] [--rounds 5] [--variants a,b,...] [--dir D]
"""
from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import statistics
import tempfile
import threading
import time

import numpy
import torch

from checkpoint_speed import _drop_cache_file as evict  # fsync, then out of the page cache: the benchmark's cold
from zerotrain.checkpoint.directio import PlacedWriter
from zerotrain.checkpoint.format import crc32
from zerotrain.checkpoint.integrity import crc32_combine

DEFAULT = ("mmap,buf1,dio_t1_c8,dio_t2_c8,dio_t4_c4,dio_t4_c8,dio_t4_c16,dio_t8_c8,dio_t8_c16,"
           "wplaced,wbuf,wdio_t1_c8,wdio_t4_c8,wdio_t8_c8,wdio_t4_c16")


def aligned(size: int) -> torch.Tensor:
    raw = torch.empty(size + 4096, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % 4096
    return raw[skip:skip + size]


def parse(name: str) -> tuple[int, int]:
    _, t, c = name.split("_")
    return int(t[1:]), int(c[1:]) << 20


def chunked(size: int, chunk: int, threads: int, work) -> int:
    """`work(offset, length) -> crc32` over every chunk on `threads` threads; the file's crc32."""
    offsets = list(range(0, size, chunk))
    crcs = [0] * len(offsets)
    lock = threading.Lock()
    nxt = [0]
    errors = []

    def loop():
        try:
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= len(offsets):
                    return
                offset = offsets[i]
                crcs[i] = work(offset, min(chunk, size - offset))
        except BaseException as error:  # noqa: BLE001 - reported by the caller
            errors.append(error)

    pool = [threading.Thread(target=loop) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]
    crc = crcs[0]
    for i in range(1, len(offsets)):
        crc = crc32_combine(crc, crcs[i], min(chunk, size - offsets[i]))
    return crc


def read_mmap(path: str, size: int, dest: torch.Tensor) -> int:
    fd = os.open(path, os.O_RDONLY)
    crc = 0
    try:
        for offset in range(0, size, 8 << 20):
            with mmap.mmap(fd, min(8 << 20, size - offset), access=mmap.ACCESS_READ, offset=offset) as mapped:
                with memoryview(mapped) as view:
                    crc = crc32(view, crc)
    finally:
        os.close(fd)
    return crc


def read_buf1(path: str, size: int, dest: torch.Tensor) -> int:
    fd = os.open(path, os.O_RDONLY)
    out = dest.numpy()
    try:
        return chunked(size, 8 << 20, 1, lambda o, n: (os.preadv(fd, [out[o:o + n]], o), crc32(out[o:o + n]))[1])
    finally:
        os.close(fd)


def read_dio(threads: int, chunk: int, path: str, size: int, dest: torch.Tensor) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    out = dest.numpy()

    def work(o: int, n: int) -> int:
        got = os.preadv(fd, [out[o:o + n]], o)
        if got != n:
            raise OSError(f"short read {got} of {n} at {o}")
        return crc32(out[o:o + n])
    try:
        return chunked(size, chunk, threads, work)
    finally:
        os.close(fd)


def read_buf(threads: int, chunk: int, path: str, size: int, dest: torch.Tensor) -> int:
    fd = os.open(path, os.O_RDONLY)
    out = dest.numpy()
    try:
        return chunked(size, chunk, threads, lambda o, n: (os.preadv(fd, [out[o:o + n]], o), crc32(out[o:o + n]))[1])
    finally:
        os.close(fd)


def read_bounce(threads: int, chunk: int, path: str, size: int, dest: torch.Tensor) -> int:
    """as dio, but each thread reads into its own aligned buffer and copies the bytes out (a destination whose
    address does not match the file offset's alignment: a tensor inside a safetensors file)"""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buffers = threading.local()
    out = dest.numpy()

    def work(o: int, n: int) -> int:
        buffer = getattr(buffers, "b", None)
        if buffer is None:
            buffer = buffers.b = aligned(chunk).numpy()
        got = os.preadv(fd, [buffer[:n]], o)
        if got != n:
            raise OSError(f"short read {got} of {n} at {o}")
        piece = out[o:o + n]
        piece[:] = buffer[:n]  # numpy's copy: one thread, the GIL released
        return crc32(piece)
    try:
        return chunked(size, chunk, threads, work)
    finally:
        os.close(fd)


def read_mmapcopy(path: str, size: int, dest: torch.Tensor) -> int:
    """the mapping's readahead, the bytes copied into the destination, crc32 on the destination"""
    fd = os.open(path, os.O_RDONLY)
    out = dest.numpy()
    crc = 0
    try:
        for offset in range(0, size, 8 << 20):
            n = min(8 << 20, size - offset)
            with mmap.mmap(fd, n, access=mmap.ACCESS_READ, offset=offset) as mapped:
                piece = out[offset:offset + n]
                with memoryview(mapped) as view:
                    piece[:] = numpy.frombuffer(view, dtype=numpy.uint8)
                crc = crc32(piece, crc)
    finally:
        os.close(fd)
    return crc


def write_placed(buffers: int, path: str, size: int, src: torch.Tensor) -> int:
    writer = PlacedWriter(crc32, crc32_combine, buffers=buffers)
    writer.open(path, size)
    writer.begin(path, 0)
    view = src.numpy()
    for offset in range(0, size, 4 << 20):  # the save hands tensors over piece by piece
        writer.write(view[offset:offset + (4 << 20)])
    (_, _, _, crc), = writer.close()
    return crc


def write_buf(path: str, size: int, src: torch.Tensor) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    view = src.numpy()
    try:
        written = 0
        while written < size:
            written += os.write(fd, view[written:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return crc32(view)


def write_dio(threads: int, chunk: int, path: str, size: int, src: torch.Tensor, allocate: bool = False) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    view = src.numpy()
    if allocate:
        os.posix_fallocate(fd, 0, size)
    else:
        os.ftruncate(fd, size)

    def work(o: int, n: int) -> int:
        crc = crc32(view[o:o + n])
        got = os.pwritev(fd, [view[o:o + n]], o)
        if got != n:
            raise OSError(f"short write {got} of {n} at {o}")
        return crc
    try:
        crc = chunked(size, chunk, threads, work)
        os.fsync(fd)
    finally:
        os.close(fd)
    return crc


def variant(name: str):
    if name == "mmap":
        return "read", read_mmap
    if name == "buf1":
        return "read", read_buf1
    if name.startswith("dio_"):
        t, c = parse(name)
        return "read", lambda p, s, d: read_dio(t, c, p, s, d)
    if name.startswith("buf_"):
        t, c = parse(name)
        return "read", lambda p, s, d: read_buf(t, c, p, s, d)
    if name.startswith("bounce_"):
        t, c = parse(name)
        return "read", lambda p, s, d: read_bounce(t, c, p, s, d)
    if name == "mmapcopy":
        return "read", read_mmapcopy
    if name.startswith("wplaced"):
        buffers = int(name[len("wplaced_b"):]) if name.startswith("wplaced_b") else 2
        return "write", lambda p, s, d: write_placed(buffers, p, s, d)
    if name.startswith("wfdio_"):
        t, c = parse(name)
        return "write", lambda p, s, d: write_dio(t, c, p, s, d, allocate=True)
    if name == "wbuf":
        return "write", write_buf
    if name.startswith("wdio_"):
        t, c = parse(name)
        return "write", lambda p, s, d: write_dio(t, c, p, s, d)
    raise SystemExit(f"io_depth: unknown variant {name!r}")


def worker(rank: int, directory: str, size: int, barrier, conn) -> None:
    torch.manual_seed(rank)
    src = aligned(size)
    src.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    expected = crc32(src.numpy())
    dest = aligned(size)
    dest.fill_(1)
    path = os.path.join(directory, f"io_depth_{os.getpid()}.bin")
    write_buf(path, size, src)
    try:
        while True:
            name = conn.recv()
            if name is None:
                break
            kind, fn = variant(name)
            target = path if kind == "read" else path + ".w"
            if kind == "read":
                evict(path)
            barrier.wait()
            begin = time.perf_counter()
            crc = fn(target, size, dest if kind == "read" else src)
            seconds = time.perf_counter() - begin
            if crc != expected:
                raise SystemExit(f"{name}: crc32 {crc:#x} != {expected:#x}")
            if kind == "read" and name != "mmap" and not torch.equal(dest, src):
                raise SystemExit(f"{name}: destination differs from the file")
            if kind == "write":
                os.unlink(target)
            dest.fill_(1)
            conn.send(seconds)
    finally:
        os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=400)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", default=DEFAULT)
    parser.add_argument("--dir", default=os.path.dirname(os.path.abspath(__file__)))
    args = parser.parse_args()
    names = args.variants.split(",")
    for name in names:
        variant(name)
    size = args.size_mib << 20
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(args.procs)
    pipes, procs = [], []
    for rank in range(args.procs):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(rank, args.dir, size, barrier, child), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    times: dict[str, list[float]] = {name: [] for name in names}
    print(f"io_depth: {args.procs} processes x {args.size_mib} MiB in {args.dir}, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    try:
        for round_ in range(args.rounds):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in order:
                for conn in pipes:
                    conn.send(name)
                times[name].append(max(conn.recv() for conn in pipes))
            print(f"round {round_}: " + ", ".join(f"{n} {times[n][-1]:.3f}" for n in names), flush=True)
    finally:
        for conn in pipes:
            conn.send(None)
        for proc in procs:
            proc.join()
    total = size * args.procs
    print(f"\n{args.procs} x {args.size_mib} MiB, {args.rounds} rounds, load average {os.getloadavg()[0]:.1f} "
          f"at the end; the slower process's seconds")
    print("| variant | median s | spread s | GB/s (all processes) | / mmap or wplaced |")
    print("|---|---|---|---|---|")
    for name in names:
        med = statistics.median(times[name])
        base = "mmap" if not name.startswith("w") else "wplaced"
        ratio = f"{med / statistics.median(times[base]):.2f}" if base in times else "-"
        print(f"| {name} | {med:.3f} | {min(times[name]):.3f}-{max(times[name]):.3f} | {total / med / 1e9:.2f} | "
              f"{ratio} |")


if __name__ == "__main__":
    main()
