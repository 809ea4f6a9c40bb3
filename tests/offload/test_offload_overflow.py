"""super_offload under fp16: an overflow on one rank rolls every speculative update back exactly.

At step OVERFLOW_STEP rank 1 backpropagates an infinite loss. The speculative CPU steps have
already run on the non-finite gradients by the time the overflow is known; they must be undone
bit for bit (masters, exp_avg, exp_avg_sq, step counts, model weights), the step skipped, and the
whole run must equal the plain (non-speculative) offload run and the device (no offload) run.
At ZeRO stages 1, 2 and 3.
"""
from __future__ import annotations

import os

import pytest
import torch

from distributed import run_distributed
from offload_common import assert_same_snapshot, build_engine, snapshot, train_steps, world_batches

OVERFLOW_STEP = 3


def train_fp16(stage: int, block: dict | None) -> dict:
    engine = build_engine(stage, block, precision="fp16")
    rank = int(os.environ["RANK"])
    snaps = {}

    def inject(step, loss):
        if step == OVERFLOW_STEP and rank == 1:
            return loss * float("inf")
        return None

    def on_step(step):
        if step in (OVERFLOW_STEP - 1, OVERFLOW_STEP):
            snaps[step] = snapshot(engine)

    losses, norms = train_steps(engine, world_batches(2), inject=inject, on_step=on_step)
    assert_same_snapshot(snaps[OVERFLOW_STEP - 1], snaps[OVERFLOW_STEP], f"{block}: the overflow step")
    stats = engine.offload_stats()
    final = snapshot(engine)
    result = {"losses": losses, "norms": norms, "skipped": engine.skipped_steps, "scale": engine.loss_scale, "stats": stats,
              "final": final, "weights": engine.full_state_dict()}
    engine.close()
    return result


def train_all(stage: int, nvme_path: str) -> list:
    return [train_fp16(stage, block) for block in (
        None, {"device": "cpu"}, {"device": "cpu", "super_offload": True, "super_offload_speculation": "always"},
        # NVMe: the clipped, loss-scaled gradients held until step() (fp16 and accumulation 2: never streamed)
        {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2})]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_overflow_rolls_back_speculation_exactly(stage, tmp_path):
    from offload_common import CLIP

    per_rank = run_distributed(train_all, 2, stage, str(tmp_path), timeout=120)
    for rank, (device, plain, spec, nvme) in enumerate(per_rank):
        # clipping (1.0) acts on some steps and not on others (the skipped step's norm is inf)
        finite = [n for n in device["norms"] if n == n and n != float("inf")]
        assert min(finite) < CLIP < max(finite), device["norms"]
        # the NVMe optimizer skips the overflow step too and equals the device run bit for bit
        assert nvme["skipped"] == device["skipped"] and nvme["scale"] == device["scale"]
        assert nvme["losses"] == device["losses"] and nvme["stats"]["nvme_bytes_written"] > 0
        for name, ref in device["weights"].items():
            assert torch.equal(nvme["weights"][name], ref), name
        assert spec["skipped"] == plain["skipped"] == device["skipped"] >= 1
        assert spec["scale"] == plain["scale"] == device["scale"]
        assert spec["stats"]["overflow_rollbacks"] == spec["skipped"], spec["stats"]
        # on every committed step each bucket's norm terms proved it finite (not read again); the overflow
        # was still found (the skipped steps above), from the buckets whose terms were not finite
        assert spec["stats"]["overflow_buckets_ahead"] >= spec["stats"]["norm_buckets_ahead"] > 0, spec["stats"]
        assert spec["stats"]["committed"] == len(spec["losses"]) - spec["skipped"] - spec["stats"]["clip_redos"]
        assert spec["losses"] == plain["losses"] == device["losses"]
        # Speculative and plain offload compute the same numbers: bitwise equal masters and states.
        assert_same_snapshot(spec["final"], plain["final"], f"rank {rank}: super_offload vs plain offload")
        for name, ref in device["weights"].items():
            assert torch.equal(spec["weights"][name], ref), name
