"""Offload at ZeRO stage 3 (per-parameter partitions): cpu, nvme and super_offload match single-process AdamW."""
from __future__ import annotations

from distributed import run_distributed
import torch

from offload_common import CLIP, assert_matches_reference, build_engine, reference_training, train_steps, world_batches


def train_stage3(nvme_path: str) -> list:
    results = []
    for block in ({"device": "cpu"}, {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2},
                  {"device": "cpu", "super_offload": True, "super_offload_speculation": "always"}):
        engine = build_engine(3, block)
        losses, norms = train_steps(engine, world_batches(2))
        results.append((block["device"] + (" super_offload" if block.get("super_offload") else ""), losses,
                        engine.full_state_dict(), engine.offload_stats(), norms))
        engine.close()
    return results


def test_stage3_offload_matches_single_process(tmp_path):
    ref_losses, ref_weights = reference_training(world_batches(2))
    results = run_distributed(train_stage3, 2, str(tmp_path), timeout=120)[0]
    for what, losses, weights, stats, norms in results:
        assert_matches_reference(f"stage 3 {what}", losses, weights, ref_losses, ref_weights)
        assert stats["offloaded_buckets"] == 4 and stats["steps"] == len(losses)
        if "super" in what:
            # Clipping-redo at stage 3: every clipped step rolled back and redone, the others committed,
            # and the result bitwise the plain (non-speculative) cpu offload run's.
            clipped = sum(norm > CLIP for norm in norms)
            assert 0 < clipped < len(losses), norms
            assert stats["clip_redos"] == stats["rollbacks"] == clipped, stats
            assert stats["committed"] == len(losses) - clipped, stats
            plain = results[0]
            assert plain[0] == "cpu" and losses == plain[1]
            for name, ref in plain[2].items():
                assert torch.equal(weights[name], ref), name
