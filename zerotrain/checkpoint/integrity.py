"""The manifest: the commit record of a checkpoint, with every file's size and checksum.

Checksum: zlib's crc32 (computed with ISA-L's implementation, `isal`, when installed: the same
values, 4x faster here). Measured on this project's machine (256 MiB of random bytes,
16 MiB updates, one core): crc32 6.4 GB/s, adler32 3.8, sha1 2.0, sha256 1.9 (SHA-NI),
blake2b 1.3, sha512 1.1, md5 0.8 GB/s; writing the same bytes with fsync ran at
0.34 GB/s on the shared disk, and the disk's O_DIRECT rate is 2.3 GB/s write and
1.0 GB/s read. Only crc32 stays well ahead of the disk (3x its best write rate, 6x
its read rate), it releases the GIL on large buffers (so a background writer does
not stall training), and it is computed as the bytes are written, so saving never
reads a file back. It detects truncation and flipped bits; it is not meant to resist
deliberate tampering.

Loading with `checkpoint.verify_on_load` checks every byte of every file the load
needs before anything is applied, and that check is the load's read from the disk:
the needed files are laid end to end and cut into one equal byte range per rank
(`checksum_share`), which it maps chunk after chunk through the page cache, each
chunk's crc32 computed on the mapped pages (nothing copied out). The pieces of every rank are
gathered (in the load's one all-gather of outcomes) and joined per file with
`crc32_combine` (crc32 is linear: the crc of A+B follows from crc(A), crc(B) and
len(B)), so every rank compares the same whole-file crc32 with the manifest and
raises the same error naming the file. The load's own reads then come from memory.

A checkpoint without a manifest is not a checkpoint: the manifest is written last,
fsynced, and only then is the temporary directory renamed into place.
"""
from __future__ import annotations

import bisect
import mmap
import os
import time
from typing import Iterable, Optional

from .directio import READ_CHUNK, DirectReader, run_parallel
from .format import FORMAT_NAME, FORMAT_VERSION, MANIFEST, CheckpointError, crc32, read_json, write_json

CHECKSUM = "crc32"
# One thread per rank maps its share chunk after chunk: the kernel's readahead of a sequential mapping
# keeps the disk busy by itself. Measured (two processes at once, 0.45 GB each, cold): one thread
# 0.40-0.62 s and 0.01-0.03 s of kernel time; four threads 0.52-0.98 s and 0.12-0.14 s (their faults
# in four places of the file defeat the readahead); pread into a buffer 0.53-2.2 s, 0.2-0.8 s kernel.
CHECKSUM_THREADS = 1
SMALL_PIECE = 64 << 10  # pieces of a share up to this size are read (one pread), larger ones mapped


def crc32_text(crc: int) -> str:
    """A crc32 as the manifest spells it: 8 lowercase hex digits (the one formatter; `parse_crc32` reads it)."""
    return f"{crc:08x}"


def parse_crc32(text: str, where: str = "manifest") -> int:
    """The crc32 a manifest entry spells (`crc32_text`): always hexadecimal, also when its digits are all 0-9.
    `where` (the manifest and file) names the entry in the error."""
    if not isinstance(text, str) or len(text) != 8 or any(c not in "0123456789abcdefABCDEF" for c in text):
        raise CheckpointError(f"{where}: crc32 {text!r} is not 8 hexadecimal digits")
    return int(text, 16)


def manifest_entry(size: int, crc: int) -> dict:
    """A file's manifest entry: its size and crc32 (spelled by `crc32_text`)."""
    return {"size": size, "crc32": crc32_text(crc)}


def file_crc32(path: str) -> int:
    """crc32 of a whole file, streamed (O_DIRECT when possible: the file is not left in the page cache)."""
    crc = 0
    with DirectReader(path) as reader:
        for chunk in reader.chunks(0, os.path.getsize(path)):
            crc = crc32(chunk, crc)
    return crc


def write_manifest(directory: str, files: dict[str, dict], info: dict, fsync: bool = True) -> str:
    """Write manifest.json listing `files` ({name: {"size", "crc32"}}) plus `info`, fsynced unless `fsync` is
    False (the caller fsyncs it: a save's commit, with its directory); returns its path."""
    payload = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "checksum": CHECKSUM,
               "committed_at_ns": time.time_ns(), **info,
               "files": {name: files[name] for name in sorted(files)}}
    path = os.path.join(directory, MANIFEST)
    write_json(path, payload, fsync=fsync)
    return path


