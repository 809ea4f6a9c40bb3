"""The loss (Matryoshka prefixes) against plain PyTorch, and the retrieval metrics on known rankings."""
from __future__ import annotations

import json

import pytest
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


def test_retrieval_metrics_count_ties_for_the_query_and_cut_at_the_tenth_place():
    """Four queries against twelve passages, by hand: ties with the positive rank the query first (its positive
    counted as above them), the 10th place is inside @10 and the 11th outside. Passage j is the unit vector
    e_(j+1 mod 12) (not symmetric: a transposed score matrix differs), so query i scores passage j with
    q_i[(j+1) % 12]."""
    want_scores = torch.zeros(4, 12)   # [query, passage]
    want_scores[0, 0] = want_scores[0, 7] = 1.0          # tie at the top: rank 0, RR 1
    want_scores[1, 1] = 0.1
    want_scores[1, 2:11] = 0.2                           # 9 above: the 10th place, RR 1/10
    want_scores[2, 2] = 0.1
    want_scores[2, [0, 1, 3, 4, 5, 6, 7, 8, 9, 10]] = 0.2  # 10 above: the 11th place, outside @10
    want_scores[3, 0], want_scores[3, 3], want_scores[3, 4] = 0.9, 0.5, 0.5  # one above, a tie below: RR 1/2
    passages = torch.roll(torch.eye(12), shifts=1, dims=1)  # passage j = e_(j+1)
    queries = F.normalize(want_scores @ passages, dim=-1)   # q_i . passage_j = want_scores[i, j] / |q_i|
    metrics = retrieval_metrics(queries.double(), passages.double())
    assert metrics == {"recall@1": 1 / 4, "recall@10": 3 / 4, "mrr@10": pytest.approx((1 + 1 / 10 + 0 + 1 / 2) / 4,
                                                                                        rel=1e-6)}


def _module(root, relative: str, text: str):
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_stdlib_pairs_take_each_documented_functions_first_paragraph_once_and_stop_where_asked(tmp_path):
    """What a pair is (the first paragraph of the docstring, whitespace collapsed -> the function's source without
    it), which functions give none (no or too short a docstring, a repeated query or source, a test suite's
    top-level directory (`tools/latest.py` is no test suite), a file that does not parse), the split by the
    module's path under the root, and the two limits."""
    from zerotrain.embedding.retrieval import write_pairs

    root = tmp_path / "lib"
    _module(root, "alpha.py",
            'def first(x):\n    """Return the   first\n    thing of x.\n\n    Details nobody asks about."""\n'
            '    return x[0]\n\n\n'
            'async def only_doc():\n    """Exactly twenty chars"""\n\n\n'   # 20 characters: kept; body -> pass
            'def short():\n    """Nineteen chars here"""\n    return 1\n\n\n'  # 19: no pair
            'def bare():\n    return 2\n\n\n'
            'def noisy():\n    print("an expression first, no docstring")\n\n\n'
            'class Holder:\n    def method(self):\n        """A method documented well enough."""\n'
            '        return self\n')
    _module(root, "beta.py",
            'def first(x):\n    """Return the first thing of x."""\n    return x[1]\n\n\n'  # the same query: none
            'def other(x):\n    """Some other words entirely here."""\n    return x[0]\n')  # differs from alpha's
    _module(root, "gamma.py", 'def first(x):\n    """A new query for the same source."""\n    return x[0]\n')
    _module(root, "test/test_delta.py", 'def check():\n    """A test suite function with words."""\n')
    _module(root, "broken.py", 'def f(:\n    """Never parsed, though documented."""\n')
    _module(root, "tools/latest.py", 'def newest():\n    """Not a test suite, though named so."""\n    return 3\n')
    train, held_out = stdlib_pairs(root=root, held_out_fraction=0.0)
    assert held_out == []
    assert train == [
        {"query": "Return the first thing of x.", "positive": "def first(x):\n    return x[0]"},
        {"query": "Exactly twenty chars", "positive": "async def only_doc():\n    pass"},
        {"query": "A method documented well enough.", "positive": "def method(self):\n    return self"},
        {"query": "Some other words entirely here.", "positive": "def other(x):\n    return x[0]"},
        {"query": "Not a test suite, though named so.", "positive": "def newest():\n    return 3"},
    ]  # gamma's source is alpha's first (seen); beta's first asks alpha's query; files in path order
    assert stdlib_pairs(root=root, held_out_fraction=0.0, min_doc_chars=21)[0] == [train[0], *train[2:]]
    everything = stdlib_pairs(root=root, held_out_fraction=1.0)
    assert everything == ([], train)
    # jsonl (`train-embedding --data`'s format), one pair a line, in order
    lines = write_pairs(train, tmp_path / "pairs.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == train

    # 30 modules of two pairs each: a module wholly in one split, the same split under another root, more modules
    # held out at a larger fraction; max_pairs stops after the module that reaches it, max_held_out once reached
    for root_name in ("one", "two"):
        for i in range(30):
            _module(tmp_path / root_name, f"pkg/m{i:02d}.py",
                    "".join(f'def f{i}_{k}():\n    """Helper number {i} variant {k} here."""\n    return {k}\n\n\n'
                            for k in range(2)))
    train, held_out = stdlib_pairs(root=tmp_path / "one", held_out_fraction=0.5)
    assert (train, held_out) == stdlib_pairs(root=tmp_path / "two", held_out_fraction=0.5)
    assert len(train) + len(held_out) == 60 and 10 <= len(held_out) <= 50
    module = lambda pair: pair["positive"].split("_")[0]  # noqa: E731 ("def f12" of f12_0 and f12_1)
    held = [module(p) for p in held_out]
    assert all(held.count(m) == 2 for m in held) and set(held).isdisjoint(module(p) for p in train)
    fewer = stdlib_pairs(root=tmp_path / "one", held_out_fraction=0.25)[1]
    assert 0 < len(fewer) < len(held_out) and all(p in held_out for p in fewer)
    limited = stdlib_pairs(root=tmp_path / "one", held_out_fraction=0.5, max_pairs=5)
    assert len(limited[0]) + len(limited[1]) == 6  # three modules: 2 + 2 < 5 <= 2 + 2 + 2
    first_held = stdlib_pairs(root=tmp_path / "one", held_out_fraction=0.5, max_held_out=4)
    assert first_held[1] == held_out[:4]  # two held-out modules: the fourth pair is the stop
    assert first_held[0] == train[:len(first_held[0])] and len(first_held[0]) < len(train)


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
