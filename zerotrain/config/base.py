"""Building blocks of the config schema: errors, value types, and key screening.

Every block of the config is a `Block` (a pydantic model). Before pydantic sees a
block's dict, `Block` screens its keys:

* keys starting with ``_`` are dropped (a JSON file's way of commenting a key out);
* legacy spellings (``LEGACY``) are renamed to the current key;
* ``"auto"`` (HF Trainer style) is dropped: keys in ``AUTO_MEANS_UNSET`` silently (the
  batch-size keys, which are then derived), every other key with a `ConfigWarning`,
  so it takes zerotrain's default; a required key set to ``"auto"`` is an error;
* keys DeepSpeed knows but zerotrain does not implement (``DEEPSPEED_ONLY``) are dropped
  with a `ConfigWarning` naming them (silently when their value is off: false, null,
  or a block with ``"enabled": false``);
* any other key inside a block is a `ConfigError` naming its dotted path and the closest valid key
  (DeepSpeed's own blocks forbid extra keys too); at the top level, a near-miss of a known key (a
  typo, or a block's key written at the top) is that error too, and any other unknown key is
  ignored with a `ConfigWarning` naming it, as DeepSpeed ignores it, unless the config sets
  ``"strict_config": true``.

Fields a block validates but zerotrain does not act on yet (``INERT``) warn, naming the
key, when set to anything but their default, and are listed in ``unimplemented``.

Each block class sits at one place in the config (``PATH``), so its messages carry
the full dotted key. Warnings are the job's: global rank 0 shows them, once (`warn`).
"""
from __future__ import annotations

import contextlib
import difflib
import math
import os
import sys
import warnings
from contextvars import ContextVar
from typing import Annotated, Any, ClassVar, Iterator, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from ..callsite import frame_outside

__all__ = ["ConfigError", "ConfigWarning", "Block", "Int", "PosInt", "NonNegInt", "Float", "NonNegFloat",
           "PosFloat", "Bool", "choice", "warn", "error_from_validation", "is_auto", "job_rank", "quiet_warnings"]


class ConfigError(ValueError):
    """A config value or key that cannot be used. `key` is the dotted key, `file` the source file."""

    def __init__(self, message: str, key: Optional[str] = None, file: Optional[str] = None):
        super().__init__(message)
        self.key = key
        self.file = file


class ConfigWarning(UserWarning):
    """A config key that was accepted but changes nothing (or was rewritten)."""


_PYDANTIC_DIR = os.path.dirname(os.path.abspath(sys.modules[BaseModel.__module__].__file__))
# The config file being read (its name and text), while `load_config` validates it: warnings point into it.
_SOURCE: ContextVar[Optional[tuple[str, str]]] = ContextVar("zerotrain_config_source", default=None)
# One registry for every config warning: the same warning about the same key is shown once per process (a config
# is validated more than once on its way into the engine).
_REGISTRY: dict = {}
# Config warnings shown at "<config>" (no user code to point at): each once per process (`warn`).
_SHOWN_UNPLACED: set = set()


@contextlib.contextmanager
def config_source(file: str, text: str) -> Iterator[None]:
    """While validating the config read from `file` (its `text`): `warn` names the file and the key's line."""
    token = _SOURCE.set((file, text))
    try:
        yield
    finally:
        _SOURCE.reset(token)


def key_line(text: str, key: Optional[str]) -> int:
    """The line of JSON `text` where dotted `key` is written (each part's quoted name searched after the previous
    one's; the deepest part found), 1 when not even its first part is there."""
    index, at = 0, None
    for part in (key or "").split(".") if key else ():
        found = text.find(f'"{part}"', index)
        if found < 0:
            break
        index = at = found
    return 1 if at is None else text.count("\n", 0, at) + 1


