"""Split experts at ZeRO stage 3 in bf16, in fp16 with dynamic loss scaling, and with super_offload.

World 4, ep_size 2: ranks {0, 2} and {1, 3} hold the same two of the four experts, partitioned over
each pair. bf16 and fp16 (fp32 masters) stay within 2% of the fp32 single-process losses (the tolerance
of the other bf16 expert tests); an inf injected into rank 1's expert gradient shard only skips the
step on every rank and leaves every weight untouched. super_offload ("always" speculation, clipping
firing on step 1) at stage 3 matches one process within 1e-5. One spawned run does all of it.
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from models_for_tests import micro_slice, train_global_step
from models_for_tests import assert_tolerance_discriminates
from moe_common import CLIP, MICRO, STEPS, assert_matches, batches, build_engine, do_nothing, reference

ZERO3 = {"stage3_param_persistence_threshold": 0}
PRECISIONS = [("bf16", {"bf16": {"enabled": True}}),
              ("fp16", {"fp16": {"enabled": True, "initial_scale_power": 8}})]
LOSS_TOL, WEIGHT_TOL = 4e-3, 2e-2  # bf16/fp16 against fp32, with the do-nothing baseline outside by 2x
SUPER_OFFLOAD = {"device": "cpu", "super_offload": True, "super_offload_speculation": "always"}


def overflow_in_rank_1s_experts() -> tuple[int, bool, float, float]:
    """One fp16 global step with rank 1's expert gradient shard set to inf before the step: (skipped steps,
    whether every whole weight is unchanged (rank 0), loss scale before and after)."""
    import torch.distributed as dist

    engine = build_engine(3, 2, top={"fp16": {"enabled": True, "initial_scale_power": 4, "hysteresis": 1}}, **ZERO3)
    before = engine.full_state_dict()
    world, rank = dist.get_world_size(), dist.get_rank()
    accumulation = engine.gradient_accumulation_steps()
    scale_before = engine.loss_scaler.scale
    for index in range(accumulation):
        x, y = micro_slice(batches()[0], index, rank, world, MICRO)
        engine.backward(engine(x.half(), y.half()))
        if index == accumulation - 1 and rank == 1:
            expert = next(part.index for part in engine.buckets if part.group.expert)
            shard = engine.reducer.grad_shards[expert]
            assert shard is not None and shard.numel() > 0, "rank 1 holds no shard of its first expert part"
            shard[0] = float("inf")
        engine.step()
    after = engine.full_state_dict()
    unchanged = all(torch.equal(before[name], after[name]) for name in before)
    result = (engine.skipped_steps, unchanged, scale_before, engine.loss_scaler.scale)
    engine.close()
    return result


def train_all() -> dict:
    """Every mode from scratch at stage 3, ep_size 2; returns what the test compares."""
    out = {}
    for what, top in PRECISIONS:
        engine = build_engine(3, 2, top=top, **ZERO3)
        losses = [train_global_step(engine, batch, MICRO) for batch in batches()]
        out[what] = (losses, engine.skipped_steps, engine.full_state_dict())
        engine.close()
    engine = build_engine(3, 2, offload_optimizer=SUPER_OFFLOAD, **ZERO3)
    experts = [part.partitions for part in engine.buckets if part.group.expert]
    losses, norms = [], []
    for batch in batches():
        losses.append(train_global_step(engine, batch, MICRO))
        norms.append(engine.get_global_grad_norm())
    out["super_offload"] = (losses, norms, engine.full_state_dict(), engine.offload_stats(),
                            type(engine.zero_optimizer).__name__, experts)
    engine.close()
    out["overflow"] = overflow_in_rank_1s_experts()
    return out


def test_stage3_split_experts_in_bf16_fp16_and_super_offload():
    ref_losses, ref_norms, _, ref_weights = reference()
    clipped = [norm > CLIP for norm in ref_norms]
    assert any(clipped), f"clipping never fires: {ref_norms}"
    untrained = do_nothing()
    results = run_distributed(train_all, 4, timeout=180)
    for what, _ in PRECISIONS:
        losses, skipped, weights = results[0][what]
        where = f"world 4, ep_size 2, stage 3 {what}"
        assert skipped == 0, (where, skipped)  # parity needs every step taken
        assert weights["moe.w_in"].dtype == torch.float32, where  # fp32 masters
        assert all(weights[name].shape == ref.shape for name, ref in ref_weights.items()), where
        assert_tolerance_discriminates(where, (ref_losses, ref_weights), (losses, weights), untrained,
                                       loss_tol=LOSS_TOL, weight_tol=WEIGHT_TOL)

    losses, norms, weights, stats, kind, experts = results[0]["super_offload"]
    where = "world 4, ep_size 2, stage 3 super_offload always"
    assert kind == "SuperOffloadOptimizer" and experts and all(parts == 2 for parts in experts), (where, kind, experts)
    assert_matches(where, losses, weights, ref_losses, ref_weights)
    assert norms == pytest.approx(ref_norms, rel=1e-5), (where, norms, ref_norms)
    assert stats["speculative_steps"] == STEPS and stats["clip_redos"] == sum(clipped), (where, stats)

    overflow = [rank_results["overflow"] for rank_results in results]
    assert [skipped for skipped, _, _, _ in overflow] == [1] * 4, overflow  # every rank skipped the step
    assert overflow[0][1], "weights changed on a skipped step"
    assert all(after == before / 2 for _, _, before, after in overflow), overflow  # the scale backed off (hysteresis 1)
