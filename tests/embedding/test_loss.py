"""The loss (Matryoshka prefixes) against plain PyTorch, and the retrieval metrics on known rankings."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zerotrain.embedding import contrastive_loss
from zerotrain.embedding.retrieval import retrieval_metrics, stdlib_pairs


def test_matryoshka_sums_the_loss_of_each_normalised_prefix():
    generator = torch.Generator().manual_seed(0)
    queries, candidates = torch.randn(6, 16, generator=generator), torch.randn(10, 16, generator=generator)
    want = 0.0
    for dim in (16, 8, 4):
        scores = F.normalize(queries[:, :dim], dim=-1) @ F.normalize(candidates[:, :dim], dim=-1).T * 20.0
        want = want + F.cross_entropy(scores, torch.arange(6))
    got = contrastive_loss(queries, candidates, scale=20.0, matryoshka_dims=[16, 8, 4])
    torch.testing.assert_close(got, want)
    plain = contrastive_loss(queries, candidates, scale=20.0)
    assert abs(plain.item() - got.item()) > 1e-3  # the prefixes change the loss


def test_retrieval_metrics_on_known_ranks():
    # passages along the axes; the queries' positives rank first, second and 13th
    passages = torch.eye(15)
    queries = torch.zeros(3, 15)
    queries[0, 0] = 1.0                                  # rank 0
    queries[1, 1], queries[1, 5] = 0.5, 0.8              # positive (1) second
    queries[2, 2] = 0.1
    queries[2, 3:] = 0.2                                 # 12 passages above positive 2
    metrics = retrieval_metrics(F.normalize(queries, dim=-1), passages)
    assert abs(metrics["recall@1"] - 1 / 3) < 1e-6
    assert abs(metrics["recall@10"] - 2 / 3) < 1e-6
    assert abs(metrics["mrr@10"] - (1 + 0.5 + 0) / 3) < 1e-6


def test_stdlib_pairs_split_by_module(tmp_path):
    for i in range(20):
        (tmp_path / f"mod{i}.py").write_text(f'def f{i}(x):\n    """Return x plus {i}, a documented helper."""\n'
                                             f'    return x + {i}\n')
    train, held_out = stdlib_pairs(root=tmp_path, held_out_fraction=0.3)
    assert train and held_out and len(train) + len(held_out) == 20
    assert held_out[0]["positive"].startswith("def f") and '"""' not in held_out[0]["positive"]
    assert {p["query"] for p in train}.isdisjoint(p["query"] for p in held_out)
