"""Reading tensors, or ranges of them, from a set of safetensors files by name.

A rank that loads a shard needs elements [start, start+count) of a tensor flattened
in row-major order. In a safetensors file that range is one contiguous run of bytes,
so `TensorReader.read_into` reads exactly those bytes through the page cache
(`SharedFiles`), where the load's checksum pass has just put them: straight into the
destination when it is a contiguous CPU tensor of the stored dtype (one copy, no
staging), else through a bounded bounce buffer, converting the dtype on the way. A
rank never reads more than the slices it needs, and never a whole file into memory.
`read_into` may be called from several threads at once (the load's reads run in
parallel, `directio.run_parallel`).

Before anything is read, every file's header is parsed and checked against its size
(`format.read_layout`) and opened by safetensors itself (`safe_open`, which validates
the header again); errors name the file and the tensor.
"""
from __future__ import annotations

import contextlib
import os

import torch
from safetensors import safe_open

from .directio import READ_CHUNK, CheckedReads, SharedFiles
from .format import CheckpointError, crc32, itemsize, numel_of, read_layout, st_dtype


SMALL_TENSOR_BYTES = 64


def prefetch_small_tensors(directory: str, names) -> None:
    """Ask the kernel to read, in the background, the pages of the small tensors (optimizer scalars such as
    Adam's `step`, one per parameter) of files `names`: a load reads them one by one while it plans, and
    each would otherwise be a synchronous read from the disk in the middle of another rank's checksum
    stream (measured: 148 such reads cost rank 0 0.02-0.7 s of a 70m load). Best effort: a file whose
    header cannot be read is left to the checks that name it."""
    for name in names:
        path = os.path.join(directory, name)
        try:
            header, data_start = read_layout(path)
            fd = os.open(path, os.O_RDONLY)
        except (CheckpointError, OSError):
            continue
        try:
            for entry in header.values():
                begin, end = entry["data_offsets"]
                if 0 < end - begin <= SMALL_TENSOR_BYTES:
                    os.posix_fadvise(fd, data_start + begin, end - begin, os.POSIX_FADV_WILLNEED)
        except (OSError, KeyError, TypeError, ValueError, AttributeError):
            pass  # no posix_fadvise, or a malformed header (named later, by `check`)
        finally:
            os.close(fd)


