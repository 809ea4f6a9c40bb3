"""A training corpus that is always there: the Python standard library's own source.

Every Python installation carries a few tens of megabytes of ``.py`` files next to
``os.py``. Read in a fixed order and treated as bytes, they make a deterministic,
offline, licence-clean text corpus for byte-level language models. Nothing is downloaded.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Optional, Union

import torch
from torch.utils.data import Dataset

__all__ = [
    "DEFAULT_MAX_BYTES",
    "stdlib_dir",
    "iter_stdlib_sources",
    "load_stdlib_corpus",
    "TokenBlockDataset",
    "split",
]

DEFAULT_MAX_BYTES = 8 * 1024 * 1024

# Directories under the stdlib root that hold third-party or generated code: their content
# differs between installations, so they would make the corpus machine-dependent.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_dir() -> Path:
    """The directory holding the standard library's pure-Python modules."""
    return Path(os.__file__).resolve().parent


def iter_stdlib_sources(root: Optional[Union[str, Path]] = None) -> Iterator[Path]:
    """Every ``.py`` file under ``root`` (default: the stdlib), in a fixed order.

    The order is that of the POSIX relative paths, sorted, so it does not depend on the
    file system's directory listing order. ``site-packages`` and ``dist-packages`` are skipped.
    """
    base = Path(root) if root is not None else stdlib_dir()
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(base).as_posix(), path))
    found.sort(key=lambda item: item[0])
    for _, path in found:
        yield path


def load_stdlib_corpus(
    max_bytes: Optional[int] = DEFAULT_MAX_BYTES, root: Optional[Union[str, Path]] = None
) -> torch.Tensor:
    """The concatenated source files as a 1-D ``uint8`` tensor of at most ``max_bytes`` bytes.

    Files are joined in :func:`iter_stdlib_sources` order; the last one is cut at the limit.
    ``max_bytes=None`` reads everything. Identical on every rank of a job, so each rank can
    load it independently.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    buf = bytearray()
    for path in iter_stdlib_sources(root):
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable file (permissions, dangling link): skip it deterministically
        buf += data
        if data and not data.endswith(b"\n"):
            buf += b"\n"
        if max_bytes is not None and len(buf) >= max_bytes:
            del buf[max_bytes:]
            break
    if not buf:
        raise RuntimeError(f"no Python source files found under {root or stdlib_dir()}")
    return torch.frombuffer(buf, dtype=torch.uint8).clone()


class TokenBlockDataset(Dataset):
    """Non-overlapping blocks of a token stream for next-token prediction.

    Item ``i`` is ``(x, y)`` with ``x = tokens[i*B : (i+1)*B]`` and ``y`` the same window
    shifted right by one, both ``int64`` of length ``block_size``. A trailing remainder too
    short for a full block (plus its one-token target shift) is dropped.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.tokens = tokens
        self.block_size = int(block_size)
        self._len = max(0, (tokens.numel() - 1) // self.block_size)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"block {index} out of range for {self._len} blocks")
        start = index * self.block_size
        window = self.tokens[start : start + self.block_size + 1].to(torch.int64)
        return window[:-1], window[1:]


def split(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)``: the first ``1 - val_fraction`` of the stream and the rest.

    A contiguous cut (not a shuffle), so no validation block overlaps a training block.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(round(tokens.numel() * val_fraction))
    cut = tokens.numel() - n_val
    return tokens[:cut], tokens[cut:]
