"""Stochastic rounding of fp32 to bf16: how NVMe offload stores bf16 masters and optimizer states
(`bf16.bf16_master_weights_and_grads`, `bf16.bf16_optimizer_states`) without stalling.

Why not round to nearest: an Adam update is often smaller than half a bf16 step of the weight it changes
(bf16 keeps 8 significant bits: a weight of 0.02 moves in steps of ~1.2e-4, an update at lr 1e-4 is ~1e-4),
and Adam's second moment decays by `beta2` = 0.999 per step, a relative change of 1e-3 below bf16's
half-step of 2e-3: rounded to nearest, both come back unchanged and training stalls
(`benchmarks/bf16_states.py` measures it). Rounded stochastically (up with the probability of the distance
from the bf16 value below), the stored value is right in expectation and the small changes add up. Kahan
compensation would do it too but stores a second bf16 tensor per state (2 more bytes per parameter on disk,
the thing these keys save); stochastic rounding stores nothing extra.

The noise is a counter-based hash of (seed, element index) (`cpu_adam.c`'s `zt_round_bf16`), so a step
rounds the same way when it is repeated (the NVMe step's retry after a failed write, a resumed run at the
same optimizer step). Without the C kernel, torch's generator seeded with `seed` gives other (equally
deterministic) noise.
"""
from __future__ import annotations

import torch

from .cpu_adam import kernel

__all__ = ["round_bf16_", "rounding_seed"]

_MASK = (1 << 64) - 1


def rounding_seed(*parts: int) -> int:
    """A 64-bit seed from integers (rank, bucket, chunk, step, which tensor): distinct tuples, distinct seeds."""
    seed = 0x6A09E667F3BCC908
    for part in parts:
        seed = ((seed ^ (int(part) & _MASK)) * 0x100000001B3) & _MASK
        seed ^= seed >> 29
    return seed


def round_bf16_(source: torch.Tensor, out: torch.Tensor, seed: int) -> torch.Tensor:
    """Write `source` (contiguous fp32, CPU) into `out` (bf16, as many elements) rounded stochastically with
    the noise of `seed`; returns `out`. `source` is not changed."""
    if source.dtype != torch.float32 or out.dtype != torch.bfloat16 or source.numel() != out.numel() \
            or not source.is_contiguous() or not out.is_contiguous() or source.device.type != "cpu":
        raise ValueError("round_bf16_: a contiguous fp32 CPU source and a bf16 out of as many elements")
    lib = kernel()
    if lib is not None:
        lib.zt_round_bf16(source.data_ptr(), out.data_ptr(), source.numel(), seed & _MASK)
        return out
    generator = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    noise = torch.randint(0, 1 << 16, source.shape, dtype=torch.int32, generator=generator)
    bits = source.view(torch.int32) + noise
    rounded = bits.bitwise_and_(-65536).view(torch.float32)
    finite = torch.isfinite(source)
    out.copy_(torch.where(finite, rounded, source))
    return out
