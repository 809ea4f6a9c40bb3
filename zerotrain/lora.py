"""Folding a PEFT LoRA adapter into base weights: W' = W + s * B @ A.

The scale s is lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora` (rank-stabilised
LoRA); per-module `rank_pattern` / `alpha_pattern` override r and alpha the way PEFT
matches them (the pattern matches the module name's tail). `fan_in_fan_out` layers
(GPT-2's Conv1D) store W transposed, as do embedding adapters (`lora_embedding_A/B`),
so their product is transposed before it is added. Full weights the adapter saved
(`modules_to_save`) replace the base weight; trained token rows (`trainable_token_indices`,
e.g. the new tokens of `train --add-tokens --lora-r`) replace those rows of it.

It is a part of its own (imports nothing of zerotrain) because both the merge tool and the
checkpoint export use it, and neither may import the other. This is the one implementation of LoRA folding: `zerotrain merge` uses it for
`DIR+ADAPTER` inputs and the `lora` method, and `zerotrain ckpt export --merge-lora`
uses it on export (`fold_lora`). The math is fp32; the caller casts the result.
We read the adapter ourselves rather than through `peft` so that no model has to be
built in memory (PEFT's merge_and_unload needs the whole base model instantiated).
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Optional

import torch
from safetensors import safe_open



class LoraError(ValueError):
    """An adapter that cannot be folded: missing files, unknown layout, targets absent from the model."""

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B)"
                       r"(?:\.[^.]+)?(?:\.weight)?$")


# peft's trainable tokens (`trainable_token_indices`): the trained rows of an embedding / head, saved as
# `X.token_adapter.trainable_tokens_delta` (n rows x hidden); the base weight is `X.token_adapter.base_layer.weight`
_TOKENS_DELTA = ".token_adapter.trainable_tokens_delta"
_ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.",
                  _TOKENS_DELTA)


def is_adapter_weight(name: str) -> bool:
    """Whether a parameter name of a PEFT-wrapped model is a LoRA adapter weight (not in the base model)."""
    return any(part in name for part in _ADAPTER_PARTS)


def base_weight_name(name: str) -> str:
    """The base model's name of a PEFT-wrapped model's weight: ``base_model.model.X.base_layer.weight`` ->
    ``X.weight``, ``X.token_adapter.base_layer.weight`` (trainable tokens) -> ``X.weight`` (names that are not
    PEFT's come back as they are)."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX):]
    return name.replace(".token_adapter.base_layer.", ".").replace(".original_module.", ".") \
        .replace(".base_layer.", ".")


def _token_indices(config: dict, module: str) -> Optional[list]:
    """The rows peft's `trainable_token_indices` trains in `module`: a list means the input embedding (the one
    module with a delta, or every tied one); a dict is keyed by module names, matched at the end (peft's rule)."""
    indices = config.get("trainable_token_indices")
    if isinstance(indices, dict):
        return next((rows for key, rows in indices.items() if module == key or module.endswith("." + key)), None)
    return indices


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rule: a pattern applies when it matches the end of the module name (after a dot)."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


class LoraAdapter:
    """A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors), read lazily."""

    def __init__(self, directory: str):
        self.directory = directory
        config_path = os.path.join(directory, ADAPTER_CONFIG)
        weights_path = os.path.join(directory, ADAPTER_WEIGHTS)
        if not os.path.isfile(config_path):
            raise LoraError(f"LoRA adapter {directory}: {ADAPTER_CONFIG} is missing")
        if not os.path.isfile(weights_path):
            raise LoraError(f"LoRA adapter {directory}: {ADAPTER_WEIGHTS} is missing (only safetensors adapters "
                             f"are read)")
        with open(config_path) as handle:
            self.config = json.load(handle)
        if self.config.get("peft_type", "LORA") != "LORA":
            raise LoraError(f"{config_path}: peft_type {self.config.get('peft_type')!r} is not LORA")
        if self.config.get("use_dora"):
            raise LoraError(f"{config_path}: DoRA adapters (use_dora) are not supported")
        self.weights_path = weights_path
        self._handle = safe_open(weights_path, framework="pt")
        self.pairs: dict[str, dict[str, str]] = {}   # base weight name -> {"A": key, "B": key, "embedding": bool}
        self.replaced: dict[str, str] = {}           # base weight name -> adapter key of a full weight
        self.rows: dict[str, tuple[str, list]] = {}  # base weight name -> (adapter key, rows): trainable tokens
        for key in self._handle.keys():
            name = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
            if name.endswith(_TOKENS_DELTA):
                module = name[:-len(_TOKENS_DELTA)]
                rows = _token_indices(self.config, module)
                if rows is None:
                    raise LoraError(f"{weights_path}: trained token rows of {module!r}, but adapter_config.json's "
                                    f"trainable_token_indices names no rows for it")
                self.rows[module + ".weight"] = (key, list(rows))
                continue
            match = _LORA_KEY.match(name)
            if match is None:
                self.replaced[name.replace(".modules_to_save.default.", ".")] = key
                continue
            part = match.group("part")
            entry = self.pairs.setdefault(match.group("module") + ".weight", {})
            entry["A" if part.endswith("A") else "B"] = key
            entry["embedding"] = "embedding" in part
        for target, entry in self.pairs.items():
            if "A" not in entry or "B" not in entry:
                raise LoraError(f"{weights_path}: LoRA weights of {target!r} lack lora_{'B' if 'A' in entry else 'A'}")

    def scale(self, name: str) -> float:
        """alpha / r (or alpha / sqrt(r) with rslora) for base weight `name`."""
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        r = _pattern_value(self.config.get("rank_pattern"), module, self.config.get("r", 8))
        alpha = _pattern_value(self.config.get("alpha_pattern"), module, self.config.get("lora_alpha", 8))
        return alpha / math.sqrt(r) if self.config.get("use_rslora") else alpha / r

    def check_targets(self, weight_map: dict, where: str) -> None:
        """Every weight the adapter changes exists in the base model."""
        for target in list(self.pairs) + list(self.replaced) + list(self.rows):
            if target not in weight_map:
                raise LoraError(f"LoRA adapter {self.weights_path} changes {target!r}, which {where} does not have")

    def delta(self, name: str, shape: tuple) -> Optional[torch.Tensor]:
        """The fp32 update s * B @ A for base weight `name` (shaped like the weight), or None."""
        entry = self.pairs.get(name)
        if entry is None:
            return None
        a = self._handle.get_tensor(entry["A"]).float()
        b = self._handle.get_tensor(entry["B"]).float()
        product = b @ a
        if entry["embedding"] or self.config.get("fan_in_fan_out"):
            product = product.T
        if tuple(product.shape) != tuple(shape):
            raise LoraError(f"LoRA adapter {self.weights_path}: B @ A for {name!r} has shape "
                             f"{list(product.shape)}, the base weight has {list(shape)}")
        return product * self.scale(name)

    def fold(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """Base weight `name` with the adapter applied (a new fp32 tensor; the input when untouched)."""
        if name in self.replaced:
            full = self._handle.get_tensor(self.replaced[name]).float()
            if tuple(full.shape) != tuple(weight.shape):
                raise LoraError(f"LoRA adapter {self.weights_path}: saved {name!r} has shape {list(full.shape)}, "
                                 f"the base weight has {list(weight.shape)}")
            return full
        delta = self.delta(name, tuple(weight.shape))
        weight = weight if delta is None else weight.float() + delta
        if name in self.rows:  # trainable tokens: the trained rows replace the base's (peft's index_copy)
            key, rows = self.rows[name]
            trained = self._handle.get_tensor(key).float()
            if trained.shape != (len(rows), weight.shape[-1]) or max(rows) >= weight.shape[0]:
                raise LoraError(f"LoRA adapter {self.weights_path}: {len(rows)} trained rows of shape "
                                 f"{list(trained.shape)} do not fit {name!r} of shape {list(weight.shape)}")
            weight = weight.float().index_copy(0, torch.tensor(rows), trained)
        return weight


def fold_lora(weight: torch.Tensor, name: str, adapter: "LoraAdapter | str") -> torch.Tensor:
    """`weight` (base tensor `name`) with the LoRA adapter folded in, in `weight`'s dtype (math in fp32)."""
    if isinstance(adapter, str):
        adapter = LoraAdapter(adapter)
    if not weight.is_floating_point():
        return weight
    return adapter.fold(name, weight.float()).to(weight.dtype)
