"""SuperOffload rollback: invert the AdamW update vs restore a saved copy vs step out of place.

Also times one fused CPU AdamW step (the cost a rollback is compared with), and zerotrain's CPU Adam
kernel in place and out of place (`step_to`: the step written into spare buffers, the current ones
untouched, so a rollback costs nothing and a commit is a swap; what super_offload does now).

    .venv/bin/python benchmarks/offload_rollback.py [--numel 50000000] [--threads 1]
"""
from __future__ import annotations

import argparse
import math
import time

import torch

LR, WD, B1, B2, EPS = 1e-3, 0.01, 0.9, 0.999, 1e-8


def timed(fn, repeat=3):
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def invert_adamw_(p, m, v, g, step):
    """Undo one torch AdamW step (step count `step` after it) in place, using the same gradient."""
    bc1, bc2 = 1 - B1 ** step, 1 - B2 ** step
    denom = (v.sqrt() / math.sqrt(bc2)).add_(EPS)
    p.addcdiv_(m, denom, value=LR / bc1).div_(1 - LR * WD)
    m.sub_(g, alpha=1 - B1).div_(B1)
    v.addcmul_(g, g, value=-(1 - B2)).div_(B2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n = args.numel
    p = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=LR, weight_decay=WD, betas=(B1, B2), eps=EPS, fused=True)
    for _ in range(3):  # warm states
        p.grad = torch.randn(n)
        opt.step()
    g = torch.randn(n)
    p.grad = g
    state = opt.state[p]

    t_step = timed(opt.step)
    # exactness of inversion: one step forward, one back
    before = [p.clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()]
    opt.step()
    invert_adamw_(p, state["exp_avg"], state["exp_avg_sq"], g, int(state["step"].item()))
    state["step"] -= 1
    names = ["param", "exp_avg", "exp_avg_sq"]
    for name, old, new in zip(names, before, [p, state["exp_avg"], state["exp_avg_sq"]]):
        diff = (old - new).abs()
        rel = (diff / old.abs().clamp_min(1e-30)).max().item()
        print(f"invert: {name:10s} bitwise-equal {torch.equal(old, new)!s:5s} max rel err {rel:.2e} "
              f"elements differing {(diff != 0).float().mean().item() * 100:.1f}%")
    backups = [torch.empty_like(t) for t in before]
    live = [p, state["exp_avg"], state["exp_avg_sq"]]

    def save():
        for b, t in zip(backups, live):
            b.copy_(t)

    def restore():
        for b, t in zip(backups, live):
            t.copy_(b)

    t_save, t_restore = timed(save), timed(restore)
    scratch = [t.clone() for t in live]  # timing only: the values are thrown away
    t_inv = timed(lambda: invert_adamw_(*scratch, g, 4))
    from zerotrain.offload.cpu_adam import CpuAdamStepper, kernel

    t_kernel = t_kernel_to = t_save_kernel = math.nan
    if kernel() is not None:
        mine = scratch[0].clone()
        own = torch.optim.AdamW([mine], lr=LR, weight_decay=WD, betas=(B1, B2), eps=EPS, fused=True)
        stepper = CpuAdamStepper(own)
        stepper.step(mine, g, 0)
        spare = tuple(torch.empty_like(mine) for _ in range(3))
        t_kernel = timed(lambda: stepper.step(mine, g, 0))
        t_kernel_to = timed(lambda: stepper.step_to(mine, g, 0, spare))
        kept = [mine, own.state[mine]["exp_avg"], own.state[mine]["exp_avg_sq"]]

        def save_then_step():
            for b, t in zip(backups, kept):
                b.copy_(t)
            stepper.step(mine, g, 0)
        t_save_kernel = timed(save_then_step)
    print(f"numel {n:,}, {args.threads} thread(s)")
    print(f"fused AdamW step          {t_step * 1e3:8.1f} ms  ({n / t_step / 1e9:.2f} Gparam/s)")
    print(f"rollback by inversion     {t_inv * 1e3:8.1f} ms  (only on rollback; not exact)")
    print(f"rollback by copy: save    {t_save * 1e3:8.1f} ms  (every speculative step)")
    print(f"rollback by copy: restore {t_restore * 1e3:8.1f} ms  (only on rollback; exact)")
    print(f"zerotrain kernel in place           {t_kernel * 1e3:8.1f} ms")
    print(f"zerotrain kernel, save + step       {t_save_kernel * 1e3:8.1f} ms  (speculative step before)")
    print(f"zerotrain kernel out of place       {t_kernel_to * 1e3:8.1f} ms  (speculative step now; rollback free)")


if __name__ == "__main__":
    main()
