"""Do bf16 masters and Adam states stall training, and does stochastic rounding fix it? (issue #27)

`bf16.bf16_master_weights_and_grads` + `bf16.bf16_optimizer_states` store the NVMe records in bf16 (6 bytes per
parameter instead of 12). This measures what that storage does to training, with the NVMe path's arithmetic on
one process: the records are read into fp32, stepped by torch's fused AdamW, and stored back in bf16, either
rounded to nearest or stochastically (`zerotrain.offload.stochastic_round.round_bf16_`, what the offload uses);
the model computes with the bf16 weights in every mode (the training dtype). A small GPT (2 x 64, vocabulary
256) memorizes 64 random sequences of 64 tokens, batch 16, for `--steps` steps at each `--lr`, one thread.

    python benchmarks/bf16_states.py --steps 300 --lr 1e-4 3e-4 1e-3 [--json out.json]

Printed: the loss at a few steps and the final one per mode, and the final loss's drop relative to fp32's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zerotrain.models.gpt import GPT, GPTConfig  # noqa: E402
from zerotrain.offload.stochastic_round import round_bf16_, rounding_seed  # noqa: E402

MODES = ("fp32", "bf16 nearest", "bf16 stochastic", "bf16 master stochastic, states nearest")


def train(mode: str, lr: float, steps: int, seed: int = 0) -> list[float]:
    """Losses per step of one mode."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_embd=64, block_size=64))
    data = torch.randint(0, 256, (64, 65), generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters()]
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    optimizer = torch.optim.AdamW(masters, lr=lr, weight_decay=0.0, fused=True)
    stored = [m.detach().to(torch.bfloat16) for m in masters]
    with torch.no_grad():
        for p, s in zip(params, stored):
            p.copy_(s)  # the model computes with bf16 weights in every mode
    losses = []
    for step in range(steps):
        batch = data[torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(1000 + step))]
        _, loss = model(batch[:, :-1], batch[:, 1:])
        model.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(float(loss.detach()))
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for index, (m, p) in enumerate(zip(masters, params)):
                state = optimizer.state[m]
                tensors = [("master", m.data)] + [(k, state[k]) for k in ("exp_avg", "exp_avg_sq")]
                for which, (name, tensor) in enumerate(tensors):
                    if mode == "fp32":
                        continue
                    flat = tensor.view(-1)
                    out = torch.empty_like(flat, dtype=torch.bfloat16)
                    stochastic = mode == "bf16 stochastic" or (mode.startswith("bf16 master") and name == "master")
                    if stochastic:
                        round_bf16_(flat.contiguous(), out, rounding_seed(index, step, which))
                    else:
                        out.copy_(flat)
                    flat.copy_(out)  # what a record stores: the next step reads it back
                p.copy_(m.data)  # bf16 model weights (fp32 masters: rounded to nearest, as a publish)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    marks = [0, args.steps // 4, args.steps // 2, args.steps - 1]
    for lr in args.lr:
        print(f"lr {lr:g}")
        base = None
        for mode in MODES:
            start = time.perf_counter()
            losses = train(mode, lr, args.steps)
            final = sum(losses[-10:]) / 10  # the mean of the last 10 steps: less noise than one batch
            base = final if mode == "fp32" else base
            drop = (losses[0] - final) / (losses[0] - base)
            results[f"{mode} @ lr {lr:g}"] = {"losses": losses, "final": final, "drop_vs_fp32": drop}
            shown = ", ".join(f"{m}: {losses[m]:.4f}" for m in marks)
            print(f"  {mode:40s} {shown}; last-10 mean {final:.4f}; loss drop {drop:.2f}x fp32's "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle)


if __name__ == "__main__":
    main()
