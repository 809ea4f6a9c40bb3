"""A Hugging Face model partitioned from the start: `zerotrain.from_pretrained`, and `HfDeepSpeedConfig`.

With DeepSpeed a user's script makes transformers' `from_pretrained` build a ZeRO-3 model partitioned
(never whole on one rank) by keeping a `transformers.integrations.HfDeepSpeedConfig(ds_config)` alive;
transformers then builds under DeepSpeed's `zero.Init` and loads the weights one gathered module at a
time. Here the same effect is one call:

    model = zerotrain.from_pretrained(AutoModelForCausalLM, "path/to/dir", config=ds_config)

At ZeRO stage 3 the model is built under `zerotrain.zero.Init(config)` without running transformers'
initializers, and each rank reads only its own chunk of every weight from the directory's safetensors
files (sharded or not; rows covering the chunk, through safetensors' slices), so no rank ever holds a
whole weight matrix, let alone the model. Below stage 3 it is transformers' `from_pretrained`. The model
goes to `zerotrain.initialize(model=...)` as any other.

`HfDeepSpeedConfig` / `is_deepspeed_zero3_enabled` are transformers' names (what `zerotrain port` maps
their imports to): while an `HfDeepSpeedConfig` with stage 3 is alive, `is_deepspeed_zero3_enabled()` is
True and `zerotrain.from_pretrained(..., config=None)` uses its config. It does not change what
transformers' own `from_pretrained` does (that builds the whole model; `initialize` then partitions it).
"""
from __future__ import annotations

import contextlib
import json
import os
import weakref
from pathlib import Path
from typing import Any, Optional, Union

import torch

from .zero import Init
from .zero.stage3 import ZeroParameter

__all__ = ["from_pretrained", "HfDeepSpeedConfig", "is_deepspeed_zero3_enabled"]

_live: Optional["weakref.ref[HfDeepSpeedConfig]"] = None


class HfDeepSpeedConfig:
    """transformers' `HfDeepSpeedConfig(config_file_or_dict)`: keeps the config of the run; while it is alive
    `is_deepspeed_zero3_enabled()` says whether it is stage 3 (the object must be kept referenced, as
    transformers requires)."""

    def __init__(self, config_file_or_dict: Union[dict, str, os.PathLike]) -> None:
        global _live
        self.config = _read(config_file_or_dict)
        _live = weakref.ref(self)

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        """The value at a dotted key (`zero_optimization.stage`), or `default`."""
        node: Any = self.config
        for key in ds_key_long.split("."):
            if not isinstance(node, dict) or key not in node:
                return default
            node = node[key]
        return node

    def is_zero3(self) -> bool:
        return self.get_value("zero_optimization.stage", 0) == 3

    def is_zero2(self) -> bool:
        return self.get_value("zero_optimization.stage", 0) == 2

    def is_offload(self) -> bool:
        return any(self.get_value(f"zero_optimization.{key}.device", "none") in ("cpu", "nvme")
                   for key in ("offload_optimizer", "offload_param"))


def is_deepspeed_zero3_enabled() -> bool:
    """True while an `HfDeepSpeedConfig` of stage 3 is alive (transformers' function of the same name)."""
    live = _live() if _live is not None else None
    return live is not None and live.is_zero3()


def _read(config: Union[dict, str, os.PathLike]) -> dict:
    if isinstance(config, dict):
        return config
    with open(config, encoding="utf-8") as handle:
        return json.load(handle)


def _dtype_of(config: dict) -> torch.dtype:
    """The training dtype a DeepSpeed config asks for (bf16 / fp16 blocks), fp32 otherwise."""
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        if (config.get(key) or {}).get("enabled") is True:
            return dtype
    return torch.float32


