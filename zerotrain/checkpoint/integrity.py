"""The manifest: the commit record of a checkpoint, with every file's size and checksum.

Checksum: zlib's crc32. Measured on this project's machine (256 MiB of random bytes,
16 MiB updates, one core): crc32 6.4 GB/s, adler32 3.8, sha1 2.0, sha256 1.9 (SHA-NI),
blake2b 1.3, sha512 1.1, md5 0.8 GB/s; writing the same bytes with fsync ran at
0.34 GB/s on the shared disk, and the disk's O_DIRECT rate is 2.3 GB/s write and
1.0 GB/s read. Only crc32 stays well ahead of the disk (3x its best write rate, 6x
its read rate), it releases the GIL on large buffers (so a background writer does
not stall training), and it is computed as the bytes are written, so saving never
reads a file back. It detects truncation and flipped bits; it is not meant to resist
deliberate tampering. Loading with `checkpoint.verify_on_load` re-reads every file the
load needs, each rank checking a share balanced by bytes.

A checkpoint without a manifest is not a checkpoint: the manifest is written last,
fsynced, and only then is the temporary directory renamed into place.
"""
from __future__ import annotations

import os
import time
import zlib
from typing import Iterable

from .directio import DirectReader
from .format import FORMAT_NAME, FORMAT_VERSION, MANIFEST, CheckpointError, read_json, write_json

CHECKSUM = "crc32"


def file_crc32(path: str) -> int:
    """crc32 of a whole file, streamed (O_DIRECT when possible: the file is not left in the page cache)."""
    crc = 0
    with DirectReader(path) as reader:
        for chunk in reader.chunks(0, os.path.getsize(path)):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(directory: str, files: dict[str, dict], info: dict) -> None:
    """Write manifest.json (fsynced) listing `files` ({name: {"size", "crc32"}}) plus `info`."""
    payload = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "checksum": CHECKSUM,
               "committed_at_ns": time.time_ns(), **info,
               "files": {name: files[name] for name in sorted(files)}}
    write_json(os.path.join(directory, MANIFEST), payload)


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


def my_share(manifest: dict, names: Iterable[str], rank: int, world: int) -> list[str]:
    """The files rank `rank` checksums: all `names` split over `world` ranks, balanced by bytes."""
    loads = [0] * world
    mine = []
    for name in sorted(names, key=lambda n: (-int(manifest["files"][n]["size"]), n)):
        owner = min(range(world), key=lambda r: (loads[r], r))
        loads[owner] += int(manifest["files"][name]["size"])
        if owner == rank:
            mine.append(name)
    return mine


def verify_checksums(directory: str, manifest: dict, names: Iterable[str]) -> None:
    """Recompute each named file's crc32 and compare with the manifest."""
    for name in names:
        path = os.path.join(directory, name)
        expected = manifest["files"][name]["crc32"]
        actual = f"{file_crc32(path):08x}"
        if actual != expected:
            raise CheckpointError(f"{path}: checksum mismatch (crc32 {actual}, manifest says {expected}): "
                                  f"the file is corrupt")