def job_rank() -> int:
    """This process's global rank in its job: torch.distributed's once a process group is up, else the launcher's
    `RANK` (torchrun, `zerotrain launch`, DeepSpeed's launcher all set it), else 0 (a process of its own)."""
    import torch.distributed as dist  # here: the config package has no torch import of its own at import time

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def warn(message: str, key: Optional[str] = None) -> None:
    """Warn with `ConfigWarning` about the user's config, never an internal source line: while a config file is
    read, at the file and the line of `key` (the dotted key the message names; Python shows that line of the
    file under the message); for a config given as a dict, at the first caller outside zerotrain and pydantic
    (the user's `zerotrain.initialize(config=...)`).

    Once per job: only global rank 0 warns (every rank reads the same config; with N ranks the same lines came N
    times). A launcher that validates the config before it starts the ranks does so under
    `quiet_warnings` and leaves them to rank 0."""
    if job_rank() != 0:
        return
    source = _SOURCE.get()
    if source is not None:
        file, text = source
        warnings.warn_explicit(message, ConfigWarning, file, key_line(text, key), registry=_REGISTRY)
        return
    frame = frame_outside(_PYDANTIC_DIR)
    if frame is None or frame.f_code.co_filename.startswith("<"):  # no user code (runpy): name the config
        # once per process by our own record: a `zerotrain` command reads its config several times, and Python's
        # registry forgets what it showed whenever a warnings filter changes in between (seen: each line twice)
        if message in _SHOWN_UNPLACED:
            return
        _SHOWN_UNPLACED.add(message)
        warnings.warn_explicit(message, ConfigWarning, "<config>", 0, registry=_REGISTRY)
        return
    warnings.warn_explicit(message, ConfigWarning, frame.f_code.co_filename, frame.f_lineno,
                           registry=frame.f_globals.setdefault("__warningregistry__", {}),
                           module_globals=frame.f_globals)


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    """No config warnings in this block: for a launcher that validates the config before it starts the ranks,
    whose rank 0 then warns (else each warning came from the launcher and again from rank 0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        yield


# --- value types: JSON-shaped, no silent coercion from strings or booleans -------------

def _type_name(value: Any) -> str:
    return "a boolean" if isinstance(value, bool) else f"{type(value).__name__} {value!r}"


def _whole(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected an integer, got {_type_name(value)}")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"expected a whole number, got {value!r}")
        return int(value)
    return value


def _real(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {_type_name(value)}")
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}")
    return float(value)


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {_type_name(value)}")
    return value


Int = Annotated[int, BeforeValidator(_whole)]
PosInt = Annotated[int, BeforeValidator(_whole), Field(ge=1)]
NonNegInt = Annotated[int, BeforeValidator(_whole), Field(ge=0)]
Float = Annotated[float, BeforeValidator(_real)]
NonNegFloat = Annotated[float, BeforeValidator(_real), Field(ge=0)]
PosFloat = Annotated[float, BeforeValidator(_real), Field(gt=0)]
Bool = Annotated[bool, BeforeValidator(_boolean)]


def choice(*options: str):
    """A string type accepting `options` in any letter case; the value is the canonical spelling."""
    by_lower = {o.lower(): o for o in options}

    def check(value: Any) -> str:
        if isinstance(value, str) and value.lower() in by_lower:
            return by_lower[value.lower()]
        raise ValueError(f"expected one of {', '.join(repr(o) for o in options)}, got {_type_name(value)}")

    return Annotated[str, BeforeValidator(check)]


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


# DeepSpeed-only keys whose value here is DeepSpeed's default and means what zerotrain does anyway.
_SAME_AS_ZEROTRAIN = {"gradient_predivide_factor": 1.0, "gradient_allreduce_op": "mean",
                      "managed_gradient_accumulation": True, "fp32_optimizer_states": True, "set_grad_none": True}


def _is_off(key: str, value: Any) -> bool:
    if key in _SAME_AS_ZEROTRAIN and value is not None:
        return value == _SAME_AS_ZEROTRAIN[key]
    if value is None or value is False:
        return True
    return isinstance(value, dict) and value.get("enabled") is False


# --- pydantic errors -> ConfigError ------------------------------------------------

def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _dotted(parts) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def error_from_validation(err: ValidationError, prefix: str = "") -> ConfigError:
    """One ConfigError listing every problem of `err`, each with its dotted key."""
    messages: list[str] = []
    first_key: Optional[str] = None
    base = tuple(p for p in prefix.split(".") if p)
    for item in err.errors(include_url=False):
        cause = (item.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigError):
            messages.append(str(cause))
            first_key = first_key or cause.key
            continue
        key = _dotted(base + tuple(item["loc"])) or "config"
        first_key = first_key or key
        if item["type"] == "missing":
            messages.append(f"{key}: required key is missing")
        elif cause is not None:
            messages.append(f"{key}: {cause}")
        else:
            messages.append(f"{key}: {item['msg']} (got {_short(item.get('input'))})")
    return ConfigError("; ".join(messages), key=first_key)


# --- the block base class ------------------------------------------------------------

_BLOCKS: dict[str, type["Block"]] = {}


class Block(BaseModel):
    """A config block: a pydantic model whose input keys are screened first (module docstring)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_default=False)

    PATH: ClassVar[str] = ""
    DEEPSPEED_ONLY: ClassVar[frozenset[str]] = frozenset()
    LEGACY: ClassVar[dict[str, str]] = {}
    WARN_LEGACY: ClassVar[frozenset] = frozenset()  # legacy spellings DeepSpeed itself deprecates: warn
    AUTO_MEANS_UNSET: ClassVar[frozenset[str]] = frozenset()
    INERT: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.PATH and "." not in cls.PATH:
            _BLOCKS.setdefault(cls.PATH, cls)

    @classmethod
    def key_path(cls, key: str) -> str:
        return f"{cls.PATH}.{key}" if cls.PATH else key

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Hook: rewrite legacy forms that need values (runs after `_` keys are dropped)."""
        return data

    @classmethod
    def _finish(cls, data: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """Hook: last look at the screened dict before pydantic validates the fields."""
        return data

    @model_validator(mode="before")
    @classmethod
    def _screen_keys(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict):
            return data
        for key in data:
            if not isinstance(key, str):
                raise ConfigError(f"{cls.key_path(repr(key))}: keys must be strings", key=cls.key_path(str(key)))
        data = cls._prepare({k: v for k, v in data.items() if not k.startswith("_")})
        out: dict[str, Any] = {}
        given_as: dict[str, str] = {}
        for key, value in data.items():
            name = cls.LEGACY.get(key, key)
            if key in cls.WARN_LEGACY:
                warn(f"{cls.key_path(key)} is the older name of {cls.key_path(name)}; read as {cls.key_path(name)}",
                     cls.key_path(key))
            if name in cls.model_fields:
                if name in given_as:
                    if out.get(name) != value:
                        raise ConfigError(f"{cls.key_path(given_as[name])} and {cls.key_path(key)} are the same "
                                          f"setting with different values; keep one", key=cls.key_path(name))
                    continue
                given_as[name] = key
                if is_auto(value):
                    cls._drop_auto(name)
                    continue
                out[name] = value
            elif key in cls.DEEPSPEED_ONLY:
                cls._record_deepspeed_only(key, value, info)
            else:
                cls._unknown_key(key, strict=data.get("strict_config") is True)
        return cls._finish(out, info)

    @model_validator(mode="after")
    def _warn_inert(self, info: ValidationInfo):
        """Warn about `INERT` fields set to a non-default value: accepted, but they change nothing."""
        for name in sorted(self.INERT):
            value = getattr(self, name)
            if value == type(self).model_fields[name].get_default(call_default_factory=True):
                continue
            path = self.key_path(name)
            if isinstance(info.context, dict):
                info.context.setdefault("unimplemented", {})[path] = value
            warn(f"{path} = {value!r}: zerotrain accepts this DeepSpeed key but does not implement it; "
                 f"it has no effect", path)
        return self

    @classmethod
    def _drop_auto(cls, name: str) -> None:
        if name in cls.AUTO_MEANS_UNSET:
            return
        field = cls.model_fields[name]
        if field.is_required():
            raise ConfigError(f"{cls.key_path(name)} is 'auto', but it has no default; set a value",
                              key=cls.key_path(name))
        default = field.get_default(call_default_factory=True)
        if default is None:
            meaning = "it is left unset"
        elif isinstance(default, BaseModel):
            meaning = "the block takes its defaults"
        else:
            meaning = f"the default {default!r} is used"
        warn(f"{cls.key_path(name)} is 'auto', which zerotrain does not fill in; {meaning}", cls.key_path(name))

    @classmethod
    def _record_deepspeed_only(cls, key: str, value: Any, info: ValidationInfo) -> None:
        path = cls.key_path(key)
        if isinstance(info.context, dict):
            info.context.setdefault("unimplemented", {})[path] = value
        if not _is_off(key, value):
            warn(f"{path} is a DeepSpeed key that zerotrain does not implement; it is ignored and has no effect", path)

    @classmethod
    def _unknown_key(cls, key: str, strict: bool) -> None:
        """Raise for an unknown key; at the top level, warn instead when it is no near-miss (DeepSpeed ignores
        unknown top-level keys, e.g. `cuda_visible_devices` in DeepSpeedExamples' imagenet config)."""
        path = cls.key_path(key)
        suggestion = cls._near_miss(key)
        if suggestion is not None:
            raise ConfigError(f"unknown key '{path}'; did you mean '{suggestion}'?", key=path)
        if cls.PATH or strict:
            valid = ", ".join(cls.model_fields)
            why = " (strict_config is true)" if not cls.PATH else ""
            raise ConfigError(f"unknown key '{path}'{why}; valid keys here: {valid}", key=path)
        warn(f"unknown top-level key '{path}' is ignored, as DeepSpeed ignores it (set \"strict_config\": true "
             f"to make this an error)", path)

    @classmethod
    def _near_miss(cls, key: str) -> Optional[str]:
        """The known key `key` is probably a typo of (or a block's key written at the top level), or None."""
        if not cls.PATH:
            for block_path, block in _BLOCKS.items():
                if key in block.model_fields:
                    return f"{block_path}.{key}"
        valid = list(cls.model_fields) + list(cls.LEGACY) + sorted(cls.DEEPSPEED_ONLY)
        by_lower = {v.lower(): v for v in valid}
        close = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.6)
        if not close:
            return None
        # At the top level an error needs a real typo: a small edit distance, not just a shared word.
        if not cls.PATH and _edit_distance(key.lower(), close[0]) > max(2, len(close[0]) // 4):
            return None
        return by_lower[close[0]]


def _edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (difflib has a similarity ratio, not a distance)."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]
