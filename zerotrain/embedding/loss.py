"""The contrastive loss: InfoNCE over in-batch, hard and cross-rank negatives (optionally Matryoshka).

As sentence-transformers' MultipleNegativesRankingLoss: scores are cosine similarities times
`scale` (20, i.e. temperature 0.05), and each query's target is its own positive among every
candidate (all positives and hard negatives of the batch). Across ranks the candidates are
all-gathered with their gradient (`zerotrain.comm.all_gather_with_grad`), each rank scoring its own
queries against every rank's candidates, labels offset by the rank's position in the gather.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from zerotrain.comm import Comm, all_gather_with_grad

__all__ = ["info_nce", "contrastive_loss"]


def info_nce(queries: torch.Tensor, candidates: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
    """Mean cross-entropy of `scale` x cosine(queries, candidates) against `labels` (candidate index per query)."""
    scores = F.normalize(queries, dim=-1) @ F.normalize(candidates, dim=-1).T * scale
    return F.cross_entropy(scores, labels)


def contrastive_loss(queries: torch.Tensor, candidates: torch.Tensor, comm: Optional[Comm] = None, *,
                     scale: float = 20.0, matryoshka_dims: Optional[Sequence[int]] = None) -> torch.Tensor:
    """This rank's loss: its `queries` (Q rows) against every rank's `candidates`.

    `candidates` holds this rank's Q positives first (row i is query i's), then its hard negatives.
    With `matryoshka_dims` the loss is summed over the leading-dims prefixes of the embeddings, each
    normalised on its own (sentence-transformers' MatryoshkaLoss with weights 1).
    """
    if candidates.shape[0] < queries.shape[0]:
        raise ValueError(f"{candidates.shape[0]} candidates for {queries.shape[0]} queries: the positives come first")
    rank = comm.rank if comm is not None else 0
    every = all_gather_with_grad(comm, candidates) if comm is not None else candidates
    labels = torch.arange(queries.shape[0], device=queries.device) + rank * candidates.shape[0]
    dims = list(matryoshka_dims) if matryoshka_dims else [queries.shape[-1]]
    for dim in dims:
        if not 0 < dim <= queries.shape[-1]:
            raise ValueError(f"matryoshka dim {dim} is outside 1..{queries.shape[-1]} (the embedding size)")
    return sum(info_nce(queries[:, :dim], every[:, :dim], labels, scale) for dim in dims)
