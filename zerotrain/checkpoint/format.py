"""The on-disk layout of one checkpoint directory, and a streaming safetensors writer.

One directory per tag::

    model-00001-of-0000n.safetensors ...   whole tensors in the training dtype, under the model's names
                                           (a PEFT model's: the base model's names, no adapter weight)
    model.safetensors.index.json           {"metadata": {"total_size": ...}, "weight_map": {name: file}}
    master_weights-0000i-of-0000n.safetensors + index   fp32 masters (bf16/fp16 training; trained adapter
                                           weights at any dtype: plan.TensorPlan.adapter)
    optimizer-0000i-of-0000n.safetensors + index        "name/exp_avg", "name/exp_avg_sq", "name/step", ...
    config.json, generation_config.json    when the model has a Hugging Face config
    trainer_state.json                     counters, scheduler, loss scaler, config, topology, client_state
    rng_state_<rank>.json                  python, numpy, torch CPU and CUDA generators of each rank
    manifest.json                          written last: every file with its size and crc32

`transformers` and `safetensors.torch.load_file` read the model files directly. The
safetensors files are written here rather than by `safetensors.torch.save_file` so that
a file can be streamed: its header is known from the save plan before any data exists,
pieces of a tensor arriving from several ranks are appended in order, and the checksum
is computed over exactly the bytes written (no second read).
"""
from __future__ import annotations

import json
import os
import struct
from typing import Iterable, Optional

import torch

from .directio import DurableFile

try:  # ISA-L's crc32: the same checksum as zlib's, with SIMD (measured here: 15.5 GB/s against zlib's 3.9 on
    # one core), and it releases the GIL on large buffers as zlib does. Every byte saved and loaded is summed.
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values, slower
    from zlib import crc32

FORMAT_NAME = "zerotrain-checkpoint"
FORMAT_VERSION = 1

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
LATEST = "latest"
HF_CONFIG = "config.json"
HF_GENERATION_CONFIG = "generation_config.json"

MODEL, MASTER, OPTIMIZER = "model", "master_weights", "optimizer"
KINDS = (MODEL, MASTER, OPTIMIZER)

TMP_MARK = ".zerotrain-tmp-"  # a save in progress (or a crashed one): never loaded, never rotated
OLD_MARK = ".zerotrain-old-"  # a rotated or replaced checkpoint being deleted (manifest removed first)
REPLACED_MARK = ".zerotrain-replaced-"  # a committed checkpoint moved aside for a new save of its tag
SIDE_MARKS = (TMP_MARK, OLD_MARK, REPLACED_MARK)


def is_side_name(name: str) -> bool:
    """Whether a directory entry is a save's side directory (temporary, replaced, being deleted): never loaded."""
    return any(mark in name for mark in SIDE_MARKS)

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code
_TORCH_DTYPES = {code: dtype for dtype, code in _ST_DTYPES.items()}


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file or tensor."""


def rng_file(rank: int) -> str:
    return f"rng_state_{rank}.json"


def index_file(kind: str) -> str:
    return f"{kind}.safetensors.index.json"


def shard_file(kind: str, index: int, count: int) -> str:
    """Hugging Face's sharded file name, 1-based: model-00001-of-00003.safetensors."""
    return f"{kind}-{index + 1:05d}-of-{count:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r}")
    return dtype


def st_code(dtype: torch.dtype) -> str:
    try:
        return _ST_DTYPES[dtype]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors") from None


