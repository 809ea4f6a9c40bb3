"""The local-files data path the Trainer calls: files -> cached tokens -> samples -> this rank's batches.

    data = build_data(DataConfig(paths=["chat.jsonl"], seq_len=512), tokenizer, comm=world_comm, model=model)
    loader = data.loader(micro_batch_size=4, global_batch_size=32, dp_rank=r, dp_size=n,
                         consumed_samples=state.consumed_samples)

See ``docs/data.md`` for the formats and rules.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from zerotrain.data.packing import (DocumentDataset, PackedCollator, PackedDataset, PaddingCollator,
                                    packed_attention_mode)
from zerotrain.data.sampler import ResumableSampler
from zerotrain.data.tokenization import TokenizedData, TokenizeSettings, tokenize_files

__all__ = ["DataConfig", "TrainData", "build_data"]

logger = logging.getLogger(__name__)


@dataclass
class DataConfig:
    """What ``--data``/``--eval-data`` and their options set."""
    paths: list[Union[str, Path]]
    seq_len: int = 1024
    packing: bool = True
    text_field: str = "text"
    messages_field: str = "messages"
    add_eos: bool = True
    skip_bad_records: bool = False
    txt_sample_by: str = "document"
    num_proc: Optional[int] = None
    cache_dir: Optional[Union[str, Path]] = None
    seed: int = 0
    shuffle: bool = True

    def settings(self) -> TokenizeSettings:
        return TokenizeSettings(self.text_field, self.messages_field, self.add_eos, self.skip_bad_records,
                                self.txt_sample_by)


@dataclass
class TrainData:
    """Samples ready for training: ``dataset[i]`` is a dict of 1-D tensors, ``collator`` batches them."""
    dataset: Dataset
    collator: Any
    tokenized: TokenizedData
    config: DataConfig
    attention: str = "position_ids"  # how packed blocks confine attention ("position_ids" / "mask_4d" / "padding")
    skipped: list[str] = field(default_factory=list)

    def sampler(self, *, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1, consumed_samples: int = 0,
                num_epochs: Optional[int] = None, shuffle: Optional[bool] = None) -> ResumableSampler:
        return ResumableSampler(len(self.dataset), global_batch_size=global_batch_size, dp_rank=dp_rank,
                                dp_size=dp_size, seed=self.config.seed,
                                shuffle=self.config.shuffle if shuffle is None else shuffle,
                                consumed_samples=consumed_samples, num_epochs=num_epochs)

    def loader(self, *, micro_batch_size: int, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
               consumed_samples: int = 0, num_epochs: Optional[int] = None, shuffle: Optional[bool] = None,
               num_workers: int = 0) -> DataLoader:
        """This rank's batches of ``micro_batch_size`` samples, resuming after ``consumed_samples``."""
        per_rank = global_batch_size // max(dp_size, 1)
        if per_rank % micro_batch_size:
            raise ValueError(f"global batch {global_batch_size} / dp {dp_size} = {per_rank} samples per rank is "
                             f"not a multiple of the micro batch {micro_batch_size}")
        sampler = self.sampler(global_batch_size=global_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                               consumed_samples=consumed_samples, num_epochs=num_epochs, shuffle=shuffle)
        return DataLoader(self.dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=self.collator,
                          num_workers=num_workers, drop_last=True)

    def eval_loader(self, *, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> DataLoader:
        """Every sample exactly once across ranks, in order (rank ``r`` takes ``r, r + dp_size, ...``).

        Ranks may get one batch more or less than each other: sum losses and token counts
        locally and reduce once at the end (no per-batch collective). A set smaller than one
        micro-batch per rank gives every rank one batch, the samples taken in turn from the
        rank's own offset and repeated (each rank runs the same forwards, as ZeRO-3 needs: a
        sample may count more than once).
        """
        n = len(self.dataset)
        if 0 < n < micro_batch_size * dp_size:
            indices = [(dp_rank * micro_batch_size + j) % n for j in range(micro_batch_size)]
        else:
            indices = list(range(dp_rank, n, dp_size))
        return DataLoader(self.dataset, batch_size=micro_batch_size, sampler=indices, collate_fn=self.collator)

    def eval_batches(self, *, micro_batch_size: int, dp_size: int = 1) -> int:
        """Batches every rank has in `eval_loader` (at least one when there is any sample)."""
        n = len(self.dataset)
        return max(1, n // (micro_batch_size * dp_size)) if n else 0

    def hold_out(self, fraction: float) -> tuple["TrainData", "TrainData"]:
        """``(train, held_out)``: the last ``fraction`` of the samples (at least one) held out for evaluation, as
        the tail of the built-in corpus is; ValueError when no sample would be left to train on."""
        n = len(self.dataset)
        held = max(1, round(n * fraction))
        if held >= n:
            raise ValueError(f"holding out {fraction:g} of {n} samples for evaluation leaves none to train on")
        return (dataclasses.replace(self, dataset=Subset(self.dataset, range(n - held))),
                dataclasses.replace(self, dataset=Subset(self.dataset, range(n - held, n))))


def build_data(config: DataConfig, tokenizer, *, comm=None, local_rank: Optional[int] = None, model: Any = None,
               attention: Optional[str] = None, mask_dtype: torch.dtype = torch.float32) -> TrainData:
    """Tokenize (cached; one builder per node when ``comm`` spans the job) and pack or pad.

    ``attention`` for packing: ``"position_ids"`` or ``"mask_4d"``; by default chosen from
    ``model`` with :func:`packed_attention_mode` (``"position_ids"`` without a model).
    ``mask_dtype``: the dtype of the additive 4-D mask (the model's compute dtype). Packing in
    ``"position_ids"`` mode sets ``model.config.use_cache = False`` (see the comment below); without
    ``model`` the caller must run the model with ``use_cache=False``.
    """
    if not config.paths:
        raise ValueError("no data paths given")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token; add one (e.g. --add-tokens)")
    tokenized = tokenize_files(config.paths, tokenizer, config.settings(), cache_dir=config.cache_dir,
                               num_proc=config.num_proc, comm=comm, local_rank=local_rank)
    if tokenized.skipped:
        shown = "; ".join(tokenized.skipped[:5])
        logger.warning("skipped %d bad record(s): %s%s", len(tokenized.skipped), shown,
                       " ..." if len(tokenized.skipped) > 5 else "")
    if config.packing:
        mode = attention or (packed_attention_mode(model) if model is not None else "position_ids")
        if mode == "position_ids" and model is not None and getattr(model, "config", None) is not None:
            # With a KV cache (config.use_cache, true in most HF configs, also in train mode)
            # transformers skips its position-reset detection and packed documents would see each
            # other; training never uses the cache.
            model.config.use_cache = False
        dataset: Dataset = PackedDataset(tokenized.dataset, config.seq_len, pad_id)
        collator: Any = PackedCollator(mode, mask_dtype)
    else:
        mode = "padding"
        dataset = DocumentDataset(tokenized.dataset, config.seq_len)
        collator = PaddingCollator(pad_id)
    return TrainData(dataset, collator, tokenized, config, mode, list(tokenized.skipped))
