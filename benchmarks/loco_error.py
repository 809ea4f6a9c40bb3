"""Accumulated 4-bit compression error with and without LoCo along one exact training run.

Trains the package's small GPT (`zerotrain.models.GPT`, preset "tiny") in one process with
exact gradients (AdamW, the stdlib text corpus, fixed seed: fully deterministic). At every
step the flat gradient g_t is also compressed — never used for the update — in three ways:

- int8: deQ(Q8(g_t)), blockwise, one fp32 scale per block;
- int4: deQ(Q4(g_t));
- int4 + LoCo: c_t = g_t + e_t, ĝ_t = deQ(Q4(c_t)), e_{t+1} = β·e_t + (1 − β)(c_t − ĝ_t), with e
  stored in 8 bits — exactly `zerotrain.comm.compressed.ErrorFeedback`, the code qgZ runs.

and reports, after T steps, the accumulated error ‖Σ_t (ĝ_t − g_t)‖ (absolute) and relative to
‖Σ_t g_t‖, next to LoCo's bound ‖e_0 − e_T‖/(1 − β) (Σ_t (ĝ_t − g_t) = (e_0 − e_T)/(1 − β) exactly
when e is stored exactly; the 8-bit storage adds a small drift).

    .venv/bin/python benchmarks/loco_error.py                  # T = 10, 100, 1000 (~1 min)
    .venv/bin/python benchmarks/loco_error.py --steps 10,100 --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import time
from typing import Sequence

import torch

from zerotrain.comm.compressed import ErrorFeedback
from zerotrain.comm.quant import quantize_rows
from zerotrain.data.corpus import load_stdlib_corpus
from zerotrain.models import GPT, GPTConfig


def accumulated_errors(checkpoints: Sequence[int] = (10, 100, 1000), beta: float = 0.8, block_size: int = 256,
                       batch: int = 8, seed: int = 0, preset: str = "tiny", lr: float = 1e-3) -> list[dict]:
    """One row per T in `checkpoints`: absolute and relative accumulated error per mode."""
    torch.manual_seed(seed)
    config = GPTConfig.preset(preset)
    model = GPT(config)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    tokens = load_stdlib_corpus(max_bytes=2 * 1024 * 1024)
    generator = torch.Generator().manual_seed(seed)
    numel = sum(p.numel() for p in params)
    feedback = ErrorFeedback(1, numel, beta, block_size)
    sum_g = torch.zeros(numel, dtype=torch.float64)
    sums = {mode: torch.zeros(numel, dtype=torch.float64) for mode in ("int8", "int4", "int4_loco")}
    rows, wanted = [], set(checkpoints)
    for step in range(1, max(checkpoints) + 1):
        starts = torch.randint(0, tokens.numel() - config.block_size - 1, (batch,), generator=generator)
        window = torch.stack([tokens[s:s + config.block_size + 1] for s in starts.tolist()]).long()
        _, loss = model(window[:, :-1], window[:, 1:])
        loss.backward()
        g = torch.cat([p.grad.reshape(-1) for p in params]).reshape(1, -1)
        sum_g += g[0].double()
        sums["int8"] += (quantize_rows(g, 8, block_size).dequantize() - g)[0].double()
        sums["int4"] += (quantize_rows(g, 4, block_size).dequantize() - g)[0].double()
        compensated, error = feedback.compensate(g)
        decompressed = quantize_rows(compensated, 4, block_size).dequantize()
        feedback.update(compensated, decompressed, error)
        sums["int4_loco"] += (decompressed - g)[0].double()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step in wanted:
            total = sum_g.norm().item()
            e_norm = feedback.error().norm().item()
            row = {"T": step, "loss": loss.item(), "sum_g_norm": total, "e_norm": e_norm,
                   "loco_bound": e_norm / (1 - beta)}
            for mode, acc in sums.items():
                row[f"{mode}_abs"] = acc.norm().item()
                row[f"{mode}_rel"] = acc.norm().item() / total
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="10,100,1000", help="comma-separated T values")
    parser.add_argument("--beta", type=float, default=0.8)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    checkpoints = sorted(int(s) for s in args.steps.split(","))
    started = time.perf_counter()
    rows = accumulated_errors(checkpoints, args.beta, args.block, args.batch, args.seed)
    print(f"# tiny GPT, AdamW lr 1e-3, batch {args.batch}x32 bytes, block {args.block}, beta {args.beta}, "
          f"seed {args.seed}; {time.perf_counter() - started:.0f} s")
    print("| T | ‖Σg‖ | int8 abs | int8 rel | int4 abs | int4 rel | int4+LoCo abs | int4+LoCo rel | ‖e_T‖/(1−β) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['sum_g_norm']:.3g} | {r['int8_abs']:.3g} | {r['int8_rel']:.2e} | {r['int4_abs']:.3g} | "
              f"{r['int4_rel']:.2e} | {r['int4_loco_abs']:.3g} | {r['int4_loco_rel']:.2e} | {r['loco_bound']:.3g} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    if not all(math.isfinite(r["int4_loco_abs"]) for r in rows):
        raise SystemExit("non-finite error")


if __name__ == "__main__":
    main()