class TensorReader:
    """Tensors by name over the files of one weight map ({name: file}) inside `directory`."""

    def __init__(self, directory: str, weight_map: dict[str, str], what: str):
        self.directory = directory
        self.weight_map = weight_map
        self.what = what
        self._layouts: dict[str, tuple[dict, int]] = {}
        self._stack = contextlib.ExitStack()
        self._validated: set[str] = set()
        self._files = self._stack.enter_context(SharedFiles())

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def _path(self, name: str) -> str:
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name!r} is missing from the {self.what} of {self.directory}")
        return os.path.join(self.directory, self.weight_map[name])

    def _layout(self, path: str) -> tuple[dict, int]:
        layout = self._layouts.get(path)
        if layout is None:
            layout = self._layouts[path] = read_layout(path)
        return layout

    def entry(self, name: str) -> tuple[torch.dtype, tuple, str]:
        """(dtype, shape, path) of tensor `name`, from its file's (validated) header."""
        path = self._path(name)
        header, _ = self._layout(path)
        if name not in header:
            raise CheckpointError(f"tensor {name!r} is missing from {path} (the {self.what} index lists it there)")
        return st_dtype(header[name]["dtype"]), tuple(header[name]["shape"]), path

    def check(self, name: str, shape: tuple, floating: bool = True) -> None:
        """Tensor `name` exists with this shape (and a floating dtype); its file is a valid safetensors file."""
        dtype, stored, path = self.entry(name)
        if tuple(stored) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} in {path} has shape {list(stored)}, the model expects "
                                  f"{list(shape)}")
        if floating and not dtype.is_floating_point:
            raise CheckpointError(f"tensor {name!r} in {path} has dtype {dtype}, expected a floating type")
        if path not in self._validated:
            try:
                with safe_open(path, framework="pt") as handle:
                    handle.metadata()
            except Exception as error:  # noqa: BLE001 - safetensors raises its own types
                raise CheckpointError(f"{path}: not a valid safetensors file: {error}") from error
            self._validated.add(path)

    def read_into(self, name: str, start: int, count: int, target: torch.Tensor) -> None:
        """Copy elements [start, start+count) of the flattened tensor into the 1-D `target` (any dtype/device)."""
        dtype, stored, path = self.entry(name)
        if start < 0 or start + count > numel_of(stored) or target.numel() != count:
            raise CheckpointError(f"tensor {name!r} in {path}: elements [{start}, {start + count}) do not fit "
                                  f"shape {list(stored)} or the destination")
        if count == 0:
            return
        header, data_start = self._layout(path)
        size = itemsize(dtype)
        begin = data_start + header[name]["data_offsets"][0] + start * size
        try:
            if target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous():
                self._files.read_into(path, begin, target.detach().view(torch.uint8).numpy())
                return
            step = max(1, READ_CHUNK // size)
            bounce = torch.empty(min(step, count) * size, dtype=torch.uint8)
            for position in range(0, count, step):
                n = min(step, count - position)
                self._files.read_into(path, begin + position * size, bounce[:n * size].numpy())
                target[position:position + n].copy_(bounce[:n * size].view(dtype))
        except OSError as error:
            raise CheckpointError(f"{path}: cannot read tensor {name!r}: {error}") from error

    def byte_range(self, name: str, start: int, count: int) -> tuple[str, int, int]:
        """(file name, first byte, end byte) in its file of elements [start, start+count) of tensor `name`."""
        dtype, _, path = self.entry(name)
        header, data_start = self._layout(path)
        begin = data_start + header[name]["data_offsets"][0] + start * itemsize(dtype)
        return self.weight_map[name], begin, begin + count * itemsize(dtype)

    def can_read_checked(self, name: str, target: torch.Tensor) -> bool:
        """Whether `read_checked` can read tensor `name` straight into `target` (a contiguous CPU tensor of
        the stored dtype: the read is the copy, nothing converted)."""
        return target.device.type == "cpu" and target.dtype == self.entry(name)[0] and target.is_contiguous()

    def plan_checked(self, reads: CheckedReads, name: str, start: int, count: int, target: torch.Tensor,
                     claimed: list[tuple[int, int]]) -> None:
        """Plan in `reads` the read of elements [start, start+count) straight into the 1-D `target` (see
        `can_read_checked`) with the crc32 of the `claimed` byte ranges (file offsets inside the read) computed
        on the destination's bytes as each chunk lands: one pass over the bytes, from the disk (O_DIRECT, several
        requests in flight) into the tensor. `reads.run()` returns (file name, offset, length, crc32) pieces."""
        dtype, stored, path = self.entry(name)
        if start < 0 or start + count > numel_of(stored) or target.numel() != count \
                or not self.can_read_checked(name, target):
            raise CheckpointError(f"tensor {name!r} in {path}: elements [{start}, {start + count}) do not fit "
                                  f"shape {list(stored)} or the destination")
        file, begin, end = self.byte_range(name, start, count)
        reads.add(file, path, begin, target.detach().view(torch.uint8).numpy(), claimed)

    def read_checked(self, name: str, start: int, count: int, target: torch.Tensor,
                     claimed: list[tuple[int, int]]) -> list[tuple[str, int, int, int]]:
        """`plan_checked` of one range, read at once: its (file name, offset, length, crc32) pieces."""
        reads = CheckedReads(crc32)
        self.plan_checked(reads, name, start, count, target, claimed)
        try:
            return reads.run()
        except OSError as error:
            raise CheckpointError(f"cannot read tensor {name!r}: {error}") from error

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor, on the CPU."""
        dtype, shape, _ = self.entry(name)
        out = torch.empty(shape, dtype=dtype)
        self.read_into(name, 0, out.numel(), out.reshape(-1))
        return out

    def read_range(self, name: str, start: int, count: int) -> torch.Tensor:
        """Elements [start, start+count) of the flattened tensor, as a new 1-D CPU tensor."""
        dtype, _, _ = self.entry(name)
        out = torch.empty(count, dtype=dtype)
        self.read_into(name, start, count, out)
        return out