def from_pretrained(model_class: Any, pretrained_model_name_or_path: Union[str, os.PathLike],
                    config: Union[dict, str, os.PathLike, None] = None, dtype: Optional[torch.dtype] = None,
                    **kwargs: Any) -> torch.nn.Module:
    """`model_class.from_pretrained(path)` for a ZeRO run (`model_class`: an Auto class or a model class).

    At ZeRO stage 3 (`config`, or a live `HfDeepSpeedConfig`'s) the model is built under `zerotrain.zero.Init`
    and every rank reads only its shard of each weight from the local directory's safetensors files: the model
    is never whole on one rank. Collective at stage 3 (every rank calls it). `dtype`: the weights' dtype (default:
    the config's bf16/fp16, else fp32). Other keywords go to the model's config (`from_config`) at stage 3 and to
    `from_pretrained` otherwise.
    """
    if config is None and _live is not None and _live() is not None:
        config = _live().config
    raw = _read(config) if config is not None else {}
    dtype = dtype or _dtype_of(raw)
    if (raw.get("zero_optimization") or {}).get("stage", 0) != 3:
        return model_class.from_pretrained(pretrained_model_name_or_path, dtype=dtype, **kwargs)
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights

    directory = Path(pretrained_model_name_or_path)
    files = _weight_files(directory)
    hf_config = AutoConfig.from_pretrained(directory, local_files_only=True)
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    if isinstance(model_class, type) and issubclass(model_class, _BaseAutoModelClass):
        # The concrete class, imported now: zero.Init wraps the __init__ of the module classes that exist when it
        # is entered, so a class first imported inside it would keep its own parameters whole.
        model_class = model_class._model_mapping[type(hf_config)]
    with Init(config=raw, dtype=dtype), no_init_weights():  # every weight is overwritten by the load below
        model = model_class._from_config(hf_config, dtype=dtype, **kwargs)
    model.tie_weights()  # no_init_weights skipped init_weights, which also ties the embeddings
    _load_shards(model, files)
    return model


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (`model.safetensors`, or the index's shards)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{directory}: no model.safetensors or model.safetensors.index.json "
                                "(zerotrain.from_pretrained reads local safetensors directories)")
    from safetensors import safe_open

    with safe_open(single, "pt") as handle:
        return {name: single for name in handle.keys()}


def _load_shards(model: torch.nn.Module, files: dict[str, Path]) -> None:
    """Write each parameter's values from the files: a partitioned one only its chunk (read as the rows that
    cover it), a whole one (and each persistent buffer) entirely. Tied parameters are read once."""
    from safetensors import safe_open

    handles: dict[Path, Any] = {}
    with contextlib.ExitStack() as stack:
        def open_slice(name: str):
            path = files[name]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, "pt"))
            return handles[path].get_slice(name)

        missing = [name for name, _ in model.named_parameters() if name not in files]
        if missing:
            raise KeyError(f"zerotrain.from_pretrained: {missing[:5]} are not in the checkpoint's files")
        with torch.no_grad():
            for name, param in model.named_parameters():
                if isinstance(param, ZeroParameter):
                    part = param._zero
                    part.write_shard(_read_chunk(open_slice(name), part.numel, *part.shard_bounds(),
                                                 part.dtype, part.device))
                else:
                    param.data.copy_(open_slice(name)[:])
            buffers = {name: buffer for name, buffer in model.named_buffers() if name in files}
            for name, buffer in buffers.items():
                buffer.copy_(open_slice(name)[:])


def _read_chunk(tensor_slice: Any, numel: int, start: int, end: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """Elements [start, end) of the flattened tensor (zeros past `numel`: the shard's padding), reading only
    the rows of dimension 0 that hold them."""
    chunk = torch.zeros(end - start, dtype=dtype, device=device)
    stop = min(end, numel)
    if start >= stop:
        return chunk
    shape = tensor_slice.get_shape()
    row = numel // shape[0] if shape else 1
    if not shape:  # a scalar
        chunk[0] = tensor_slice[:]
        return chunk
    first, last = start // row, -(-stop // row)
    rows = tensor_slice[first:last].reshape(-1)
    chunk[:stop - start] = rows[start - first * row:stop - first * row].to(dtype)
    return chunk
