"""One contrastive training step over the engine, with gradient accumulation as ONE bigger batch (GradCache).

Usual gradient accumulation adds up the gradients of independent micro-batches. For a contrastive
loss that is a smaller batch: each micro-batch's queries only see that micro-batch's negatives.
Here, as GradCache (Gao et al. 2021) and PaddleNLP's EmbeddingTrainer do, the `accumulation`
micro-batches of a step form one batch:

1. every micro-batch is embedded WITHOUT autograd (the RNG state saved before each, so dropout
   draws the same masks again in step 3);
2. the loss is computed over all the embeddings at once (every query against every candidate of
   every micro-batch and, through `all_gather_with_grad`, of every rank), and back-propagated to
   the embeddings only: their gradients are cached;
3. every micro-batch is embedded again WITH autograd (its RNG state restored) and back-propagated
   through the engine with its cached embedding gradients (`sum(embedding * cached_grad)`).

The weights' gradient is exactly that of the loss of the whole batch, while only one micro-batch's
activations are ever held. World N x accumulation A x micro-batch B trains as one process with a
batch of N*A*B.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from zerotrain.comm import Comm
from zerotrain.training_engine import TrainingEngine

from .loss import contrastive_loss
from .pooling import Pooling, pool

__all__ = ["PairBatch", "ContrastiveStep", "embed", "embed_batch"]


@dataclass
class PairBatch:
    """One micro-batch, tokenized: rows are its queries, then their positives, then their hard negatives
    (query-major: query 0's negatives first). `features` is what the encoder takes (`input_ids`,
    `attention_mask`, maybe `token_type_ids`).

    With `passage_features`, `features` holds the queries only and `passage_features` the positives and
    negatives, each padded to its own longest text: queries are usually much shorter than passages, and
    padding them to the passages' length would encode mostly padding (sentence-transformers tokenizes
    each column on its own for the same reason). The embeddings are the same either way."""
    features: dict[str, torch.Tensor]
    num_queries: int
    passage_features: Optional[dict[str, torch.Tensor]] = None

    @property
    def num_rows(self) -> int:
        rows = int(self.features["input_ids"].shape[0])
        return rows + (int(self.passage_features["input_ids"].shape[0]) if self.passage_features else 0)

    @property
    def tokens(self) -> torch.Tensor:
        """Attended positions of every text (a tensor: no device sync)."""
        count = self.features["attention_mask"].sum()
        return count + self.passage_features["attention_mask"].sum() if self.passage_features else count

    def to(self, device: torch.device) -> "PairBatch":
        passages = {k: v.to(device) for k, v in self.passage_features.items()} if self.passage_features else None
        return PairBatch({k: v.to(device) for k, v in self.features.items()}, self.num_queries, passages)


def embed(model: Any, features: dict[str, torch.Tensor], pooling: Pooling) -> torch.Tensor:
    """Pooled (not yet normalised) embeddings of `features` by `model` (an engine or a module returning
    token states: a transformers output with `last_hidden_state`, or a tuple whose first item they are)."""
    output = model(**features)
    hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
    return pool(hidden, features["attention_mask"], pooling.mode)


def embed_batch(model: Any, batch: PairBatch, pooling: Pooling) -> torch.Tensor:
    """Embeddings of every row of `batch` (queries, positives, negatives), one forward per feature set."""
    queries = embed(model, batch.features, pooling)
    if batch.passage_features is None:
        return queries
    return torch.cat([queries, embed(model, batch.passage_features, pooling)])


def _rng_state(device: torch.device) -> tuple:
    accelerator = torch.get_device_module(device.type).get_rng_state(device) if device.type != "cpu" else None
    return torch.get_rng_state(), accelerator


def _set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.get_device_module(device.type).set_rng_state(state[1], device)


class ContrastiveStep:
    """`step(micro_batches)` runs one optimizer step of the engine over `accumulation` micro-batches.

    `engine` is a zerotrain engine (`zerotrain.training_engine.TrainingEngine`: DeepSpeed's
    `__call__`/`backward`/`step` and `gradient_accumulation_steps()`); `comm` the data-parallel Comm whose
    ranks share negatives (None: this rank's only). `chunk_size`: compute the loss in tiles of that many
    queries x candidates (inf-CL style, `zerotrain.embedding.loss.chunked_info_nce`); None holds the whole
    score matrix.

    `step` makes no collective of its own for what it reports: it returns this rank's loss (its queries' mean
    over the whole batch's candidates: the mean over ranks is the global batch's loss) and leaves in `tokens`
    this rank's input tokens (attended positions of its texts); the training loop reduces both once per step
    (`zerotrain.trainer.reduce_step`).
    """

    def __init__(self, engine: TrainingEngine, comm: Optional[Comm], pooling: Pooling, *, scale: float = 20.0,
                 matryoshka_dims: Optional[Sequence[int]] = None, chunk_size: Optional[int] = None):
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"loss chunk size must be at least 1, got {chunk_size}")
        self.engine, self.comm, self.pooling = engine, comm, pooling
        self.scale, self.matryoshka_dims, self.chunk_size = scale, matryoshka_dims, chunk_size
        self.tokens: torch.Tensor = torch.zeros(())

    def loss(self, embeddings: list[torch.Tensor], batches: Sequence[PairBatch]) -> torch.Tensor:
        """This rank's loss over the embeddings of all its micro-batches (one batch)."""
        queries, positives, negatives = [], [], []
        for emb, batch in zip(embeddings, batches):
            q = batch.num_queries
            queries.append(emb[:q])
            positives.append(emb[q:2 * q])
            negatives.append(emb[2 * q:])
        candidates = torch.cat(positives + negatives)
        return contrastive_loss(torch.cat(queries), candidates, self.comm, scale=self.scale,
                                matryoshka_dims=self.matryoshka_dims, chunk_size=self.chunk_size)

    def step(self, micro_batches: Sequence[PairBatch]) -> torch.Tensor:
        """One optimizer step; returns this rank's loss (a detached tensor: the mean over ranks is the global
        batch's loss) and leaves this rank's input tokens in `tokens`."""
        engine = self.engine
        accumulation = engine.gradient_accumulation_steps()
        if len(micro_batches) != accumulation:
            raise ValueError(f"a contrastive step takes gradient_accumulation_steps={accumulation} micro-batches "
                             f"(one batch), got {len(micro_batches)}")
        device = next(iter(micro_batches[0].features.values())).device
        states, cached = [], []
        with torch.no_grad():  # 1. embed without autograd
            for batch in micro_batches:
                states.append(_rng_state(device))
                cached.append(embed_batch(engine, batch, self.pooling).float())
        after = _rng_state(device)
        # 2. the loss over the whole batch, back to the embeddings only
        leaves = [e.detach().requires_grad_() for e in cached]
        loss = self.loss(leaves, micro_batches)
        loss.backward()
        # 3. re-embed each micro-batch with autograd and push its cached gradient through the engine; the loss
        # is the whole batch's already: not divided by the accumulation steps again (scale_wrt_gas=False)
        for state, batch, leaf in zip(states, micro_batches, leaves):
            _set_rng_state(state, device)
            emb = embed_batch(engine, batch, self.pooling)
            surrogate = (emb.float() * leaf.grad).sum()
            engine.backward(surrogate, scale_wrt_gas=False)
            engine.step()
        _set_rng_state(after, device)
        self.tokens = sum(b.tokens for b in micro_batches)  # a tensor: no device sync
        return loss.detach()