def read_manifest(directory: str) -> dict:
    """The manifest of a committed checkpoint directory, or a CheckpointError saying why there is none."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{directory} has no {MANIFEST}: it is not a committed zerotrain checkpoint "
                              f"(a save was interrupted, or files were removed)")
    manifest = read_json(path, MANIFEST)
    if manifest.get("format") != FORMAT_NAME or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path} is not a zerotrain checkpoint manifest")
    if int(manifest.get("format_version", 0)) > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {manifest['format_version']} is newer than this "
                              f"zerotrain reads ({FORMAT_VERSION})")
    if manifest.get("checksum") != CHECKSUM:
        raise CheckpointError(f"{path}: unknown checksum {manifest.get('checksum')!r}")
    return manifest


def check_sizes(directory: str, manifest: dict, names: Iterable[str]) -> None:
    """Every named file exists with the size the manifest records (cheap: stat only)."""
    for name in names:
        entry = manifest["files"].get(name)
        if entry is None:
            raise CheckpointError(f"{os.path.join(directory, name)} is not listed in the manifest")
        path = os.path.join(directory, name)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise CheckpointError(f"file is missing: {path} (listed in the manifest)") from None
        if size != int(entry["size"]):
            raise CheckpointError(f"{path} has {size} bytes, the manifest records {entry['size']} "
                                  f"(truncated or overwritten)")


# crc32_combine: zlib has it in C but Python's zlib module does not expose it. The polynomial
# arithmetic is zlib's (crc32.c, multmodp / x2nmodp), over the reflected polynomial.
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the crc polynomial (reflected bit order)."""
    m, product = 1 << 31, 0
    while True:
        if a & m:
            product ^= b
            if not a & (m - 1):
                return product
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))
_SHIFTS: dict[int, int] = {}


def _zeros_operator(length: int) -> int:
    """x^(8 * length) modulo the polynomial: appending `length` zero bytes, as a multiplier."""
    shift = _SHIFTS.get(length)
    if shift is None:
        shift, n, k = 1 << 31, length, 3
        while n:
            if n & 1:
                shift = _multmodp(_X2N[k & 31], shift)
            n >>= 1
            k += 1
        if len(_SHIFTS) < 4096:
            _SHIFTS[length] = shift
    return shift


def _crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """crc32 of A followed by B, from crc32(A), crc32(B) and len(B)."""
    return _multmodp(_zeros_operator(length2), crc1) ^ crc2


try:  # ISA-L's, in C: a load at start-up joins a piece per tensor read (measured: 0.4 us a call, 58 us here)
    from isal.isal_zlib import crc32_combine
except ImportError:  # pragma: no cover - isal is a dependency
    crc32_combine = _crc32_combine


Piece = tuple  # (file name, offset, length, crc32 of those bytes)


def balanced_share(total: int, rank: int, loads: list[int]) -> tuple[int, int]:
    """This rank's byte range [low, high) of `total` bytes shared out so that each rank's `loads` (bytes it
    reads anyway) plus its share come out as equal as whole bytes allow: the ranks that read least take the
    most (run 27: a rank that waits for the other's larger share at the verdict loses the difference)."""
    low, high = 0, max(loads) + total
    while low < high:  # the lowest level the ranks can be filled up to with `total` bytes
        level = (low + high) // 2
        if sum(max(0, level - load) for load in loads) >= total:
            high = level
        else:
            low = level + 1
    shares = [max(0, low - load) for load in loads]
    excess = sum(shares) - total  # under one byte per rank with a share: the last of them give one back
    for index in reversed(range(len(shares))):
        if excess and shares[index]:
            shares[index] -= 1
            excess -= 1
    begin = sum(shares[:rank])
    return begin, begin + shares[rank]


