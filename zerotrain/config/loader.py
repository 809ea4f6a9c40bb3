"""Reading a config: a dict, a path to a JSON file, or JSON text.

JSON files may carry ``//`` line comments, ``/* */`` block comments and trailing commas;
they are removed outside strings only (``"nvme_path": "//mnt/x"`` survives). Duplicate
keys in one object are an error. Every problem comes out as a `ConfigError` whose message
names the dotted key, and the file when there is one.

"auto" values, as HF Trainer writes them: for the batch keys (`train_batch_size`,
`train_micro_batch_size_per_gpu`, `gradient_accumulation_steps`) "auto" means "derive it"
(same as leaving the key out); anywhere else it means "use zerotrain's default" and
comes with a `ConfigWarning` naming the key. A key with no default (such as
`scheduler.params.total_num_steps`) set to "auto" is an error, and so is any "auto" in an `HFSchedule` block
(zerotrain's, which only the HF arguments fill: `hf_arguments.auto_values`).
To fill "auto" from training arguments as HF's Trainer does, see `auto.fill_auto`.
"""
from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from typing import Any, Optional, Union

from pydantic import ValidationError

from .base import ConfigError, config_source, error_from_validation
from .schema import ZeroTrainConfig

__all__ = ["load_config", "read_config_file", "strip_json_comments", "parse_json_text"]

ConfigSource = Union[Mapping, str, os.PathLike, ZeroTrainConfig]


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def strip_json_comments(text: str) -> str:
    """`text` with comments and trailing commas blanked out; lines and columns stay where they were."""
    out: list[str] = []
    i, n = 0, len(text)
    in_string = False
    while i < n:
        c = text[i]
        if in_string:
            if c == "\\" and i + 1 < n:
                out.append(text[i:i + 2])
                i += 2
                continue
            in_string = c != '"'
            out.append(c)
            i += 1
        elif c == '"':
            in_string = True
            out.append(c)
            i += 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(" " * (end - i))
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            if end < 0:
                raise ValueError(f"unterminated /* comment starting at line {_line_of(text, i)}")
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:end + 2]))
            i = end + 2
        else:
            if c in "}]":
                _drop_trailing_comma(out)
            out.append(c)
            i += 1
    return "".join(out)


def _drop_trailing_comma(out: list[str]) -> None:
    k = len(out) - 1
    while k >= 0 and out[k].isspace():
        k -= 1
    if k < 0 or out[k] != ",":
        return
    j = k - 1
    while j >= 0 and out[j].isspace():
        j -= 1
    if j >= 0 and out[j] not in "[{,":  # "[,]" stays invalid
        out[k] = " "


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ConfigError(f"duplicate key '{key}' in one JSON object", key=key)
        result[key] = value
    return result


def parse_json_text(text: str, source: str = "<config>") -> dict[str, Any]:
    """Parse JSON (with comments / trailing commas) into a dict; ConfigError naming `source` and the line."""
    try:
        cleaned = strip_json_comments(text)
    except ValueError as err:
        raise ConfigError(f"{source}: {err}", file=source) from None
    try:
        data = json.loads(cleaned, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{source}: invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}",
                          file=source) from None
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}", key=err.key, file=source) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a JSON object, got {type(data).__name__}", file=source)
    return data


def read_config_file(path: Union[str, os.PathLike]) -> dict[str, Any]:
    """Read a JSON config file into a dict."""
    name = os.fspath(path)
    return parse_json_text(_read_text(name), name)


def _read_text(name: str) -> str:
    """The text of config file `name` (a ConfigError naming it when it cannot be read)."""
    try:
        with open(name, encoding="utf-8-sig") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise ConfigError(f"{name}: config file not found", file=name) from None
    except IsADirectoryError:
        raise ConfigError(f"{name}: is a directory, not a config file", file=name) from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{name}: not UTF-8 text ({err.reason} at byte {err.start})", file=name) from None
    except OSError as err:
        raise ConfigError(f"{name}: cannot read the config file: {err.strerror}", file=name) from None
    return text


def _drop_commented(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _drop_commented(v) for k, v in value.items() if not (isinstance(k, str) and k.startswith("_"))}
    if isinstance(value, list):
        return [_drop_commented(v) for v in value]
    return copy.deepcopy(value)


def _build(data: dict[str, Any], dp_world_size: Optional[int] = None) -> ZeroTrainConfig:
    context: dict[str, Any] = {}
    if isinstance(dp_world_size, int) and not isinstance(dp_world_size, bool):
        context["dp_world_size"] = dp_world_size  # named in batch-size errors
    try:
        cfg = ZeroTrainConfig.model_validate(data, context=context)
    except ValidationError as err:
        raise error_from_validation(err) from None
    cfg._raw = _drop_commented(data)
    cfg._unimplemented = context.get("unimplemented", {})
    return cfg


def load_config(source: ConfigSource, dp_world_size: Optional[int] = None) -> ZeroTrainConfig:
    """Build a `ZeroTrainConfig` from a dict, a JSON file path, or JSON text (a string starting with `{`).

    With `dp_world_size`, the batch triple is resolved too (`ZeroTrainConfig.resolve_batch`).
    Raises `ConfigError` naming the key (and the file) of the first problems found.
    """
    file: Optional[str] = None
    try:
        if isinstance(source, ZeroTrainConfig):
            cfg = source
        elif isinstance(source, Mapping):
            cfg = _build(dict(source), dp_world_size)
        elif isinstance(source, str) and source.lstrip().startswith("{"):
            cfg = _build(parse_json_text(source), dp_world_size)
        elif isinstance(source, (str, os.PathLike)):
            file = os.fspath(source)
            text = _read_text(file)
            with config_source(file, text):  # its warnings name the file and the key's line
                cfg = _build(parse_json_text(text, file), dp_world_size)
                if dp_world_size is not None:
                    cfg = cfg.resolve_batch(dp_world_size)
            return cfg
        else:
            raise ConfigError(f"config must be a dict or a path to a JSON file, got {type(source).__name__}")
        if dp_world_size is not None:
            cfg = cfg.resolve_batch(dp_world_size)
        return cfg
    except ConfigError as err:
        if file is None or err.file is not None:
            raise
        raise ConfigError(f"{file}: {err}", key=err.key, file=file) from None
