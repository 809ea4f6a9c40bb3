"""The merged model on disk: sharded safetensors + index, written tensor by tensor, committed atomically.

Every output tensor's name, dtype and shape is known before any is computed, so the
shards and the index (with `total_size` recomputed from what is actually written) are
planned up front and each tensor is streamed into its file as soon as it is merged
(`checkpoint.format.SafetensorsWriter`); nothing is held back. The output is built in
a temporary sibling directory and renamed into place at the end, so a failed merge
never leaves a half-written model behind.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..checkpoint import commit
from ..checkpoint.format import (MODEL, SafetensorsWriter, index_file, itemsize, numel_of, plan_shards, shard_file,
                                 write_json)
from .errors import MergeError


class ShardedWriter:
    """Writes the planned tensors, in plan order, into `out` (which must not exist or be empty)."""

    def __init__(self, out: str, entries: list[tuple[str, torch.dtype, tuple]], shard_size: int):
        out = os.path.abspath(out)
        if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
            raise MergeError(f"output {out} exists and is not an empty directory")
        self.out = out
        os.makedirs(os.path.dirname(out), exist_ok=True)
        self.staged = commit.StagedDirectory(out)
        self.temp = self.staged.path
        self.files = plan_shards(entries, shard_size)
        self.expected = {name: (dtype, tuple(shape)) for name, dtype, shape in entries}
        self.weight_map: dict[str, str] = {}
        self.total_size = 0
        self._queue = [(index, entry) for index, chunk in enumerate(self.files) for entry in chunk]
        self._position = 0
        self._writer: Optional[SafetensorsWriter] = None
        self._file_index = -1

    @property
    def directory(self) -> str:
        """Where side files (config, tokenizer) go before the commit."""
        return self.temp

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next planned tensor (must come in plan order, with the planned dtype and shape)."""
        index, (expected, dtype, shape) = self._queue[self._position]
        if name != expected:
            raise MergeError(f"internal: wrote {name!r} where {expected!r} was planned")
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise MergeError(f"internal: {name!r} came out {tensor.dtype} {list(tensor.shape)}, planned "
                             f"{dtype} {list(shape)}")
        if index != self._file_index:
            if self._writer is not None:
                self._writer.close()
            file = shard_file(MODEL, index, len(self.files))
            # no manifest records a merged model's checksums, so none is computed
            self._writer = SafetensorsWriter(os.path.join(self.temp, file), self.files[index],
                                             metadata={"format": "pt"}, checksum=False)
            self._file_index = index
        self._writer.write(name, [tensor.contiguous()])
        self.weight_map[name] = shard_file(MODEL, index, len(self.files))
        self.total_size += numel_of(shape) * itemsize(dtype)
        self._position += 1

    def commit(self) -> str:
        """Close the last file, write the index, and move the finished directory to `out`."""
        if self._position != len(self._queue):
            raise MergeError(f"internal: {len(self._queue) - self._position} planned tensors were not written")
        if self._writer is not None:
            self._writer.close()
        write_json(os.path.join(self.temp, index_file(MODEL)),
                   {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map})
        if os.path.isdir(self.out):
            os.rmdir(self.out)
        return self.staged.commit()

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
        self.staged.discard()
