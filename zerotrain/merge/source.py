"""Lazy tensor sources: one input model of a merge, read tensor by tensor.

An input is a unified zerotrain checkpoint (a tag directory, or a save directory with
`latest`) or a Hugging Face model directory (sharded safetensors + index, or one
`model.safetensors`); `zerotrain.checkpoint.source` classifies it and gives its weight
map. Tensors are read one at a time through `safetensors.safe_open`, so memory holds
only the tensors being merged, never a model. When a unified checkpoint has fp32
master weights, those are read (the merge math is fp32 anyway) while the output keeps
the model files' dtype.

`DIR+ADAPTER_DIR` (mergekit's syntax) names a model with a PEFT LoRA adapter folded
into its weights as they are read (`lora.LoraAdapter`).
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Optional

import torch
from safetensors import safe_open

from ..checkpoint.format import HF_CONFIG, MASTER, MODEL, CheckpointError, read_header, st_dtype
from ..checkpoint.integrity import crc32_text, file_crc32, parse_crc32
from ..checkpoint.source import ZEROTRAIN, open_source, resolve
from .errors import MergeError
from ..lora import LoraAdapter


def split_spec(spec: str) -> tuple[str, Optional[str]]:
    """'DIR+ADAPTER' -> (DIR, ADAPTER); a plain path -> (path, None). A '+' in an existing path is kept."""
    if "+" in spec and not os.path.exists(spec):
        model, adapter = spec.rsplit("+", 1)
        return model, adapter
    return spec, None


class TensorSource:
    """The tensors of one input model by name: dtype and shape from the headers, data on demand."""

    def __init__(self, spec: str):
        self.spec = spec
        model, adapter_dir = split_spec(spec)
        try:
            path = resolve(model, None)
            if path is None:
                raise MergeError(f"{model} holds no model (no safetensors weights, no checkpoint)")
            source = open_source(path, load_module_only=True)
        except CheckpointError as error:
            raise MergeError(f"input {spec}: {error}") from None
        self.path = path
        self.kind = source.kind
        self.manifest = source.manifest
        self.weight_map: dict[str, str] = dict(source.maps[MODEL])
        self.master_map: dict[str, str] = dict(source.maps.get(MASTER, {}))
        self._headers: dict[str, dict] = {}
        self._handles: dict[str, object] = {}
        self._stack = contextlib.ExitStack()
        self.config = self._read_config()
        self.adapter = LoraAdapter(adapter_dir) if adapter_dir else None
        if self.adapter is not None:
            self.adapter.check_targets(self.weight_map, self.path)

    def _read_config(self) -> dict:
        path = os.path.join(self.path, HF_CONFIG)
        if not os.path.exists(path):
            return {}
        with open(path) as handle:
            return json.load(handle)

    def __enter__(self) -> "TensorSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def file_of(self, name: str) -> str:
        return os.path.join(self.path, self.weight_map[name])

    def _header(self, file: str) -> dict:
        header = self._headers.get(file)
        if header is None:
            try:
                header = self._headers[file] = read_header(os.path.join(self.path, file))
            except CheckpointError as error:
                raise MergeError(str(error)) from None
        return header

    def entry(self, name: str) -> tuple[torch.dtype, tuple]:
        """(dtype, shape) of tensor `name` as stored in the model files."""
        if name not in self.weight_map:
            raise MergeError(f"tensor {name!r} is missing from {self.path}")
        header = self._header(self.weight_map[name])
        if name not in header:
            raise MergeError(f"tensor {name!r} is missing from {self.file_of(name)} (its index lists it there)")
        return st_dtype(header[name]["dtype"]), tuple(header[name]["shape"])

    def _handle(self, file: str):
        handle = self._handles.get(file)
        if handle is None:
            path = os.path.join(self.path, file)
            try:
                handle = self._handles[file] = self._stack.enter_context(safe_open(path, framework="pt"))
            except Exception as error:  # noqa: BLE001 - safetensors raises its own types
                raise MergeError(f"{path}: not a valid safetensors file: {error}") from error
        return handle

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name` in fp32 (from the master weights when the checkpoint has them), adapter folded."""
        self.entry(name)
        file = self.master_map.get(name) or self.weight_map[name]
        tensor = self._handle(file).get_tensor(name)
        if tensor.is_floating_point():
            tensor = tensor.float()
            if self.adapter is not None:
                tensor = self.adapter.fold(name, tensor)
        return tensor

    def vocab_size(self) -> Optional[int]:
        """The vocabulary size its config.json declares (top level or `text_config`), if any."""
        for config in (self.config, self.config.get("text_config") or {}):
            if isinstance(config.get("vocab_size"), int):
                return config["vocab_size"]
        return None

    def checksums(self) -> dict[str, str]:
        """crc32 of every weight file: from the manifest of a unified checkpoint, else computed (streamed)."""
        files = sorted(set(self.weight_map.values()) | set(self.master_map.values()))
        out = {}
        for file in files:
            if self.kind == ZEROTRAIN and self.manifest and file in self.manifest["files"]:
                crc = parse_crc32(self.manifest["files"][file]["crc32"], f"{self.path}/manifest.json entry {file!r}")
                out[file] = f"crc32:{crc32_text(crc)}"
                continue
            out[file] = f"crc32:{crc32_text(file_crc32(os.path.join(self.path, file)))}"
        return out
