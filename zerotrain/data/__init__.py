"""Data for zerotrain.

- ``corpus``: the built-in byte-level standard-library corpus and block dataset (demo, tests, benchmarks).
- Local files for Hugging Face models (``docs/data.md``): ``records`` reads and validates them with
  ``datasets``, ``tokenization`` tokenizes and caches (one builder per node), ``packing`` makes
  ``seq_len`` blocks or padded batches, ``sampler`` gives each data-parallel rank its resumable
  share, and ``local.build_data`` ties them together for the Trainer.

The local-files modules import ``datasets``/``transformers`` lazily (the ``hf`` extra).
"""
from zerotrain.data.corpus import (
    DEFAULT_MAX_BYTES,
    TokenBlockDataset,
    iter_stdlib_sources,
    load_stdlib_corpus,
    split,
    stdlib_dir,
)
from zerotrain.data.local import DataConfig, TrainData, build_data
from zerotrain.data.packing import packed_attention_mode
from zerotrain.data.records import BadRecordError
from zerotrain.data.sampler import ResumableSampler

__all__ = [
    "DEFAULT_MAX_BYTES",
    "TokenBlockDataset",
    "iter_stdlib_sources",
    "load_stdlib_corpus",
    "split",
    "stdlib_dir",
    "BadRecordError",
    "DataConfig",
    "ResumableSampler",
    "TrainData",
    "build_data",
    "packed_attention_mode",
]
