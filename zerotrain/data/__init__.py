"""Data for zerotrain's demo and tests: a built-in byte-level corpus and block datasets."""
from zerotrain.data.corpus import (
    DEFAULT_MAX_BYTES,
    TokenBlockDataset,
    iter_stdlib_sources,
    load_stdlib_corpus,
    split,
    stdlib_dir,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "TokenBlockDataset",
    "iter_stdlib_sources",
    "load_stdlib_corpus",
    "split",
    "stdlib_dir",
]
