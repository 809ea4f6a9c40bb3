"""GradCache over the engine = one bigger contrastive batch, negatives shared across ranks.

Accumulation 4 x micro 8 trains as ONE batch of 32 queries at world 1, and of 64 at world 2 (every
query scored against every rank's positives and hard negatives), at ZeRO stages 0-3: losses and
weights as plain single-process PyTorch computing InfoNCE over the whole batch at once.
The inf-CL chunked loss (`chunk_size`, tiles of 5 x 5: ragged edges) trains the same, at world 1 and
across ranks. A run that accumulates independent micro-batches (the usual reading) is shown to fall
outside the tolerance, so the check can fail.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from distributed import run_distributed
from tests.models_for_tests import assert_same_training

MICRO, ACCUMULATION, NEGATIVES, SEQ, STEPS, LR, SCALE = 8, 4, 1, 10, 2, 2e-3, 20.0
# Adam divides by sqrt(v) + eps: a larger eps keeps float noise in near-zero gradients from being magnified
EPS = 1e-6
# The run that hides nothing: dropout on (the re-embedding must replay the first pass's masks), plain SGD and no
# clipping (AdamW and clipping are blind to a uniform gradient scale, e.g. a lost `* accumulation`)
DROPOUT, SGD_LR, DROPOUT_SEED = 0.1, 0.5, 1234


def tiny_bert(dropout: float = 0.0):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout)
    return BertModel(config, add_pooling_layer=False)


def micro_batches(world: int) -> list[list[list[dict]]]:
    """batches[step][rank][micro] = features of one micro-batch: queries, positives, negatives (rows)."""
    generator = torch.Generator().manual_seed(7)
    rows = MICRO * (2 + NEGATIVES)
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(world):
            ranks = []
            for _ in range(ACCUMULATION):
                ids = torch.randint(1, 64, (rows, SEQ), generator=generator)
                lengths = torch.randint(3, SEQ + 1, (rows,), generator=generator)
                mask = (torch.arange(SEQ) < lengths[:, None]).long()
                ranks.append({"input_ids": ids * mask, "attention_mask": mask})
            step.append(ranks)
        out.append(step)
    return out


def _pooled(model, features):
    hidden = model(**features).last_hidden_state
    mask = features["attention_mask"].unsqueeze(-1).float()
    return (hidden * mask).sum(1) / mask.sum(1)


def reference(world: int, independent: bool = False, dropout_sgd: bool = False):
    """Plain PyTorch: per step, InfoNCE of all world x accumulation x micro queries against all candidates.

    `independent=True` is the usual accumulation instead (each micro-batch its own contrastive batch).
    `dropout_sgd=True`: dropout on, plain SGD, no clipping (see `train_all_stages`)."""
    model = tiny_bert(DROPOUT if dropout_sgd else 0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR) if dropout_sgd else \
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=EPS)
    torch.manual_seed(DROPOUT_SEED)
    losses = []
    for step in micro_batches(world):
        groups = [[mb for ranks in step for mb in ranks]] if not independent else \
            [[mb] for ranks in step for mb in ranks]
        total = 0.0
        for group in groups:
            embs = [_pooled(model, mb) for mb in group]
            queries = torch.cat([e[:MICRO] for e in embs])
            # candidate order is free: positives first, so query i's target is candidate i
            candidates = torch.cat([e[MICRO:2 * MICRO] for e in embs] + [e[2 * MICRO:] for e in embs])
            scores = F.normalize(queries, dim=-1) @ F.normalize(candidates, dim=-1).T * SCALE
            loss = F.cross_entropy(scores, torch.arange(len(queries))) / len(groups)
            loss.backward()
            total += loss.item()
        if not dropout_sgd:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_all_stages(cases, dropout_sgd: bool = False):
    """On every rank: for each (stage, loss chunk size), an engine trained with ContrastiveStep; rank 0
    returns losses and weights. `dropout_sgd`: also a stage-0 run with dropout on, SGD and no clipping
    (under the key "dropout sgd")."""
    import zerotrain
    from zerotrain.comm import Comm
    from zerotrain.embedding import ContrastiveStep, PairBatch, Pooling
    from zerotrain.trainer import StepResult, reduce_step
    import torch.distributed as dist

    results = {}
    for stage, chunk in cases:
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
                  "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "eps": EPS}},
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": 500,
                                        "stage3_param_persistence_threshold": 0},
                  "steps_per_print": 0, "comm_timeout_seconds": 60}
        engine, *_ = zerotrain.initialize(model=tiny_bert(), config=config)
        comm = Comm.data_parallel(engine.topology)
        rank, world = dist.get_rank(), dist.get_world_size()
        step = ContrastiveStep(engine, comm, Pooling("mean"), scale=SCALE, chunk_size=chunk)
        # stages 2-3 take the queries and the passages as two feature sets (two forwards per micro-batch,
        # as the CLI's tokenization gives them); 0-1 one set holding every row
        split = (lambda f: PairBatch({k: v[:MICRO] for k, v in f.items()}, MICRO,
                                     {k: v[MICRO:] for k, v in f.items()})) if stage >= 2 else \
            (lambda f: PairBatch(f, MICRO))
        # the step's local sums reduced as the Trainer does, once per step; each rank's memory figure is its own
        # (1000 + rank): the reduction gathers them in rank order
        totals = [reduce_step(StepResult(loss=step.step([split(f) for f in batches[rank]]), lr=0.0,
                                         tokens=step.tokens), memory=1000 + rank)
                  for batches in micro_batches(world)]
        losses = [t.loss for t in totals]
        weights = engine.full_state_dict()
        engine.close()
        results[(stage, chunk)] = (losses, weights, (totals[-1].tokens, totals[-1].memory))
    if dropout_sgd:
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
                  "optimizer": {"type": "SGD", "params": {"lr": SGD_LR}}, "gradient_clipping": 0.0, "steps_per_print": 0,
                  "comm_timeout_seconds": 60}
        engine, *_ = zerotrain.initialize(model=tiny_bert(DROPOUT), config=config)
        step = ContrastiveStep(engine, Comm.data_parallel(engine.topology), Pooling("mean"), scale=SCALE)
        torch.manual_seed(DROPOUT_SEED)
        losses = [step.step([PairBatch(f, MICRO) for f in batches[0]]).item() for batches in micro_batches(1)]
        results["dropout sgd"] = (losses, engine.full_state_dict())
        engine.close()
    return results if dist.get_rank() == 0 else None


def _check(results, world):
    ref_losses, ref_weights = reference(world)
    if "dropout sgd" in results:
        losses, weights = results.pop("dropout sgd")
        assert_same_training(losses, weights, *reference(world, dropout_sgd=True), where="dropout on, SGD")
    # the last step's input tokens over every rank (attended positions), and every rank's memory in rank order
    tokens = sum(int(f["attention_mask"].sum()) for ranks in micro_batches(world)[-1] for f in ranks)
    for (stage, chunk), (losses, weights, counts) in results.items():
        try:
            assert_same_training(losses, weights, ref_losses, ref_weights)
            assert counts == (tokens, [1000 + rank for rank in range(world)]), counts
        except AssertionError as error:
            raise AssertionError(f"world {world}, stage {stage}, loss chunk {chunk}: {error}") from None
    # the usual accumulation (independent micro-batches) trains differently: the check can fail
    other_losses, other_weights = reference(world, independent=True)
    assert any(abs(a - b) > 1e-3 * abs(b) for a, b in zip(other_losses, ref_losses)), (other_losses, ref_losses)
    assert max((other_weights[n] - w).abs().max().item() for n, w in ref_weights.items()) > 1e-4


def test_accumulation_is_one_batch_world1():
    _check(run_distributed(train_all_stages, 1, ((0, None), (3, None), (0, 5)), dropout_sgd=True)[0], 1)


def test_negatives_across_ranks_world2_all_stages():
    _check(run_distributed(train_all_stages, 2, ((0, None), (1, None), (2, None), (3, None), (3, 5)),
                           timeout=240)[0], 2)
