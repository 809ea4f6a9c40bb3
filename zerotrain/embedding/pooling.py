"""Pooling token states into one embedding per text, as sentence-transformers' `Pooling` module does.

The mode is read from a sentence-transformers model directory when it has one (`modules.json`
names the Pooling module's folder, whose `config.json` holds `pooling_mode` in sentence-transformers 6, or the
`pooling_mode_*` flags older versions write); a plain Hugging Face encoder directory defaults to mean pooling.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch

__all__ = ["Pooling", "MODES", "pool", "read_pooling"]

MODES = ("mean", "cls", "lasttoken", "max")
# sentence-transformers' config flag for each of our modes
_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
          "lasttoken": "pooling_mode_lasttoken", "max": "pooling_mode_max_tokens"}
# modules.json's "type" of the Pooling module: `sentence_transformers.models.Pooling` (older versions) or the class's
# own module path (`sentence_transformers.sentence_transformer.modules.pooling.Pooling`, 6.x)
_POOLING_TYPE = "sentence_transformers.models.Pooling"


def _is_pooling(module_type: str) -> bool:
    return module_type == _POOLING_TYPE or (module_type.startswith("sentence_transformers.")
                                            and module_type.endswith(".Pooling"))


@dataclass(frozen=True)
class Pooling:
    """How to pool (`mode`), and what the model directory said (`normalize`: it ends in a Normalize module)."""
    mode: str = "mean"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"pooling mode {self.mode!r} is not one of {MODES}")


def read_pooling(model_dir: Union[str, Path], override: str | None = None) -> Pooling:
    """The pooling of a sentence-transformers directory (`modules.json`), `override` if given, else mean."""
    model_dir = Path(model_dir)
    modules_path = model_dir / "modules.json"
    mode, normalize = "mean", True
    if modules_path.is_file():
        modules = json.loads(modules_path.read_text())
        normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
        for module in modules:
            if not _is_pooling(str(module.get("type", ""))):
                continue
            config_path = model_dir / module.get("path", "") / "config.json"
            if not config_path.is_file():
                raise ValueError(f"{modules_path}: the Pooling module's {config_path} is missing")
            config = json.loads(config_path.read_text())
            named = config.get("pooling_mode")  # a mode or a list of modes (sentence-transformers 6)
            if named is not None:
                modes = [named] if isinstance(named, str) else list(named)
                chosen = [m for m in modes if m in MODES]
                others = [m for m in modes if m not in MODES]
            else:
                chosen = [m for m, flag in _FLAGS.items() if config.get(flag)]
                others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v
                          and k not in _FLAGS.values()]
            if others or len(chosen) != 1:
                raise ValueError(f"{config_path}: pooling {chosen + others} is not supported; "
                                 f"exactly one of {sorted(_FLAGS.values())} must be true (pooling_mode: one of "
                                 f"{list(MODES)})")
            mode = chosen[0]
    return Pooling(override or mode, normalize)


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """(batch, seq, dim) token states -> (batch, dim), ignoring padding (`attention_mask` 0)."""
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    if mode == "mean":
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        # the last attended position of each row (right or left padding alike)
        positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        last = (attention_mask.to(torch.long) * positions).argmax(dim=1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    if mode == "max":
        return hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
    raise ValueError(f"pooling mode {mode!r} is not one of {MODES}")
