"""Shared pieces of the offload tests: a two-group OddMLP run on the engine and its single-process reference."""
from __future__ import annotations

import contextlib
import os

import torch

from models_for_tests import OddMLP, make_batches, micro_slice

STEPS, MICRO, ACCUMULATION, CLIP = 6, 2, 2, 1.0  # with CLIP 1.0, clipping fires on steps 0, 2 and 4
GROUPS = [{"lr": 1e-2, "weight_decay": 0.01}, {"lr": 5e-3, "weight_decay": 0.1}]


def param_groups(model: OddMLP) -> list[dict]:
    return [dict(params=list(model.fc1.parameters()), **GROUPS[0]),
            dict(params=list(model.fc2.parameters()), **GROUPS[1])]


def engine_config(stage: int, offload: dict | None, precision: str = "fp32") -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 40}  # three buckets, two groups
    if offload is not None:
        zero["offload_optimizer"] = offload
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8, "hysteresis": 1},
        "steps_per_print": 0,
    }


def build_engine(stage: int, offload: dict | None, precision: str = "fp32"):
    import zerotrain

    torch.manual_seed(0)
    model = OddMLP()
    engine, _, _, _ = zerotrain.initialize(model=model, model_parameters=param_groups(model),
                                           config=engine_config(stage, offload, precision))
    return engine


def world_batches(world: int, steps: int = STEPS):
    return make_batches(steps, MICRO * ACCUMULATION * world)


def train_steps(engine, batches, inject=None, on_step=None) -> tuple[list[float], list[float]]:
    """Train on this rank's slices; returns mean losses and global grad norms per step.

    `inject(step, loss)` may return a replacement loss to backpropagate; `on_step(step)` runs after each step.
    """
    import torch.distributed as dist

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    losses, norms = [], []
    for step, batch in enumerate(batches):
        total = torch.zeros(1)
        for a in range(ACCUMULATION):
            x, y = micro_slice(batch, a, rank, world, MICRO)
            loss = engine(x.to(engine.dtype), y.to(engine.dtype))
            backward_loss = inject(step, loss) if inject is not None else None
            engine.backward(loss if backward_loss is None else backward_loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (ACCUMULATION * world))
        norms.append(engine.get_global_grad_norm())
        if on_step is not None:
            on_step(step)
    return losses, norms


def reference_training(batches) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process AdamW with the two groups and clipping, on whole global batches."""
    torch.manual_seed(0)
    model = OddMLP()
    optimizer = torch.optim.AdamW(param_groups(model))
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_matches_reference(what: str, losses, weights, ref_losses, ref_weights) -> None:
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    assert rel <= 1e-5, f"{what}: losses {losses} vs reference {ref_losses} (max rel {rel:.2e})"
    assert set(weights) == set(ref_weights), what
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}, {name}: {m}")


def snapshot(engine) -> dict:
    """Masters, per-element and scalar optimizer states, and model shards of this rank (clones)."""
    opt = engine.zero_optimizer
    resident = getattr(opt, "resident_states", None)
    with resident(write_back=False) if resident is not None else contextlib.nullcontext():
        states = _states(opt)  # NVMe: masters and states are in host memory only in here
        masters = [m.detach().clone() for m in opt.masters]
    return {"masters": masters, "states": states,
            "model": [b.local_shard().detach().clone() for b in engine.buckets]}


def _states(opt) -> list[dict]:
    return [{k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in opt.optimizer.state.get(m, {}).items()}
            for m in opt.masters]


def assert_same_snapshot(a: dict, b: dict, what: str) -> None:
    for kind in ("masters", "model"):
        for i, (x, y) in enumerate(zip(a[kind], b[kind])):
            assert torch.equal(x, y), f"{what}: {kind}[{i}] changed"
    assert len(a["states"]) == len(b["states"])
    for i, (x, y) in enumerate(zip(a["states"], b["states"])):
        assert set(x) == set(y), f"{what}: state keys of master {i}: {sorted(x)} vs {sorted(y)}"
        for key in x:
            assert torch.equal(torch.as_tensor(x[key]), torch.as_tensor(y[key])), f"{what}: state {key} of master {i}"