def st_dtype(code: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[code]
    except KeyError:
        raise CheckpointError(f"safetensors dtype {code!r} is not supported") from None


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype` (read off the dtype: no tensor is made; a save and a load ask once per piece)."""
    return dtype.itemsize


def numel_of(shape: Iterable[int]) -> int:
    total = 1
    for size in shape:
        total *= int(size)
    return total


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, payload, fsync: bool = True) -> tuple[int, int]:
    """Write JSON (or `bytes` as they are) to `path` (fsynced); returns (size, crc32) of the bytes written."""
    data = bytes(payload) if isinstance(payload, (bytes, bytearray)) else \
        json.dumps(payload, indent=1, sort_keys=False).encode()
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        if fsync:
            os.fsync(handle.fileno())
    return len(data), crc32(data)


def read_json(path: str, what: Optional[str] = None) -> dict:
    what = what or os.path.basename(path)
    try:
        with open(path, "rb") as handle:
            return json.loads(handle.read())
    except FileNotFoundError:
        raise CheckpointError(f"{what} is missing: {path}") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{what} is not valid JSON ({path}): {error}") from None


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    return memoryview(flat.numpy()).cast("B")


class FileLayout:
    """Where everything of one safetensors file lies, from its entries alone (every rank computes the same):
    `header` (the 8-byte length and the JSON header, padded to 8 bytes), `places` {key: (offset in the file,
    bytes)} in entry order, `size` the file's length. `SafetensorsWriter` streams this layout; a save writes
    its pieces into it in place."""

    def __init__(self, header: bytes, places: dict, size: int):
        self.header, self.places, self.size = header, places, size

    @classmethod
    def of(cls, entries: Iterable[tuple[str, torch.dtype, tuple]], metadata: Optional[dict] = None) -> "FileLayout":
        header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
        sizes: list[tuple[str, int]] = []
        offset = 0
        for key, dtype, shape in entries:
            nbytes = numel_of(shape) * itemsize(dtype)
            header[key] = {"dtype": st_code(dtype), "shape": [int(s) for s in shape],
                           "data_offsets": [offset, offset + nbytes]}
            sizes.append((key, nbytes))
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        start = 8 + len(encoded)
        places, position = {}, start
        for key, nbytes in sizes:
            places[key] = (position, nbytes)
            position += nbytes
        return cls(struct.pack("<Q", len(encoded)) + encoded, places, start + offset)


class SafetensorsWriter:
    """Writes one safetensors file whose tensors (key, dtype, shape) are known up front.

    `write(key, chunks)` must be called for every key in header order; the chunks of
    one key (uint8 tensors or bytes) must add up to exactly its size. `close()` fsyncs
    and returns (size, crc32) of the whole file (crc32 0 when made with `checksum=False`).
    """

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple]], metadata: Optional[dict] = None,
                 checksum: bool = True):
        self.path = path
        self._checksum = checksum  # off for files no manifest records (merge outputs): crc32 is ~1 s per GB
        layout = FileLayout.of(entries, metadata)
        self._order: list[tuple[str, int]] = [(key, nbytes) for key, (_, nbytes) in layout.places.items()]
        self._next = 0
        # the crc32 of the bytes is computed by the file's writer thread as each buffer goes out
        self._file = DurableFile(path, checksum=checksum, crc32=crc32)
        self._emit(layout.header)

    def _emit(self, data) -> None:
        try:
            self._file.write(data)
        except OSError as error:
            raise _named(error, self.path) from error

    def write(self, key: str, chunks: Iterable) -> None:
        if self._next >= len(self._order) or self._order[self._next][0] != key:
            expected = self._order[self._next][0] if self._next < len(self._order) else "nothing"
            raise CheckpointError(f"{self.path}: wrote {key!r} out of order (expected {expected!r})")
        written = 0
        for chunk in chunks:
            data = as_bytes(chunk) if torch.is_tensor(chunk) else memoryview(chunk)
            self._emit(data)
            written += len(data)
        if written != self._order[self._next][1]:
            raise CheckpointError(f"{self.path}: tensor {key!r} got {written} bytes, expected "
                                  f"{self._order[self._next][1]}")
        self._next += 1

    def close(self) -> tuple[int, int]:
        if self._next != len(self._order):
            missing = [key for key, _ in self._order[self._next:]][:3]
            self.abort()
            raise CheckpointError(f"{self.path}: closed before tensors {missing} were written")
        try:
            size = self._file.close()
            return size, self._file.crc
        except OSError as error:
            raise _named(error, self.path) from error

    def abort(self) -> None:
        try:
            self._file.abort()
        except OSError:
            pass


def _named(error: OSError, path: str) -> OSError:
    """`error` with the file's path, which raw writes on a descriptor do not carry."""
    return error if error.filename else OSError(error.errno, error.strerror, path)


def plan_shards(entries: list[tuple[str, torch.dtype, tuple]], shard_size: int) -> list[list]:
    """Entries split, in order, into files of at most `shard_size` bytes (a larger tensor gets its own file)."""
    files: list[list] = [[]]
    size = 0
    for entry in entries:
        nbytes = numel_of(entry[2]) * itemsize(entry[1])
        if files[-1] and size + nbytes > shard_size:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += nbytes
    return files


def read_header(path: str) -> dict:
    """The parsed safetensors header of `path` (without "__metadata__"), checked against the file size."""
    return read_layout(path)[0]


def read_layout(path: str) -> tuple[dict, int]:
    """(header without "__metadata__", byte offset of the data section) of a safetensors file, validated."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            raw = handle.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated (no safetensors header)")
            (length,) = struct.unpack("<Q", raw)
            if length > min(size - 8, 100 << 20):
                raise CheckpointError(f"{path}: truncated or corrupt safetensors header (length {length})")
            header = json.loads(handle.read(length))
    except FileNotFoundError:
        raise CheckpointError(f"file is missing: {path}") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: corrupt safetensors header: {error}") from None
    header.pop("__metadata__", None)
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if 8 + length + end != size:
        raise CheckpointError(f"{path}: file has {size} bytes but its header describes {8 + length + end} "
                              f"(truncated or padded)")
    return header, 8 + length
