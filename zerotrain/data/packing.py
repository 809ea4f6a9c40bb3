"""Turning tokenized documents into fixed-length training samples, and batching them.

Packing (the default): documents are concatenated in order and cut into ``seq_len`` blocks.
Each block carries ``position_ids`` that restart at 0 at every document start, and the label of
each document's first token is ``-100`` (it would otherwise be predicted from the previous
document's last token). With attention confined to each document, every document's loss in a
block is exactly its loss alone. How the model is told to confine attention:

- ``"position_ids"``: models whose modeling code builds its mask with transformers'
  ``masking_utils.create_causal_mask`` (transformers 5.x: Llama, Qwen2/3, Mistral, Gemma, Phi3,
  GPT-2, ... — see :func:`packed_attention_mode`) detect the position resets themselves when no
  ``attention_mask`` is passed and no KV cache is used (``use_cache=False``): eager and sdpa get a
  block-diagonal causal mask, flash-attention its varlen (``cu_seq_lens``) kernel.
- ``"mask_4d"``: every other model gets an explicit additive 4-D block-diagonal causal mask
  ``(batch, 1, seq, seq)`` (works with eager/sdpa attention, not with flash-attention; it costs
  batch x seq² elements, so it is only the fallback).

A document longer than ``seq_len`` continues in the next block as a new segment (positions
restart; it cannot attend to the previous block anyway). The last partial block is padded
(``pad_token_id``, labels ``-100``) so no tokens are lost.

Padding (``packing=False``): one document per sample (a long one split into ``seq_len``
chunks), padded per batch to the longest sample, with a 2-D ``attention_mask``.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from zerotrain.data.tokenization import IGNORE_INDEX

__all__ = ["PackedDataset", "DocumentDataset", "PackedCollator", "PaddingCollator", "packed_attention_mode",
           "block_diagonal_mask"]


def _flat(ds, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(all values concatenated, per-document lengths) of a list column of a datasets.Dataset.

    Reads the Arrow table directly: for a dataset loaded from the cache (memory-mapped, one chunk)
    the values array is a zero-copy view of the file, so the token stream is not held in memory.
    Several chunks are concatenated per chunk (a copy, 4 bytes per token), never through one
    combined list array (whose int32 offsets would overflow past 2**31 tokens).
    """
    if getattr(ds, "_indices", None) is not None:  # a select()/shuffle() view: .data would ignore it
        ds = ds.flatten_indices()
    chunks = ds.data.column(column).chunks
    values = [c.flatten().to_numpy(zero_copy_only=False) for c in chunks]
    lengths = [c.value_lengths().to_numpy(zero_copy_only=False) for c in chunks]
    if not values:
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64)
    flat = values[0] if len(values) == 1 else np.concatenate(values)
    return flat, np.concatenate(lengths).astype(np.int64)


class PackedDataset(Dataset):
    """``seq_len`` blocks of concatenated documents; item ``i`` is a dict of 1-D int64 tensors
    ``input_ids``, ``labels`` and ``position_ids`` (the labels are *not* shifted: HF causal LMs
    shift them inside ``forward``). Blocks are cut on access from the flat token stream, so memory
    beyond the (memory-mapped) cache is one offset per document."""

    def __init__(self, tokenized, seq_len: int, pad_token_id: int) -> None:
        if seq_len <= 1:
            raise ValueError(f"seq_len must be at least 2, got {seq_len}")
        self.ids, lengths = _flat(tokenized, "input_ids")
        self.labels, _ = _flat(tokenized, "labels")
        lengths = lengths[lengths > 0]
        self.total = int(lengths.sum())
        self.doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self.seq_len = seq_len
        self.pad_token_id = pad_token_id
        self._len = max(1, -(-self.total // seq_len))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> dict:
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"block {i} out of range for {self._len} blocks")
        L = self.seq_len
        s, e = i * L, min((i + 1) * L, self.total)
        n = e - s
        ids = np.full(L, self.pad_token_id, dtype=np.int64)
        labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
        ids[:n] = self.ids[s:e]
        labels[:n] = self.labels[s:e]
        # Documents starting in this block: their first token is never predicted from another document.
        inside = self.doc_starts[np.searchsorted(self.doc_starts, s):np.searchsorted(self.doc_starts, e)] - s
        labels[inside] = IGNORE_INDEX
        # Segments: the block start, every document start, and the padding; positions restart at each.
        seg = np.unique(np.concatenate([[0], inside, [n] if n < L else []]).astype(np.int64))
        idx = np.arange(L, dtype=np.int64)
        positions = idx - seg[np.searchsorted(seg, idx, side="right") - 1]
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(positions)}


