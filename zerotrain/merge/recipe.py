"""What to merge and how: the merge recipe, from command-line flags or a mergekit-style YAML file.

A recipe names a method, the input models (each with optional per-model parameters,
e.g. `weight`, `density`), an optional base model, global parameters (`normalize`,
`lambda`, `t`, `consensus`, `rescale`, `int8_mask`, `seed`), key filters, the output
dtype, the tokenizer source and the output's shard size.

Parameter values follow mergekit: a number or string; a list of numbers, interpolated
over the layers (the value at layer i of N is read at position i/(N-1) along the list,
so `t: [0, 0.5, 1]` goes 0 -> 0.5 -> 1 from the first layer to the last, and a
single layer reads 1; tensors outside the layers (embeddings, final norm, head) read
position 0, as in mergekit 0.1.5); or a list of `{filter: SUBSTRING, value: V}` entries, the
first whose filter occurs in the tensor name applying (no filter: the default).
Per-model parameters override the global ones for that model.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import MergeError

# method -> (needs a base model, parameter defaults). Defaults are mergekit's.
METHODS: dict[str, tuple[bool, dict]] = {
    "linear": (False, {"normalize": True, "weight": 1.0}),
    "task_arithmetic": (True, {"normalize": False, "lambda": 1.0, "weight": 1.0}),
    "ties": (True, {"normalize": True, "lambda": 1.0, "weight": 1.0, "density": 1.0, "consensus": "sum",
                    "int8_mask": False}),
    "dare_linear": (True, {"normalize": False, "lambda": 1.0, "weight": 1.0, "density": 1.0, "rescale": True,
                           "seed": 0}),
    "dare_ties": (True, {"normalize": False, "lambda": 1.0, "weight": 1.0, "density": 1.0, "rescale": True,
                         "consensus": "sum", "int8_mask": False, "seed": 0}),
    "slerp": (True, {}),
    "lora": (False, {}),
}
KNOWN_PARAMS = {"normalize", "lambda", "weight", "density", "consensus", "int8_mask", "rescale", "seed", "t",
                "adapter"}
_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")


@dataclass
class ModelSpec:
    """One input model: its directory (or `DIR+ADAPTER`) and its own parameters."""
    path: str
    params: dict = field(default_factory=dict)


@dataclass
class Recipe:
    method: str
    models: list[ModelSpec]
    base: Optional[str] = None
    params: dict = field(default_factory=dict)
    include: Optional[str] = None
    exclude: Optional[str] = None
    dtype: Optional[str] = None
    tokenizer_source: Optional[str] = None
    # 5GB as transformers' save_pretrained and mergekit count it: 5e9 bytes, not 5 GiB.
    shard_size: int = 5_000_000_000
    max_memory: Optional[int] = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise MergeError(f"unknown merge method {self.method!r} (one of: {', '.join(METHODS)})")
        for name in list(self.params) + [k for m in self.models for k in m.params]:
            if name not in KNOWN_PARAMS:
                raise MergeError(f"unknown parameter {name!r} for method {self.method} "
                                 f"(known: {', '.join(sorted(KNOWN_PARAMS))})")
        needs_base, _ = METHODS[self.method]
        if needs_base and self.base is None:
            raise MergeError(f"method {self.method} needs a base model (--base or base_model:)")
        for pattern, what in ((self.include, "include"), (self.exclude, "exclude")):
            if pattern is not None:
                try:
                    re.compile(pattern)
                except re.error as error:
                    raise MergeError(f"--{what} {pattern!r} is not a valid regular expression: {error}") from None
        if not self.models:
            raise MergeError("no input models")
        if self.method == "slerp" and len(self.others()) != 1:
            raise MergeError(f"slerp merges exactly two models (the base and one other), got base {self.base} and "
                             f"{[m.path for m in self.others()]}")
        if self.method == "lora" and len(self.models) != 1:
            raise MergeError("method lora folds an adapter into exactly one model")

    def others(self) -> list[ModelSpec]:
        """The input models except the base (for task-vector methods and slerp)."""
        return [m for m in self.models if self.base is None or os.path.abspath(m.path) != os.path.abspath(self.base)]

    def default(self, name: str) -> Any:
        return METHODS[self.method][1].get(name)

    def to_json(self) -> dict:
        return {"method": self.method, "base_model": self.base,
                "models": [{"model": m.path, "parameters": m.params} for m in self.models],
                "parameters": self.params, "include": self.include, "exclude": self.exclude, "dtype": self.dtype,
                "tokenizer_source": self.tokenizer_source, "shard_size": self.shard_size}


def parse_value(text: str) -> Any:
    """A `--param` value: YAML scalars and lists (`0.5`, `true`, `sum`, `[0, 0.5, 1]`), or `a,b,c` as a list."""
    import yaml

    value = yaml.safe_load(text)
    if isinstance(value, str) and "," in value:
        value = [yaml.safe_load(part) for part in value.split(",")]
    return value


def parse_size(text: Optional[str]) -> Optional[int]:
    """'2GB', '512MiB', '1e9' -> bytes."""
    if text is None or isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not match:
        raise MergeError(f"cannot read size {text!r} (e.g. 2GB, 512MiB, 1000000)")
    base = 1024 if match.group(3) or not match.group(2) else 1000
    power = " KMGT".index(match.group(2).upper() or " ")
    return int(float(match.group(1)) * base ** power)


def layer_position(name: str, num_layers: int) -> float:
    """Where tensor `name` sits along the layers, in [0, 1] (for per-layer parameter lists)."""
    match = _LAYER.search(name)
    if match is None:
        return 0.0
    if num_layers <= 1:
        return 1.0
    return min(1.0, int(match.group(1)) / (num_layers - 1))


def count_layers(names, config: dict) -> int:
    """Number of layers: from the config (num_hidden_layers / n_layer / num_layers), else from the names."""
    for config_part in (config, config.get("text_config") or {}):
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if isinstance(config_part.get(key), int):
                return config_part[key]
    indices = [int(m.group(1)) for m in map(_LAYER.search, names) if m]
    return max(indices) + 1 if indices else 1


def evaluate(value: Any, name: str, position: float, what: str) -> Any:
    """The value of a parameter for tensor `name` at layer position `position` (see the module docstring)."""
    if isinstance(value, (int, float, bool, str)) or value is None:
        return value
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 for v in value):
        scaled = position * (len(value) - 1)
        low = int(math.floor(scaled))
        high = min(len(value) - 1, low + 1)
        frac = scaled - low
        return (1 - frac) * value[low] + frac * value[high]
    if isinstance(value, list) and all(isinstance(v, dict) for v in value):
        for entry in value:
            if "value" not in entry:
                raise MergeError(f"parameter {what}: filter entry {entry} has no 'value'")
            if entry.get("filter") is None or entry["filter"] in name:
                return evaluate(entry["value"], name, position, what)
        return None
    if isinstance(value, dict) and "value" in value:
        return evaluate([value], name, position, what)
    raise MergeError(f"parameter {what}: cannot read value {value!r} (a number, a list of numbers over the layers, "
                     f"or a list of {{filter, value}})")


def resolve_param(recipe: Recipe, model: Optional[ModelSpec], param: str, name: str, position: float) -> Any:
    """Parameter `param` for tensor `name` (model-level, then global, then the method's default)."""
    for scope in ((model.params if model else {}), recipe.params):
        if param in scope:
            value = evaluate(scope[param], name, position, param)
            if value is not None:
                return value
    return recipe.default(param)


def recipe_from_yaml(path: str, **overrides) -> Recipe:
    """A Recipe from a mergekit-style YAML file (merge_method, base_model, models, parameters, dtype, ...)."""
    import yaml

    try:
        with open(path) as handle:
            data = yaml.safe_load(handle)
    except OSError as error:
        raise MergeError(f"cannot read merge config {path}: {error}") from None
    except yaml.YAMLError as error:
        raise MergeError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise MergeError(f"{path}: expected a mapping at the top level")
    known = {"merge_method", "base_model", "models", "parameters", "dtype", "out_dtype", "tokenizer_source",
             "tokenizer", "include", "exclude", "shard_size", "max_memory", "chat_template"}
    unknown = sorted(set(data) - known)
    if unknown:
        hint = " (mergekit 'slices' are not supported: list whole models)" if "slices" in unknown else ""
        raise MergeError(f"{path}: unknown key(s) {unknown}{hint}")
    if "merge_method" not in data:
        raise MergeError(f"{path}: merge_method is missing")
    models = []
    for i, entry in enumerate(data.get("models") or []):
        if isinstance(entry, str):
            entry = {"model": entry}
        if not isinstance(entry, dict) or "model" not in entry:
            raise MergeError(f"{path}: models[{i}] needs a 'model' key")
        models.append(ModelSpec(str(entry["model"]), dict(entry.get("parameters") or {})))
    base = data.get("base_model")
    if base is not None and data["merge_method"] in ("slerp",) and all(m.path != base for m in models):
        models.insert(0, ModelSpec(str(base)))
    tokenizer = data.get("tokenizer_source")
    if isinstance(data.get("tokenizer"), dict):
        tokenizer = data["tokenizer"].get("source", tokenizer)
    settings = dict(method=data["merge_method"], models=models, base=None if base is None else str(base),
                    params=dict(data.get("parameters") or {}), include=data.get("include"),
                    exclude=data.get("exclude"), dtype=data.get("out_dtype") or data.get("dtype"),
                    tokenizer_source=tokenizer, max_memory=parse_size(data.get("max_memory")))
    if data.get("shard_size") is not None:
        settings["shard_size"] = parse_size(data["shard_size"])
    settings.update({k: v for k, v in overrides.items() if v is not None})
    return Recipe(**settings)
