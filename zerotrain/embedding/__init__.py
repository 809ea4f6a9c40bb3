"""`zerotrain.embedding`: contrastive fine-tuning of sentence-embedding models (`docs/embedding.md`).

- `pooling`: mean / CLS / last-token pooling, read from a sentence-transformers directory.
- `loss`: InfoNCE (scale 20, as MultipleNegativesRankingLoss) over in-batch, hard and cross-rank
  negatives; Matryoshka dims.
- `gradcache`: `ContrastiveStep`, one engine step where gradient accumulation is one bigger batch.
- `steps`: `PairSteps`, that step over pair data in order, plugged into the one training loop
  (`zerotrain.trainer.Trainer`, its `TrainStep`).
"""
from .gradcache import ContrastiveStep, PairBatch, embed, embed_batch
from .loss import contrastive_loss, info_nce
from .pooling import MODES, Pooling, pool, read_pooling

__all__ = ["ContrastiveStep", "PairBatch", "embed", "embed_batch", "contrastive_loss", "info_nce", "MODES", "Pooling", "pool",
           "read_pooling"]
