"""An offline retrieval task from the Python standard library: a function's docstring -> its source.

Pairs are built from the stdlib's own files (no download): the query is the first paragraph of a
function's docstring, the positive is the function's source with the docstring removed. Modules are
split by a hash of their path into train and held-out, so no held-out function's module was seen in
training. `retrieval_metrics` scores every held-out query against every held-out passage: recall@1,
recall@10 and MRR@10 (sentence-transformers' InformationRetrievalEvaluator's definitions).
"""
from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path
from typing import Optional, Union

import torch

from zerotrain.data.corpus import iter_stdlib_sources, stdlib_dir

__all__ = ["stdlib_pairs", "write_pairs", "retrieval_metrics"]


def _pairs_of(path: Path, min_doc_chars: int) -> list[dict]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or not node.body or not isinstance(node.body[0], ast.Expr):
            continue
        query = " ".join(doc.strip().split("\n\n")[0].split())
        if len(query) < min_doc_chars:
            continue
        node.body = node.body[1:] or [ast.Pass()]  # the source without its docstring
        pairs.append({"query": query, "positive": ast.unparse(node)})
    return pairs


def stdlib_pairs(*, held_out_fraction: float = 0.2, max_pairs: Optional[int] = None, min_doc_chars: int = 20,
                 root: Optional[Union[str, Path]] = None,
                 max_held_out: Optional[int] = None) -> tuple[list[dict], list[dict]]:
    """(train, held_out) docstring -> source pairs; each module wholly in one split (by a hash of its path).

    `max_held_out`: stop reading once that many held-out pairs are found (they are the same first ones
    a full read gives; the train split is then partial): parsing the whole stdlib takes tens of seconds."""
    base = Path(root) if root is not None else stdlib_dir()
    train, held_out, seen = [], [], set()
    for path in iter_stdlib_sources(base):
        relative = path.relative_to(base).as_posix()
        if "test" in relative.split("/")[0]:
            continue  # the stdlib's test suites: thousands of near-identical test methods
        bucket = int(hashlib.sha256(relative.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        for pair in _pairs_of(path, min_doc_chars):
            if pair["query"] in seen or pair["positive"] in seen:
                continue
            seen.update((pair["query"], pair["positive"]))
            (held_out if bucket < held_out_fraction else train).append(pair)
        if max_pairs is not None and len(train) + len(held_out) >= max_pairs:
            break
        if max_held_out is not None and len(held_out) >= max_held_out:
            break
    return train, held_out


def write_pairs(pairs: list[dict], path: Union[str, Path]) -> Path:
    """Write pairs as the jsonl `train-embedding --data` reads."""
    path = Path(path)
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    return path


def retrieval_metrics(queries: torch.Tensor, passages: torch.Tensor) -> dict[str, float]:
    """Query i's relevant passage is passage i; embeddings unit-length. recall@1, recall@10, MRR@10."""
    scores = queries.float() @ passages.float().T
    target = scores.diagonal().unsqueeze(1)
    rank = (scores > target).sum(dim=1)  # 0 = ranked first (ties count for the query)
    return {"recall@1": float((rank < 1).float().mean()), "recall@10": float((rank < 10).float().mean()),
            "mrr@10": float(torch.where(rank < 10, 1.0 / (rank + 1).float(), torch.zeros_like(rank, dtype=torch.float)).mean())}
