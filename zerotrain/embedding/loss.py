"""The contrastive loss: InfoNCE over in-batch, hard and cross-rank negatives (optionally Matryoshka).

As sentence-transformers' MultipleNegativesRankingLoss: scores are cosine similarities times
`scale` (20, i.e. temperature 0.05), and each query's target is its own positive among every
candidate (all positives and hard negatives of the batch). Across ranks the candidates are
all-gathered with their gradient (`zerotrain.comm.all_gather_with_grad`), each rank scoring its own
queries against every rank's candidates, labels offset by the rank's position in the gather.

With `chunk_size` the loss is computed inf-CL style (Cheng et al. 2024, "Breaking the Memory Barrier",
as PaddleNLP's EmbeddingTrainer offers it): the Q x M score matrix is never held whole. The forward
walks chunk x chunk tiles, keeping per query a running log-sum-exp over the candidate chunks; the
backward recomputes each tile and turns it into its softmax gradient there, accumulating the query and
candidate gradients tile by tile. The largest tensor the loss allocates is then one tile (or the
embeddings' own size), not Q x M. The result is the same loss and gradients (float rounding aside).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from zerotrain.comm import Comm, all_gather_with_grad

__all__ = ["info_nce", "chunked_info_nce", "contrastive_loss"]


def info_nce(queries: torch.Tensor, candidates: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
    """Mean cross-entropy of `scale` x cosine(queries, candidates) against `labels` (candidate index per query)."""
    scores = F.normalize(queries, dim=-1) @ F.normalize(candidates, dim=-1).T * scale
    return F.cross_entropy(scores, labels)


class _TiledCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `scale * queries @ candidates.T` (unit rows) against `labels`, in tiles.

    Written by hand (not autograd over a loop of tiles) because autograd would keep every tile's
    scores for the backward, i.e. the whole matrix again; here only the per-query log-sum-exp is
    saved and tiles are recomputed."""

    @staticmethod
    def forward(ctx, queries: torch.Tensor, candidates: torch.Tensor, labels: torch.Tensor, scale: float,
                chunk: int) -> torch.Tensor:
        lse = torch.empty(queries.shape[0], dtype=queries.dtype, device=queries.device)
        for q0 in range(0, queries.shape[0], chunk):
            rows = queries[q0:q0 + chunk]
            running = None
            for c0 in range(0, candidates.shape[0], chunk):  # online log-sum-exp over candidate chunks
                part = torch.logsumexp(rows @ candidates[c0:c0 + chunk].T * scale, dim=1)
                running = part if running is None else torch.logaddexp(running, part)
            lse[q0:q0 + chunk] = running
        target = (queries * candidates[labels]).sum(-1) * scale
        ctx.save_for_backward(queries, candidates, labels, lse)
        ctx.scale, ctx.chunk = scale, chunk
        return (lse - target).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        queries, candidates, labels, lse = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        factor = grad * scale / queries.shape[0]
        d_queries, d_candidates = torch.zeros_like(queries), torch.zeros_like(candidates)
        for q0 in range(0, queries.shape[0], chunk):
            rows, row_lse = queries[q0:q0 + chunk], lse[q0:q0 + chunk, None]
            for c0 in range(0, candidates.shape[0], chunk):
                block = candidates[c0:c0 + chunk]
                # d loss / d score = softmax - one-hot; the softmax part here, tile by tile
                probs = torch.exp(rows @ block.T * scale - row_lse).mul_(factor)
                d_queries[q0:q0 + chunk].addmm_(probs, block)
                d_candidates[c0:c0 + chunk].addmm_(probs.T, rows)
        d_queries.sub_(candidates[labels] * factor)  # the one-hot part
        d_candidates.index_add_(0, labels, queries * -factor)
        return d_queries, d_candidates, None, None, None


def chunked_info_nce(queries: torch.Tensor, candidates: torch.Tensor, labels: torch.Tensor, scale: float,
                     chunk_size: int) -> torch.Tensor:
    """`info_nce` computed in `chunk_size` x `chunk_size` tiles: the full score matrix is never allocated."""
    if chunk_size < 1:
        raise ValueError(f"loss chunk size must be at least 1, got {chunk_size}")
    return _TiledCrossEntropy.apply(F.normalize(queries, dim=-1), F.normalize(candidates, dim=-1), labels,
                                    float(scale), int(chunk_size))


def contrastive_loss(queries: torch.Tensor, candidates: torch.Tensor, comm: Optional[Comm] = None, *,
                     scale: float = 20.0, matryoshka_dims: Optional[Sequence[int]] = None,
                     chunk_size: Optional[int] = None) -> torch.Tensor:
    """This rank's loss: its `queries` (Q rows) against every rank's `candidates`.

    `candidates` holds this rank's Q positives first (row i is query i's), then its hard negatives.
    With `matryoshka_dims` the loss is summed over the leading-dims prefixes of the embeddings, each
    normalised on its own (sentence-transformers' MatryoshkaLoss with weights 1). With `chunk_size`
    the scores are computed in tiles of that many queries x candidates (`chunked_info_nce`).
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
    if chunk_size is not None:
        return sum(chunked_info_nce(queries[:, :dim], every[:, :dim], labels, scale, chunk_size) for dim in dims)
    return sum(info_nce(queries[:, :dim], every[:, :dim], labels, scale) for dim in dims)
