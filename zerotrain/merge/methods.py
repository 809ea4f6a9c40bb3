"""The merge methods: pure functions from fp32 tensors to one fp32 tensor.

Semantics follow mergekit (read from its source, re-implemented here) so that configs
carry over:

- `linear`: sum_i w_i x_i, divided by sum_i w_i when `normalize` (default on).
- task vectors: d_i = x_i - base. `task_arithmetic`: base + lambda * sum_i w_i d_i
  (normalize off by default). `ties`: each d_i keeps its top `density` fraction by
  magnitude, then a sign is elected per element (`consensus` "sum": sign of
  sum_i w_i d_i; "count": the sign most of the w_i d_i have, ties go to +), only the
  weighted deltas agreeing with it are summed, divided by the sum of the agreeing
  weights when `normalize` (default on for TIES). `dare_linear` / `dare_ties`: each d_i
  keeps each element with probability `density` (a seeded Bernoulli mask) and is
  rescaled by 1/density (`rescale`, default on), then summed as task_arithmetic / TIES.
- `slerp`: spherical interpolation at `t` between base (t=0) and the other model
  (t=1), angle taken between the flattened, normalised tensors; when they are almost
  colinear (|cos| > 0.9995) it falls back to linear interpolation.

All inputs arrive in fp32 (the caller casts); every function returns a new tensor.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

SLERP_DOT_THRESHOLD = 0.9995
SLERP_EPS = 1e-8
_SLERP_CHUNK = 1 << 20  # elements per float64 partial sum in slerp


def linear(tensors: Sequence[torch.Tensor], weights: Sequence[float], normalize: bool = True) -> torch.Tensor:
    """Weighted sum of the tensors, divided by the sum of the weights when `normalize`."""
    out = torch.zeros_like(tensors[0])
    for tensor, weight in zip(tensors, weights):  # accumulated in place: one extra tensor, not a stack
        out.add_(tensor, alpha=float(weight))
    if normalize:
        total = float(sum(float(x) for x in weights))
        if abs(total) > 1e-8:  # mergekit leaves a zero-sum weighting unnormalised
            out /= total
    return out


def magnitude_prune(delta: torch.Tensor, density: float) -> torch.Tensor:
    """`delta` with all but its largest-magnitude `density` fraction of elements zeroed (TIES' trim step)."""
    if density >= 1:
        return delta
    if density <= 0 or delta.numel() == 0:
        return torch.zeros_like(delta)
    k = max(1, int(density * delta.numel()))  # a positive density keeps at least one element (as mergekit)
    keep = torch.topk(delta.abs().reshape(-1), k, sorted=False).indices
    mask = torch.ones(delta.numel(), dtype=torch.bool)
    mask[keep] = False
    del keep
    return delta.masked_fill(mask.reshape(delta.shape), 0)


def bernoulli_mask(shape: Sequence[int], density: float, generator: torch.Generator) -> torch.Tensor:
    """DARE's random keep mask: each element kept with probability `density` (bool)."""
    return torch.rand(tuple(shape), generator=generator) < density


def dare_drop(delta: torch.Tensor, density: float, mask: torch.Tensor, rescale: bool = True) -> torch.Tensor:
    """DARE's drop-and-rescale of one task vector with a given keep `mask`."""
    if density >= 1:
        return delta
    out = delta * mask
    if rescale:
        out /= density
    return out


def task_vector_merge(base: torch.Tensor, deltas: list, weights: Sequence[float],
                      consensus: Optional[str], normalize: bool, lam: float = 1.0) -> torch.Tensor:
    """base + lam * combine(w_i d_i): the common last step of task_arithmetic, TIES and DARE.

    `deltas` are already trimmed (TIES) or dropped (DARE). With a `consensus`, only the
    weighted deltas agreeing with the elected sign count, and the divisor is the sum of
    their weights (1 where none agrees). The deltas are scaled in place and the sums are
    accumulated one delta at a time (no stacked copies), so the working set is the
    deltas plus a handful of tensors of one input's size.
    """
    ws = [float(w) for w in weights]
    weighted = [d.mul_(w) for d, w in zip(deltas, ws)]  # in place: the caller hands the deltas over
    if consensus:
        if consensus == "sum":
            vote = torch.zeros_like(base)
            for wd in weighted:
                vote += wd
        elif consensus == "count":
            vote = torch.zeros_like(base)
            for wd in weighted:
                vote += wd.sign()
        else:
            raise ValueError(f"unknown sign consensus {consensus!r} (use 'sum' or 'count')")
        positive = vote >= 0  # the elected sign; ties go to +
        del vote
        mixed = torch.zeros_like(base)
        divisor = torch.zeros_like(base)
        for wd, w in zip(weighted, ws):
            agree = torch.where(positive, wd > 0, wd < 0)  # a zero delta agrees with neither sign
            mixed += wd.masked_fill_(~agree, 0)
            divisor.add_(agree, alpha=w)
        del positive
        divisor[divisor == 0] = 1
    else:
        mixed = torch.zeros_like(base)
        for wd in weighted:
            mixed += wd
        total = sum(ws)
        divisor = torch.full_like(base, 1.0 if abs(total) < 1e-8 else total)
    weighted.clear()
    if normalize:
        mixed /= divisor
    del divisor
    if lam != 1:
        mixed *= lam
    return mixed.add_(base)


def slerp(t: float, v0: torch.Tensor, v1: torch.Tensor, dot_threshold: float = SLERP_DOT_THRESHOLD,
          eps: float = SLERP_EPS) -> torch.Tensor:
    """Spherical interpolation from v0 (t=0) to v1 (t=1); linear when the two are nearly colinear.

    The angle comes from float64 sums taken over chunks, so no full-size float64 or normalised copy is
    ever made: the result is the only full-size allocation (mergekit normalises whole copies).
    """
    a, b = v0.reshape(-1), v1.reshape(-1)
    aa = bb = ab = 0.0
    for ca, cb in zip(a.split(_SLERP_CHUNK), b.split(_SLERP_CHUNK)):
        ca, cb = ca.double(), cb.double()
        aa += float(torch.dot(ca, ca))
        bb += float(torch.dot(cb, cb))
        ab += float(torch.dot(ca, cb))
    na, nb = math.sqrt(aa), math.sqrt(bb)
    # as mergekit: a vector is normalised only when its norm exceeds eps
    dot = ab / ((na if na > eps else 1.0) * (nb if nb > eps else 1.0))
    if abs(dot) > dot_threshold:
        return torch.lerp(v0, v1, t)
    theta = math.acos(max(-1.0, min(1.0, dot)))
    sin_theta = math.sin(theta)
    s0 = math.sin(theta - theta * t) / sin_theta
    s1 = math.sin(theta * t) / sin_theta
    return torch.mul(v0, s0).add_(v1, alpha=s1)