class DocumentDataset(Dataset):
    """One document per item (documents longer than ``seq_len`` split into ``seq_len`` chunks)."""

    def __init__(self, tokenized, seq_len: int) -> None:
        self.ids, lengths = _flat(tokenized, "input_ids")
        self.labels = _flat(tokenized, "labels")[0]
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        spans = [(s, min(s + seq_len, e)) for b, e in zip(offsets[:-1], offsets[1:]) for s in range(b, e, seq_len)]
        self.spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, i: int) -> dict:
        s, e = self.spans[i]
        return {"input_ids": torch.from_numpy(self.ids[s:e].astype(np.int64)),
                "labels": torch.from_numpy(self.labels[s:e].astype(np.int64))}


def block_diagonal_mask(position_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive ``(batch, 1, L, L)`` mask: token q sees token k iff k <= q in the same segment
    (segments start where ``position_ids`` does not increase by one)."""
    first = position_ids[:, :1] - 1
    segment = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    L = position_ids.shape[-1]
    causal = torch.ones(L, L, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (segment[:, :, None] == segment[:, None, :]) & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def packed_attention_mode(model: Any) -> str:
    """``"position_ids"`` when the model's transformers code builds its causal mask through
    ``masking_utils.create_causal_mask`` (it then honours position-id resets itself), otherwise
    ``"mask_4d"``. A model whose ``forward`` takes no ``position_ids`` (ALiBi models such as Bloom,
    MPT: their position bias comes from the 2-D padding mask) cannot be packed: an error saying to
    use padding instead."""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise ValueError(f"{type(model).__name__}.forward takes no position_ids, so packed documents cannot be "
                         "kept apart; train it with packing=False (--no-packing)")
    try:  # the position-reset detection itself (transformers >= 4.54; 5.x tested)
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        return "mask_4d"
    module = sys.modules.get(type(model).__module__)
    if module is not None and hasattr(module, "create_causal_mask"):
        return "position_ids"
    return "mask_4d"


class PackedCollator:
    """Stacks packed blocks; with ``attention="mask_4d"`` adds the explicit block-diagonal mask."""

    def __init__(self, attention: str = "position_ids", mask_dtype: torch.dtype = torch.float32) -> None:
        if attention not in ("position_ids", "mask_4d"):
            raise ValueError(f"attention must be 'position_ids' or 'mask_4d', got {attention!r}")
        self.attention = attention
        self.mask_dtype = mask_dtype

    def __call__(self, items: list[dict]) -> dict:
        batch = {k: torch.stack([it[k] for it in items]) for k in ("input_ids", "labels", "position_ids")}
        if self.attention == "mask_4d":
            batch["attention_mask"] = block_diagonal_mask(batch["position_ids"], self.mask_dtype)
        return batch


class PaddingCollator:
    """Right-pads a batch of documents to its longest (optionally a multiple of ``pad_to_multiple_of``)."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: Optional[int] = None) -> None:
        self.pad_token_id = pad_token_id
        self.multiple = pad_to_multiple_of

    def __call__(self, items: list[dict]) -> dict:
        longest = max(len(it["input_ids"]) for it in items)
        if self.multiple:
            longest = -(-longest // self.multiple) * self.multiple
        n = len(items)
        ids = torch.full((n, longest), self.pad_token_id, dtype=torch.int64)
        labels = torch.full((n, longest), IGNORE_INDEX, dtype=torch.int64)
        mask = torch.zeros((n, longest), dtype=torch.int64)
        for row, it in enumerate(items):
            k = len(it["input_ids"])
            ids[row, :k] = it["input_ids"]
            labels[row, :k] = it["labels"]
            mask[row, :k] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
