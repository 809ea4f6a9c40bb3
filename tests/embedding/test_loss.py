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


class _LargestAllocation(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the element count of the largest tensor any op returns while active (views excluded:
    they allocate nothing)."""

    def __init__(self):
        super().__init__()
        self.largest, self.shape = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                    self.largest, self.shape = t.numel(), tuple(t.shape)
        return out


def _loss_and_grads(chunk_size, queries, candidates, dims):
    q, c = queries.clone().requires_grad_(), candidates.clone().requires_grad_()
    with _LargestAllocation() as tracker:
        loss = contrastive_loss(q, c, scale=20.0, matryoshka_dims=dims, chunk_size=chunk_size)
        loss.backward()
    return loss.detach(), q.grad, c.grad, tracker


def test_chunked_loss_equals_the_whole_matrix_and_allocates_one_tile_at_most():
    # 48 queries x 96 candidates (positives + one hard negative each), 8 dims, tiles of 7 (ragged edges)
    generator = torch.Generator().manual_seed(1)
    queries, candidates = torch.randn(48, 8, generator=generator), torch.randn(96, 8, generator=generator)
    for dims in (None, [8, 4]):
        whole, dq, dc, plain = _loss_and_grads(None, queries, candidates, dims)
        tiled, tq, tc, chunked = _loss_and_grads(7, queries, candidates, dims)
        torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=0)
        torch.testing.assert_close(tq, dq, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(tc, dc, rtol=1e-5, atol=1e-7)
        # accounting: the unchunked loss holds the 48 x 96 score matrix; the chunked one never more than
        # a 7 x 7 tile or the embeddings' own size (their gradients)
        assert plain.largest >= 48 * 96, plain.shape
        assert chunked.largest <= max(7 * 7, 96 * 8) < 48 * 96, chunked.shape
