"""Split experts with an offloaded optimizer (cpu, super_offload, nvme) train like one process.

World 4, ep_size 2: ranks {0, 2} and {1, 3} hold the same two of the four experts, so expert buckets
are partitioned over those pairs (the expert-data-parallel groups) and their updated shards must be
all-gathered there, by every offloaded optimizer's publish, while the other buckets use all 4 ranks.
The reference is the same MoENet with every expert local, trained on each step's whole global batch
(the loss = the mean of every micro-batch's loss; the aux loss is per micro-batch), with clipping.
The checkpoint test saves at world 4 with cpu offload and resumes at world 2 (super_offload).
"""
from __future__ import annotations

import pytest

from distributed import run_distributed
from models_for_tests import MOE_EXPERTS as EXPERTS
from models_for_tests import train_global_step
from moe_common import (CLIP, MICRO, SAVED_AT, STEPS,
                        assert_matches, batches, build_engine, reference, resume_segment)


def offload_modes(nvme_path: str) -> list[tuple[str, int, dict]]:
    return [
        ("cpu stage 2", 2, {"device": "cpu"}),
        ("super_offload stage 2, always", 2, {"device": "cpu", "super_offload": True,
                                              "super_offload_speculation": "always"}),
        ("nvme stage 2", 2, {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2}),
        ("cpu ratio 0.5 stage 1", 1, {"device": "cpu", "ratio": 0.5}),
    ]


def train_modes(nvme_path: str, ep_size: int) -> list:
    """Every offload mode from scratch over all STEPS: (mode, losses, norms, full weights, stats, layout)."""
    from zerotrain.offload import OffloadOptimizer

    results = []
    for what, stage, offload in offload_modes(nvme_path):
        engine = build_engine(stage, ep_size, offload_optimizer=offload)
        optimizer = engine.zero_optimizer
        assert isinstance(optimizer, OffloadOptimizer), what
        experts = [(b.partitions, b.group.comm.size) for b in engine.buckets if b.group.expert]
        losses, norms = [], []
        for batch in batches():
            losses.append(train_global_step(engine, batch, MICRO))
            norms.append(engine.get_global_grad_norm())
        layout = {"experts": experts, "offloaded": list(optimizer.offloaded), "kind": type(optimizer).__name__}
        results.append((what, losses, norms, engine.full_state_dict(), dict(optimizer.stats), layout))
        engine.close()
    return results


def test_offloaded_optimizers_train_split_experts_like_one_process(tmp_path):
    ref_losses, ref_norms, _, ref_weights = reference()
    clipped = [norm > CLIP for norm in ref_norms]
    assert any(clipped), f"clipping never fires: {ref_norms}"
    results = run_distributed(train_modes, 4, str(tmp_path), 2, timeout=120)
    assert all(weights == {} for rank in results[1:] for _, _, _, weights, _, _ in rank)  # whole weights on rank 0
    for what, losses, norms, weights, stats, layout in results[0]:
        where = f"world 4, ep_size 2, {what}"
        assert layout["experts"] and all(parts == 2 and group == 2 for parts, group in layout["experts"]), \
            (where, layout)  # expert buckets partitioned over their expert-data-parallel pair
        assert_matches(where, losses, weights, ref_losses, ref_weights)
        assert norms == pytest.approx(ref_norms, rel=1e-5), (where, norms, ref_norms)
        assert stats["steps"] == STEPS, (where, stats)
        if "ratio" in what:
            assert any(layout["offloaded"]) and not all(layout["offloaded"]), (where, layout)
        else:
            assert all(layout["offloaded"]), (where, layout)
        if "super_offload" in what:
            assert layout["kind"] == "SuperOffloadOptimizer", where
            assert stats["speculative_steps"] == STEPS and stats["clip_redos"] == sum(clipped), (where, stats)
            assert stats["committed"] == STEPS - sum(clipped), (where, stats)
        if "nvme" in what:
            assert layout["kind"] == "NvmeOffloadOptimizer", where
            assert stats["nvme_bytes_written"] > 0 and stats["nvme_bytes_read"] > 0, (where, stats)


def train_segment(directory: str, offload: dict, ep_size: int, first: int, last: int) -> tuple:
    """Steps [first, last) at stage 2 with `offload`; loads `directory` when first > 0, else saves it after."""
    engine = build_engine(2, ep_size, offload_optimizer=offload)
    losses = resume_segment(engine, directory, "offload", first, last, MICRO)
    weights = engine.full_state_dict()
    engine.close()
    return losses, weights


def test_split_experts_with_cpu_offload_save_at_world_4_and_resume_at_world_2(tmp_path):
    ref_losses, _, at_save, ref_final = reference()
    directory = str(tmp_path / "checkpoint")
    saved = run_distributed(train_segment, 4, directory, {"device": "cpu"}, 2, 0, SAVED_AT, timeout=120)
    assert_matches("saved at world 4", saved[0][0], saved[0][1], ref_losses[:SAVED_AT], at_save)
    resumed = run_distributed(train_segment, 2, directory, {"device": "cpu", "super_offload": True}, 2,
                              SAVED_AT, STEPS, timeout=120)
    assert_matches("resumed at world 2 (ep_size 2, super_offload)", resumed[0][0], resumed[0][1],
                   ref_losses[SAVED_AT:], ref_final)
    assert ref_final["moe.w_in"].shape[0] == EXPERTS
