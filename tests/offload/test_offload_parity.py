"""Offloaded optimizers reproduce single-process AdamW: cpu (stages 1, 2), nvme (stages 1, 2), super_offload, ratio.

World 2, fp32, two parameter groups (different lr and weight decay), accumulation 2, clipping at 1.0
(it fires on half the steps, so super_offload must roll back and redo those; "always" speculates
every step, the default "adaptive" policy skips speculation after a clipped step).
"""
from __future__ import annotations

from distributed import run_distributed
from offload_common import (CLIP, assert_matches_reference, build_engine, reference_training, train_steps,
                            world_batches)


def _modes(nvme_path: str) -> list[tuple[str, int, dict]]:
    return [
        ("cpu stage 1", 1, {"device": "cpu"}),
        ("cpu stage 2", 2, {"device": "cpu", "pin_memory": True}),
        ("nvme stage 2", 2, {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2}),
        # stage 1 holds the clipped gradients too (accumulation 2: nothing streamed or spilled before the norm)
        ("nvme stage 1", 1, {"device": "nvme", "nvme_path": nvme_path + "_s1", "buffer_count": 2}),
        ("super_offload stage 2", 2, {"device": "cpu", "super_offload": True, "super_offload_speculation": "always"}),
        ("super_offload stage 1, adaptive", 1, {"device": "cpu", "super_offload": True}),
        # torch's own step (not the CPU Adam kernel): speculation saves a copy and steps in place
        ("super_offload stage 2, torch step", 2, {"device": "cpu", "super_offload": True,
                                                  "super_offload_speculation": "always"}),
        ("cpu ratio 0.5 stage 2", 2, {"device": "cpu", "ratio": 0.5}),
    ]


def train_modes(nvme_path: str) -> list:
    import zerotrain.offload as offload

    results = []
    for what, stage, block in _modes(nvme_path):
        engine = build_engine(stage, block)
        opt = engine.zero_optimizer
        assert isinstance(opt, offload.OffloadOptimizer), what
        if "torch step" in what:
            for group in opt.optimizer.param_groups:
                group["fused"] = False
            assert not any(opt.cpu_adam.supports(m, b.group_index) for m, b in zip(opt.masters, engine.buckets))
        losses, norms = train_steps(engine, world_batches(2))
        accounting = {"split": opt.memory_split(), "offloaded": list(opt.offloaded),
                      "shard_numels": [b.shard_numel for b in engine.buckets], "offloaded_bytes": opt.offloaded_bytes(),
                      "state_bytes": opt.state_bytes(), "report": engine.memory_report()["optimizer_states"]}
        host_masters = all(m.data_ptr() != b.local_shard().data_ptr()
                           for m, b, off in zip(opt.masters, engine.buckets, opt.offloaded) if off)
        results.append((what, losses, norms, engine.full_state_dict(), dict(opt.stats), accounting, host_masters,
                        type(opt).__name__))
        if hasattr(opt, "close"):
            opt.close()
    return results


def test_offload_modes_match_single_process(tmp_path):
    results = run_distributed(train_modes, 2, str(tmp_path), timeout=120)[0]
    ref_losses, ref_weights = reference_training(world_batches(2))
    for what, losses, norms, weights, stats, accounting, host_masters, kind in results:
        assert_matches_reference(what, losses, weights, ref_losses, ref_weights)
        assert host_masters, f"{what}: offloaded masters must be separate host copies"
        clipped = [n > CLIP for n in norms]
        assert any(clipped) and not all(clipped), f"{what}: clipping should fire on some steps only: {norms}"
        assert stats["steps"] == len(losses), what
        if "adaptive" in what:  # speculate only after a step that was not clipped (and on the first)
            speculated = [step == 0 or not clipped[step - 1] for step in range(len(losses))]
            assert stats["speculative_steps"] == sum(speculated), (what, stats, clipped)
            assert stats["not_speculated"] == len(losses) - sum(speculated), (what, stats)
            assert stats["clip_redos"] == sum(s and c for s, c in zip(speculated, clipped)), (what, stats)
            assert stats["committed"] == sum(s and not c for s, c in zip(speculated, clipped)), (what, stats)
        elif "super_offload" in what:
            assert kind == "SuperOffloadOptimizer"
            assert stats["speculative_steps"] == len(losses), (what, stats)
            assert stats["clip_redos"] == sum(clipped) and stats["rollbacks"] == sum(clipped), (what, stats)
            assert stats["committed"] == len(losses) - sum(clipped), (what, stats)
            assert stats["bucket_updates"] >= len(losses), (what, stats)
            spares = accounting["split"]["host_buffers"]  # out of place: one spare master + states per element
            if "torch step" in what:
                # the saved copy of masters and states instead, and unscaled host copies of the gradients
                assert spares == accounting["split"]["host"] + sum(accounting["shard_numels"]) * 4, (what, accounting)
            else:
                assert spares == sum(accounting["shard_numels"]) * 12, (what, accounting)
        if "nvme" in what:
            assert kind == "NvmeOffloadOptimizer"
            assert stats["nvme_bytes_written"] > 0 and stats["nvme_bytes_read"] > 0, stats
            assert accounting["split"]["nvme"] > 0
        if "ratio" in what:
            _check_ratio_split(accounting)
        else:
            assert all(accounting["offloaded"]), what
            assert accounting["state_bytes"] == 0 and accounting["report"] == 0, what


def _check_ratio_split(accounting: dict) -> None:
    """Half the shard elements offloaded (by whole buckets); bytes accounted where they live."""
    numels, offloaded = accounting["shard_numels"], accounting["offloaded"]
    assert any(offloaded) and not all(offloaded), offloaded
    host_numel = sum(n for n, off in zip(numels, offloaded) if off)
    device_numel = sum(n for n, off in zip(numels, offloaded) if not off)
    assert abs(host_numel / sum(numels) - 0.5) <= max(numels) / 2 / sum(numels)
    # AdamW: exp_avg + exp_avg_sq per element and a 4-byte step; host buckets also hold their fp32 master.
    host_buckets, device_buckets = sum(offloaded), len(offloaded) - sum(offloaded)
    assert accounting["split"]["host"] == host_numel * 12 + 4 * host_buckets, accounting
    assert accounting["split"]["device"] == device_numel * 8 + 4 * device_buckets, accounting
    assert accounting["offloaded_bytes"] == accounting["split"]["host"]
    assert accounting["state_bytes"] == accounting["split"]["device"] == accounting["report"]
