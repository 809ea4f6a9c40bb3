"""Pair data for contrastive training: jsonl records, batches without duplicate texts, tokenized micro-batches.

A record is one JSON object per line: ``{"query": str, "positive": str, "negatives": [str, ...]}``
(``negatives`` optional). Every query of a run takes the same number of hard negatives (the first
``num_negatives`` of its list; by default the fewest any record has), so that every rank holds as
many candidates as every other. Records are validated line by line (a malformed one is named by
file and line: ``datasets``' json loader would name a byte offset in a block), then held as a
``datasets.Dataset``.

Batches: as sentence-transformers' NO_DUPLICATES batch sampler, but over the GLOBAL batch (every
micro-batch of every rank: with GradCache and negatives across ranks they are all one contrastive
batch): a record whose query, positive or a negative is already in the batch waits for a later
one, since a duplicate text would be a false negative for its twin.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from zerotrain.data.records import BadRecord, BadRecordError

from .gradcache import PairBatch

__all__ = ["PairData", "DataPosition", "load_pairs", "global_batches", "rank_micro_batches", "tokenize_micro_batch"]


@dataclass
class PairData:
    """The records (a ``datasets.Dataset`` with ``query``, ``positive``, ``negatives`` columns)."""
    dataset: Any
    num_negatives: int
    files: list[str]

    def __len__(self) -> int:
        return len(self.dataset)


@dataclass
class DataPosition:
    """Where a run stands in its data after a step, saved in the checkpoint's trainer state (client_state):
    `batch` global batches of epoch `epoch` consumed, `consumed_samples` queries in all; and what the
    order of batches depends on: the shuffling `seed`, the `global_batch` (ranks x accumulation x
    micro-batch queries) and the number of `pairs`. With the same three a run resumes at the exact next
    batch at any world size (GradCache makes the global batch one loss, however it is split)."""
    epoch: int
    batch: int
    seed: int
    global_batch: int
    pairs: int
    consumed_samples: int

    def to_dict(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, saved: dict, where: str) -> "DataPosition":
        try:
            return cls(**{name: int(saved[name]) for name in cls.__dataclass_fields__})
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{where}: no valid data position in the checkpoint's trainer state "
                             f"(client_state.embedding.data = {saved!r})") from None

    def check_resumable(self, *, global_batch: int, pairs: int, seed: Optional[int], where: str,
                        split: str) -> None:
        """Raise ValueError unless a run with these settings continues this data order exactly."""
        if global_batch != self.global_batch:
            raise ValueError(
                f"--resume from {where}: the checkpoint trained global contrastive batches of {self.global_batch} "
                f"queries; this run's is {global_batch} ({split}). Resuming is supported at any world size, "
                f"accumulation and micro-batch whose product is the same global batch ({self.global_batch}): "
                "the batch order and the loss of each batch depend on it")
        if pairs != self.pairs:
            raise ValueError(f"--resume from {where}: the checkpoint's data had {self.pairs} pairs, --data has "
                             f"{pairs}: the data order cannot be continued on other data")
        if seed is not None and seed != self.seed:
            raise ValueError(f"--resume from {where}: --seed {seed} differs from the checkpoint's {self.seed} "
                             "(the data order); leave --seed out to continue with the checkpoint's")


def _check_record(record: Any, num_negatives: Optional[int]) -> Optional[str]:
    if not isinstance(record, dict):
        return f"a record must be a JSON object, got {type(record).__name__}"
    for key in ("query", "positive"):
        if key not in record:
            return f"no '{key}' field (a record is {{\"query\", \"positive\", \"negatives\": [...]}})"
        if not isinstance(record[key], str) or not record[key].strip():
            return f"'{key}' must be a non-empty string"
    negatives = record.get("negatives", [])
    if not isinstance(negatives, list) or not all(isinstance(n, str) and n.strip() for n in negatives):
        return "'negatives' must be a list of non-empty strings"
    if num_negatives is not None and len(negatives) < num_negatives:
        return f"{len(negatives)} negatives, fewer than the {num_negatives} every query takes (--negatives)"
    unknown = set(record) - {"query", "positive", "negatives"}
    if unknown:
        return f"unknown field(s) {sorted(unknown)}"
    return None


def load_pairs(paths: Sequence[Union[str, Path]], num_negatives: Optional[int] = None) -> PairData:
    """Read and validate jsonl pair files; raises BadRecordError naming every bad line (up to 20), on one line."""
    import datasets

    records, bad, files = [], [], []
    for path in map(Path, paths):
        if not path.is_file():
            raise BadRecordError(f"{path}: no such file")
        files.append(str(path))
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    bad.append(BadRecord(str(path), f"line {lineno}", f"not valid JSON ({e.msg})"))
                    continue
                error = _check_record(record, num_negatives)
                if error is not None:
                    bad.append(BadRecord(str(path), f"line {lineno}", error))
                else:
                    records.append({"query": record["query"], "positive": record["positive"],
                                    "negatives": list(record.get("negatives", []))})
    if bad:
        more = f"; ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise BadRecordError("bad pair records: " + "; ".join(map(str, bad[:20])) + more)  # one line
    if not records:
        raise BadRecordError(f"{', '.join(files)}: no records")
    fewest = min(len(r["negatives"]) for r in records)
    count = fewest if num_negatives is None else num_negatives
    for r in records:
        r["negatives"] = r["negatives"][:count]
    return PairData(datasets.Dataset.from_list(records), count, files)


def _texts(record: dict) -> list[str]:
    return [record["query"], record["positive"], *record["negatives"]]


def global_batches(data: PairData, global_batch: int, *, seed: int = 0, epoch: int = 0) -> Iterator[list[int]]:
    """Record indices of each global batch of one epoch (shuffled by seed and epoch), no text twice in a batch.

    Like sentence-transformers' NoDuplicatesBatchSampler: records that would repeat a text wait for a
    later batch; an incomplete last batch is dropped.
    """
    order = list(range(len(data)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    texts = [_texts(data.dataset[i]) for i in order] if len(order) else []
    waiting = list(range(len(order)))
    while len(waiting) >= global_batch:
        batch, seen, rest = [], set(), []
        for index, position in enumerate(waiting):
            if not seen.intersection(texts[position]):
                batch.append(position)
                seen.update(texts[position])
                if len(batch) == global_batch:
                    rest.extend(waiting[index + 1:])
                    break
            else:
                rest.append(position)
        if len(batch) < global_batch:
            return  # what is left cannot fill a batch without duplicates
        yield [order[p] for p in batch]
        waiting = rest


def rank_micro_batches(batch: list[int], rank: int, world: int, accumulation: int) -> list[list[int]]:
    """This rank's `accumulation` micro-batches of a global batch (ranks take consecutive slices)."""
    per_rank = len(batch) // world
    mine = batch[rank * per_rank:(rank + 1) * per_rank]
    micro = per_rank // accumulation
    return [mine[i * micro:(i + 1) * micro] for i in range(accumulation)]


def tokenize_micro_batch(data: PairData, indices: list[int], tokenizer: Any, max_length: int,
                         device: Optional[torch.device] = None) -> PairBatch:
    """Queries, then positives and negatives (query-major) of `indices`, tokenized: the queries padded
    together, the passages together (each to its own longest text, not the queries to the passages')."""
    records = [data.dataset[i] for i in indices]
    queries = [r["query"] for r in records]
    passages = [r["positive"] for r in records] + [n for r in records for n in r["negatives"]]

    def tokenize(texts: list[str]) -> dict[str, torch.Tensor]:
        return dict(tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt"))

    batch = PairBatch(tokenize(queries), len(records), tokenize(passages))
    return batch.to(device) if device is not None else batch
