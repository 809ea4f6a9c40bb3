"""LoCo keeps the accumulated 4-bit compression error bounded; without feedback it grows with T.

Runs the core of `benchmarks/loco_error.py` (a real, deterministic training trajectory of the
tiny GPT) for fewer steps, and the same comparison on a synthetic gradient stream.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from zerotrain.comm.compressed import ErrorFeedback
from zerotrain.comm.quant import quantize_rows

BENCHMARK = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "loco_error.py")


def _benchmark():
    spec = importlib.util.spec_from_file_location("loco_error_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_accumulated_error_along_gpt_training():
    torch.set_num_threads(1)
    rows = _benchmark().accumulated_errors((10, 100, 400), batch=4)
    first, middle, last = rows
    # Plain int4: the error adds up, absolutely and relative to the summed gradient.
    assert last["int4_abs"] > 4 * first["int4_abs"], rows
    assert last["int4_rel"] > 1.3 * middle["int4_rel"], rows
    for row in rows:
        # LoCo: Σ(ĝ − g) = (e_0 − e_T)/(1 − β), up to the 8-bit storage of e.
        assert row["int4_loco_abs"] <= 1.1 * row["loco_bound"] + 0.05, row
    assert last["int4_loco_abs"] < 2 * first["int4_loco_abs"], rows
    assert last["int4_loco_abs"] < last["int4_abs"] / 5, rows
    assert last["int4_loco_rel"] < middle["int4_rel"] / 3, rows


def test_bounded_on_a_synthetic_stream():
    """A slowly drifting gradient (as in training): round-to-nearest errors are correlated step to step."""
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(1, 4096, generator=generator)
    beta = 0.8
    feedback = ErrorFeedback(1, 4096, beta, 256)
    plain = torch.zeros(1, 4096, dtype=torch.float64)
    loco = torch.zeros(1, 4096, dtype=torch.float64)
    history = {}
    for t in range(1, 301):
        g = base * (1 + 0.2 * torch.sin(torch.tensor(t / 17.0))) + 0.1 * torch.randn(1, 4096, generator=generator)
        plain += (quantize_rows(g, 4, 256).dequantize() - g).double()
        c, e = feedback.compensate(g)
        q = quantize_rows(c, 4, 256).dequantize()
        feedback.update(c, q, e)
        loco += (q - g).double()
        if t in (10, 300):
            history[t] = (plain.norm().item(), loco.norm().item(), feedback.error().norm().item() / (1 - beta))
    (plain_10, loco_10, _), (plain_300, loco_300, bound_300) = history[10], history[300]
    assert plain_300 > 10 * plain_10, history
    assert loco_300 < 2 * loco_10 and loco_300 <= 1.1 * bound_300 + 0.05, history