def checksum_share(directory: str, manifest: dict, names: Iterable[str], rank: int, world: int,
                   threads: int = CHECKSUM_THREADS, skip: Optional[dict] = None,
                   loads: Optional[list[int]] = None) -> dict:
    """crc32 pieces of this rank's share: `names` laid end to end (sorted), byte range
    [total*rank/world, total*(rank+1)/world) of them, read through the page cache (so that the load's
    reads of the same bytes come from memory) in READ_CHUNK pieces, on `threads` threads.

    `skip` ({file name: Intervals}): byte ranges some rank checksums as it reads them straight into its
    tensors (a load at start-up, `reader.TensorReader.read_checked`); only the rest of the files is laid end
    to end and shared out; `loads` (bytes each rank reads that way) balances the shares (`balanced_share`).

    Returns {"files": {name: [size, manifest crc32]}, "pieces": [(name, offset, length, crc32)]}, one
    piece per file touched; `check_pieces` judges the files from every rank's share."""
    names = sorted(names)
    files = [(name, int(manifest["files"][name]["size"])) for name in names]
    segments = [(name, begin, end) for name, size in files
                for begin, end in ((skip or {}).get(name) or Intervals()).gaps(size)]
    total = sum(end - begin for _, begin, end in segments)
    if loads is not None and len(loads) == world and any(loads):
        low, high = balanced_share(total, rank, loads)
    else:
        low, high = total * rank // world, total * (rank + 1) // world
    # the share cut into READ_CHUNK pieces of files: one task each, spread over the threads
    tasks, position = [], 0
    for name, first, last in segments:
        size = last - first
        begin, end = max(low, position), min(high, position + size)
        for start in range(begin, end, READ_CHUNK):
            tasks.append((name, first + start - position, min(READ_CHUNK, end - start)))
        position += size

    fds: dict[str, int] = {}  # one descriptor per file of the share, opened before the tasks run

    def crc_of(task) -> Piece:
        name, offset, length = task
        path = os.path.join(directory, name)
        try:
            if length <= SMALL_PIECE:  # a gap between ranges read straight in (a header, a scalar state)
                data = os.pread(fds[name], length, offset)
                if len(data) < length:
                    raise ValueError(f"the file ends at byte {offset + len(data)}")
                return name, offset, length, crc32(data)
            # the crc32 is computed on the page cache's own pages, mapped rather than copied out
            # (measured: half the kernel time of pread into a buffer, 0.10 s instead of 0.20 s per
            # cold 0.45 GB). mmap refuses a range past the end of the file (ValueError); committed
            # files are never rewritten in place, so none shrinks while it is mapped.
            skip = offset % mmap.ALLOCATIONGRANULARITY
            with mmap.mmap(fds[name], skip + length, access=mmap.ACCESS_READ, offset=offset - skip) as mapped:
                with memoryview(mapped) as view:
                    return name, offset, length, crc32(view[skip:])
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{path}: cannot read it to check its checksum: {error}") from error

    try:
        for name in dict.fromkeys(task[0] for task in tasks):
            try:
                fds[name] = os.open(os.path.join(directory, name), os.O_RDONLY)
            except OSError as error:
                raise CheckpointError(f"{os.path.join(directory, name)}: cannot read it to check its checksum: "
                                      f"{error}") from error
        pieces = _join(run_parallel([lambda task=task: crc_of(task) for task in tasks], threads))
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"files": {name: [size, manifest["files"][name]["crc32"]] for name, size in files}, "pieces": pieces}


class Intervals:
    """Disjoint, sorted byte ranges [begin, end) of one file (the ranges a load reads straight into tensors)."""

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()):
        self.ranges: list[list[int]] = []
        for begin, end in ranges:
            self.add(begin, end)

    def add(self, begin: int, end: int) -> None:
        """Add [begin, end), merged with every range it touches."""
        if begin >= end:
            return
        index = bisect.bisect_left(self.ranges, [begin, begin])
        if index and self.ranges[index - 1][1] >= begin:
            index -= 1
        stop = index
        while stop < len(self.ranges) and self.ranges[stop][0] <= end:
            begin, end = min(begin, self.ranges[stop][0]), max(end, self.ranges[stop][1])
            stop += 1
        self.ranges[index:stop] = [[begin, end]]

    def minus(self, begin: int, end: int) -> list[tuple[int, int]]:
        """The parts of [begin, end) that no range here covers, in order."""
        parts = []
        index = bisect.bisect_left(self.ranges, [begin, begin])
        if index and self.ranges[index - 1][1] > begin:
            index -= 1
        for low, high in self.ranges[index:]:
            if low >= end:
                break
            if low > begin:
                parts.append((begin, low))
            begin = max(begin, high)
        if begin < end:
            parts.append((begin, end))
        return parts

    def gaps(self, size: int) -> list[tuple[int, int]]:
        """The parts of [0, size) that no range here covers."""
        return self.minus(0, size)


def claimed_ranges(mine: list[tuple[str, int, int]], lower: Iterable[tuple[str, int, int]]) -> list[list]:
    """For each of this rank's ranges (file, begin, end), in order, the parts whose crc32 this rank reports:
    those no lower rank reads (`lower`: theirs) and no earlier range of this rank covers. Joined with the
    other ranks' claims and the checksum shares of everything nobody reads (`checksum_share`'s `skip`), they
    cover every byte of every needed file exactly once, however the ranks' reads overlap (replicated states at
    stage 0, a pipeline's tied copies)."""
    taken: dict[str, Intervals] = {}
    for name, begin, end in lower:
        taken.setdefault(name, Intervals()).add(begin, end)
    claims = []
    for name, begin, end in mine:
        held = taken.setdefault(name, Intervals())
        claims.append(held.minus(begin, end))
        held.add(begin, end)
    return claims


