"""ZeRO stage 3 with experts split over expert-parallel groups trains like one process.

Split experts are partitioned over their expert-data-parallel group (ranks {0, 2} and {1, 3} at world 4
with ep_size 2; one rank at world 2 with ep_size 2: not partitioned at all), gathered there by the
module hooks (one collective per group: dense parameters and experts never share one) and their
gradients reduce-scattered there, divided by the data-parallel size. Modes: bucketed gathers with
every parameter partitioned, sequential gathers, every parameter persistent (kept whole, its
updated shard all-gathered after each step), cpu optimizer offload, and nvme optimizer offload with
the small parameters (expert biases among them) persistent. The reference is the one-process
MoENet of moe_common.
"""
from __future__ import annotations

import pytest

from distributed import run_distributed
from models_for_tests import train_global_step
from moe_common import (MICRO, SAVED_AT, STEPS, assert_matches, batches, build_engine, reference, resume_segment)


def modes(nvme_path: str) -> list[tuple[str, dict]]:
    return [("bucketed", {"stage3_param_persistence_threshold": 0}),
             ("sequential", {"stage3_param_persistence_threshold": 0, "stage3_allgather_sequential": True}),
             ("persistent", {"stage3_param_persistence_threshold": 10**6}),
             ("cpu offload", {"stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}}),
             ("nvme offload, some persistent", {"stage3_param_persistence_threshold": 40,  # expert biases
                                                "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}}),
             ("offload_param nvme", {"stage3_param_persistence_threshold": 0,
                                     "offload_param": {"device": "nvme", "nvme_path": nvme_path}})]


def train_modes(ep_size: int, nvme_path: str) -> list:
    """Each mode from scratch: (mode, losses, norms, full weights, expert parts' (partitions, persistent,
    offloaded by offload_param))."""
    results = []
    for what, zero in modes(nvme_path):
        engine = build_engine(3, ep_size, **zero)
        experts = [(part.partitions, part.persistent, part.offloaded) for part in engine.buckets
                   if part.group.expert]
        losses, norms = [], []
        for batch in batches():
            losses.append(train_global_step(engine, batch, MICRO))
            norms.append(engine.get_global_grad_norm())
        results.append((what, losses, norms, engine.full_state_dict(), experts))
        engine.close()
    return results


@pytest.mark.parametrize("world, ep_size", [(4, 2), (2, 2)])
def test_stage3_trains_split_experts_like_one_process(world, ep_size, tmp_path):
    ref_losses, ref_norms, _, ref_weights = reference()
    results = run_distributed(train_modes, world, ep_size, str(tmp_path), timeout=120)
    assert all(weights == {} for rank in results[1:] for _, _, _, weights, _ in rank)  # whole weights on rank 0
    assert [what for what, *_ in results[0]] == [what for what, _ in modes(str(tmp_path))]
    for what, losses, norms, weights, experts in results[0]:
        where = f"world {world}, ep_size {ep_size}, stage 3 {what}"
        assert len(experts) == 4 and all(parts == world // ep_size for parts, _, _ in experts), (where, experts)
        assert all(offloaded == ("offload_param" in what) for _, _, offloaded in experts), (where, experts)
        persistent = [kept for _, kept, _ in experts]
        assert persistent == ([True] * 4 if what == "persistent" else [False] * 4 if "some" not in what
                              else [True, False, True, False]), (where, experts)  # b_out, w_out, b_in, w_in
        assert_matches(where, losses, weights, ref_losses, ref_weights)
        assert norms == pytest.approx(ref_norms, rel=1e-5), (where, norms, ref_norms)


def train_segment(directory: str, ep_size: int, first: int, last: int) -> tuple:
    """Stage 3 steps [first, last); loads `directory` when first > 0, else saves it after. Also returns
    whether a read-only GatheredParameters of moe.w_in shows this rank's experts of the whole weights."""
    from zerotrain.zero import GatheredParameters

    engine = build_engine(3, ep_size, stage3_param_persistence_threshold=0)
    losses = resume_segment(engine, directory, "stage3", first, last, MICRO)
    weights = engine.full_state_dict()
    w_in = engine.module.moe.w_in
    with GatheredParameters([w_in]):
        local = w_in.detach().clone()
    try:
        with GatheredParameters([w_in], modifier_rank=0):
            pass
        refused = "accepted"
    except NotImplementedError as error:
        refused = str(error)
    engine.close()
    return losses, weights, local, w_in.ep_slice, refused


def test_stage3_split_experts_save_at_world_4_and_resume_at_world_2(tmp_path):
    ref_losses, _, at_save, ref_final = reference()
    directory = str(tmp_path / "checkpoint")
    saved = run_distributed(train_segment, 4, directory, 2, 0, SAVED_AT, timeout=120)
    assert_matches("stage 3 saved at world 4", saved[0][0], saved[0][1], ref_losses[:SAVED_AT], at_save)
    resumed = run_distributed(train_segment, 2, directory, 2, SAVED_AT, STEPS, timeout=120)
    assert_matches("stage 3 resumed at world 2", resumed[0][0], resumed[0][1], ref_losses[SAVED_AT:], ref_final)
    for rank, (_, _, local, ep_slice, refused) in enumerate(resumed):
        assert local.shape == ep_slice.local_shape, (rank, local.shape)  # this rank's experts, gathered
        assert local.equal(ep_slice.take(resumed[0][1]["moe.w_in"])), rank
        assert "modifier_rank=0" in refused and "moe.w_in" in refused, (rank, refused)


def frozen_experts_at_stage3() -> str:
    try:
        build_engine(3, 2, frozen=frozenset({"moe.w_in"}))
    except NotImplementedError as error:
        return str(error)
    return "accepted"


def test_frozen_split_experts_are_refused_at_stage3_naming_them():
    for message in run_distributed(frozen_experts_at_stage3, 2):
        assert "frozen expert-parallel parameter 'moe.w_in'" in message and "stage 3" in message, message
