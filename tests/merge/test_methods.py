"""Each merge method against a direct computation (numpy, float64, element by element) on small tensors."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zerotrain.merge import methods

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)
counts = st.integers(1, 3)
dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])
weights_st = st.floats(0.1, 2.0)
SETTINGS = settings(max_examples=12, deadline=None)


def _inputs(seed: int, shape: tuple, count: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Tensors in `dtype` (the source dtype), cast to fp32 as the merge does."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype).float() for _ in range(count)]


def _close(actual: torch.Tensor, expected: np.ndarray) -> None:
    np.testing.assert_allclose(actual.double().numpy(), expected, rtol=1e-5, atol=1e-6)


@SETTINGS
@given(shape=shapes, count=counts, dtype=dtypes, seed=st.integers(0, 999), normalize=st.booleans(),
       data=st.data())
def test_linear(shape, count, dtype, seed, normalize, data):
    xs = _inputs(seed, shape, count, dtype)
    ws = [data.draw(weights_st) for _ in range(count)]
    expected = sum(w * x.double().numpy() for w, x in zip(ws, xs))
    if normalize:
        expected = expected / sum(ws)
    _close(methods.linear(xs, ws, normalize=normalize), expected)


def _direct_task_merge(base, deltas, ws, consensus, normalize, lam):
    """Element by element: elect a sign, sum the agreeing weighted deltas, divide by their weights."""
    base = base.double().numpy()
    d = [x.double().numpy() for x in deltas]
    out = np.empty_like(base)
    for idx in np.ndindex(base.shape):
        weighted = [w * di[idx] for w, di in zip(ws, d)]
        if consensus is None:
            keep = [True] * len(ws)
        else:
            if consensus == "sum":
                elected = 1.0 if sum(weighted) >= 0 else -1.0
            else:
                elected = 1.0 if sum(np.sign(v) for v in weighted) >= 0 else -1.0
            keep = [np.sign(v) == elected for v in weighted]
        total = sum(v for v, k in zip(weighted, keep) if k)
        divisor = sum(w for w, k in zip(ws, keep) if k)
        if consensus is None and abs(divisor) < 1e-8 or consensus is not None and divisor == 0:
            divisor = 1.0
        out[idx] = base[idx] + lam * (total / divisor if normalize else total)
    return out


@SETTINGS
@given(shape=shapes, count=counts, dtype=dtypes, seed=st.integers(0, 999), normalize=st.booleans(),
       lam=st.floats(0.2, 1.5), data=st.data())
def test_task_arithmetic(shape, count, dtype, seed, normalize, lam, data):
    base, *xs = _inputs(seed, shape, count + 1, dtype)
    ws = [data.draw(weights_st) for _ in range(count)]
    deltas = [x - base for x in xs]
    got = methods.task_vector_merge(base, [d.clone() for d in deltas], ws, consensus=None, normalize=normalize, lam=lam)
    _close(got, _direct_task_merge(base, deltas, ws, None, normalize, lam))


def _direct_prune(delta: torch.Tensor, density: float) -> np.ndarray:
    flat = delta.double().numpy().reshape(-1).copy()
    k = max(1, int(density * flat.size))
    order = np.argsort(-np.abs(flat), kind="stable")
    flat[order[k:]] = 0.0
    return flat.reshape(delta.shape)


@SETTINGS
@given(shape=shapes, count=st.integers(2, 3), seed=st.integers(0, 999), density=st.floats(0.3, 1.0),
       consensus=st.sampled_from(["sum", "count"]), normalize=st.booleans(), data=st.data())
def test_ties(shape, count, seed, density, consensus, normalize, data):
    base, *xs = _inputs(seed, shape, count + 1, torch.float32)
    ws = [data.draw(weights_st) for _ in range(count)]
    pruned = [methods.magnitude_prune(x - base, density) for x in xs]
    for x, p in zip(xs, pruned):  # the trim step: exactly the top-k magnitudes survive
        np.testing.assert_array_equal(p.double().numpy(), _direct_prune(x - base, density))
    got = methods.task_vector_merge(base, [p.clone() for p in pruned], ws, consensus=consensus, normalize=normalize)
    _close(got, _direct_task_merge(base, pruned, ws, consensus, normalize, 1.0))


@SETTINGS
@given(shape=shapes, count=counts, seed=st.integers(0, 999), density=st.floats(0.2, 0.9), rescale=st.booleans())
def test_dare_with_injected_masks(shape, count, seed, density, rescale):
    base, *xs = _inputs(seed, shape, count + 1, torch.float32)
    g = torch.Generator().manual_seed(seed)
    masks = [methods.bernoulli_mask(shape, density, g) for _ in xs]
    dropped = [methods.dare_drop(x - base, density, m, rescale=rescale) for x, m in zip(xs, masks)]
    for x, m, d in zip(xs, masks, dropped):
        expected = np.where(m.numpy(), (x - base).double().numpy(), 0.0) / (density if rescale else 1.0)
        _close(d, expected)


def test_dare_mask_keeps_density_fraction():
    g = torch.Generator().manual_seed(0)
    mask = methods.bernoulli_mask((200_000,), 0.3, g)
    # binomial: 6 standard deviations is ~0.006 of the fraction
    assert abs(mask.float().mean().item() - 0.3) < 0.006


@SETTINGS
@given(shape=shapes, seed=st.integers(0, 999), t=st.floats(0.0, 1.0), dtype=dtypes)
# one element each, of opposite signs (seed 0: 1.54 and -0.29): colinear pointing opposite ways, cos = -1
@example(shape=(1,), seed=0, t=0.25, dtype=torch.float32)
def test_slerp(shape, seed, t, dtype):
    a, b = _inputs(seed, shape, 2, dtype)
    a64, b64 = a.double().numpy(), b.double().numpy()
    na, nb = np.linalg.norm(a64), np.linalg.norm(b64)
    cos = float(np.sum((a64 / na) * (b64 / nb)))
    if abs(cos) > 0.9995:
        expected = (1 - t) * a64 + t * b64
    else:
        theta = math.acos(cos)
        expected = (math.sin((1 - t) * theta) * a64 + math.sin(t * theta) * b64) / math.sin(theta)
    _close(methods.slerp(t, a, b), expected)


def test_slerp_colinear_falls_back_to_lerp():
    a = torch.randn(50)
    b = 2 * a + 1e-6 * torch.randn(50)
    _close(methods.slerp(0.25, a, b), (0.75 * a + 0.25 * b).double().numpy())
    # the fallback is what the check can catch: spherical interpolation of 2a from a is not 0.75a + 0.25*2a
    c = torch.randn(50)
    assert not torch.allclose(methods.slerp(0.25, a, c), 0.75 * a + 0.25 * c, atol=1e-3)
    # pointing opposite ways is colinear too (|cos| > threshold): the angle is pi, its sine ~0, no spherical path
    d = -2 * a + 1e-6 * torch.randn(50)
    _close(methods.slerp(0.25, a, d), (0.75 * a + 0.25 * d).double().numpy())


def test_density_edges_and_defaults():
    """Density 1 (or more) keeps the task vector whole; 0 drops all of it; the defaults are mergekit's (linear is a
    weighted mean, DARE rescales the kept elements by 1 / density)."""
    g = torch.Generator().manual_seed(3)
    delta = torch.randn(4, 5, generator=g)
    for density in (1.0, 1.5):
        assert torch.equal(methods.magnitude_prune(delta, density), delta)
        assert torch.equal(methods.dare_drop(delta, density, torch.zeros(4, 5, dtype=torch.bool), rescale=True), delta)
    assert torch.equal(methods.magnitude_prune(delta, 0.0), torch.zeros_like(delta))
    assert methods.magnitude_prune(torch.empty(0), 0.5).numel() == 0
    mask = methods.bernoulli_mask((4, 5), 0.5, g)
    torch.testing.assert_close(methods.dare_drop(delta, 0.5, mask), delta * mask / 0.5)  # rescales by default
    a, b = torch.randn(3, generator=g), torch.randn(3, generator=g)
    _close(methods.linear([a, b], [1.0, 3.0]), ((a + 3 * b) / 4).double().numpy())


def test_bad_consensus_is_an_error_small_density_keeps_one():
    with pytest.raises(ValueError, match="consensus"):
        methods.task_vector_merge(torch.ones(3), [torch.ones(3)], [1.0], "median", normalize=True)
    kept = methods.magnitude_prune(torch.tensor([1.0, -3.0, 2.0]), 0.1)  # keeps at least one element
    assert kept.tolist() == [0.0, -3.0, 0.0]


def test_the_default_shard_size_is_5gb_as_transformers_and_mergekit_count_it():
    """`--shard-size` says "default 5GB": 5e9 bytes, the size save_pretrained's "5GB" and mergekit's "5B" mean."""
    from transformers.utils.hub import convert_file_size_to_int

    from zerotrain.merge.recipe import ModelSpec, Recipe, parse_size

    recipe = Recipe(method="linear", models=[ModelSpec("a"), ModelSpec("b")])
    assert recipe.shard_size == parse_size("5GB") == convert_file_size_to_int("5GB") == 5_000_000_000
    assert parse_size("5GiB") == 5 * 1024 ** 3
