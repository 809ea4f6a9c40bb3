"""Stages 0-2 reproduce single-process AdamW: losses and weights, every world size and accumulation."""
from __future__ import annotations

import os

import pytest
import torch

from distributed import run_distributed
from models_for_tests import OddMLP, make_batches, reference_training, train_global_step

STEPS, MICRO, LR = 5, 2, 1e-2


def engine_config(stage: int, accumulation: int, world: int, clip: float = 1.0, precision: str = "fp32") -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40},  # several buckets, params split across them
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 0,
    }


def train_with_engine(combos: list[tuple[int, int]], clip: float = 1.0, precision: str = "fp32") -> list:
    """On each rank: train OddMLP for every (stage, accumulation); return per-step mean losses and weights."""
    import zerotrain

    world = int(os.environ["WORLD_SIZE"])
    results = []
    for stage, accumulation in combos:
        torch.manual_seed(0)
        engine, _, _, _ = zerotrain.initialize(model=OddMLP(), config=engine_config(stage, accumulation, world, clip, precision))
        step_losses, norms = [], []
        for batch in make_batches(STEPS, MICRO * accumulation * world):
            step_losses.append(train_global_step(engine, batch, MICRO))
            norms.append(engine.get_global_grad_norm())
        assert engine.global_steps == STEPS
        assert engine.global_samples == STEPS * MICRO * accumulation * world
        results.append((stage, accumulation, step_losses, engine.full_state_dict(), norms))
    return results


COMBOS = [(stage, accumulation) for stage in (0, 1, 2) for accumulation in (1, 2)]


def reference_batches_for(world: int, accumulation: int):
    return make_batches(STEPS, MICRO * accumulation * world)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_stages_match_single_process(world):
    results = run_distributed(train_with_engine, world, COMBOS)[0]
    for stage, accumulation, losses, weights, norms in results:
        ref_norms: list[float] = []
        ref_losses, ref_weights = reference_training(OddMLP, reference_batches_for(world, accumulation), lr=LR,
                                                     norms=ref_norms)
        what = f"world {world}, stage {stage}, accumulation {accumulation}"
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        assert rel <= 1e-5, f"{what}: losses {losses} vs reference {ref_losses} (max rel {rel:.2e})"
        assert norms == pytest.approx(ref_norms, rel=1e-5), f"{what}: gradient norms (what clipping divides by)"
        assert set(weights) == set(ref_weights), what
        for name, ref in ref_weights.items():
            torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}, {name}: {m}")