def _join(pieces: list[Piece]) -> list[Piece]:
    """Adjacent pieces of the same file joined into one (their crc32s combined)."""
    joined: list[list] = []
    for name, offset, length, crc in sorted(pieces):
        last = joined[-1] if joined else None
        if last is not None and last[0] == name and last[1] + last[2] == offset:
            last[3] = crc32_combine(last[3], crc, length)
            last[2] += length
        else:
            joined.append([name, offset, length, crc])
    return [tuple(piece) for piece in joined]


def join_runs(directory: str, sizes: dict[str, int], runs: Iterable[Piece]) -> dict[str, int]:
    """{file name: crc32 of the whole file} from the byte runs every rank wrote in place ((name, offset, length,
    crc32) each, `directio.PlacedWriter`), joined with `crc32_combine`: a save's manifest entries without reading
    any file back. CheckpointError naming the file when its runs do not cover its `sizes` bytes exactly once."""
    by_file: dict[str, list[Piece]] = {name: [] for name in sizes}
    for run in runs:
        if run[0] not in by_file:
            raise CheckpointError(f"{os.path.join(directory, run[0])}: written, but not a file of the save plan")
        by_file[run[0]].append(tuple(run))
    crcs = {}
    for name, size in sizes.items():
        joined = _join(by_file[name])
        if len(joined) == 1 and joined[0][1] == 0 and joined[0][2] == size:
            crcs[name] = joined[0][3]
            continue
        path, position = os.path.join(directory, name), 0
        for _, offset, length, _ in joined:
            if offset != position:
                what = "written by no rank" if offset > position else "written twice"
                raise CheckpointError(f"{path}: bytes {min(offset, position)} to {max(offset, position)} of "
                                      f"{size} were {what}")
            position = offset + length
        if position < size:
            raise CheckpointError(f"{path}: bytes {position} to {size} of {size} were written by no rank")
        raise CheckpointError(f"{path}: written to byte {position}, past its {size} bytes")
    return crcs


def check_pieces(directory: str, shares: list[dict], complete: bool = False) -> Optional[str]:
    """Join the pieces of every rank's share (`checksum_share`) into whole-file crc32s and compare them with
    the manifest's: the error naming the corrupt file(s), None when all match. A file whose pieces do not
    cover it exactly (a rank failed before it finished its share) is not judged here: that rank's own
    error is reported instead; with `complete` (every rank succeeded) such a file is an error too, naming
    the bytes nobody checked or checked twice. Every rank passes the same shares, so every rank reaches
    the same verdict."""
    bad = list(corrupt_files(directory, shares, complete).values())
    if not bad:
        return None
    return bad[0] if len(bad) == 1 else f"{len(bad)} files are corrupt: " + "; ".join(bad)


def corrupt_files(directory: str, shares: list[dict], complete: bool = False) -> dict[str, str]:
    """{file name: error} for every file whose joined pieces (see `check_pieces`) do not match the manifest
    (with `complete`, also every file they do not cover exactly once)."""
    files: dict[str, list] = {}
    by_file: dict[str, list[Piece]] = {}
    for share in shares:
        for name, entry in share["files"].items():
            files.setdefault(name, entry)
        for piece in share["pieces"]:
            by_file.setdefault(piece[0], []).append(tuple(piece))
    bad = {}
    for name in sorted(files):
        size, expected = files[name]
        joined = _join(by_file.get(name, []))
        if size == 0 and not joined:
            actual = 0
        elif len(joined) == 1 and joined[0][1] == 0 and joined[0][2] == size:
            actual = joined[0][3]
        else:
            if complete:
                bad[name] = _coverage_error(os.path.join(directory, name), size, joined)
            continue
        if actual != parse_crc32(expected, f"{os.path.join(directory, MANIFEST)} entry {name!r}"):
            bad[name] = (f"{os.path.join(directory, name)}: checksum mismatch (crc32 {crc32_text(actual)}, manifest says "
                         f"{expected}): the file is corrupt")
    return bad


def _coverage_error(path: str, size: int, joined: list[Piece]) -> str:
    """Why `joined` (sorted, adjacent pieces joined) does not cover [0, size) exactly once."""
    position = 0
    for _, offset, length, _ in joined:
        if offset != position:
            what = "checked by no rank" if offset > position else "checked twice"
            return f"{path}: bytes {min(offset, position)} to {max(offset, position)} of {size} were {what}"
        position = offset + length
    if position < size:
        return f"{path}: bytes {position} to {size} of {size} were checked by no rank"
    return f"{path}: checked to byte {position}, past its {size} bytes"
