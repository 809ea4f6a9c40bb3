"""Checkpoints of a tensor-parallel + expert-parallel model load at other grid shapes.

World 8 = TP2 x DP4 with ep_size 2 saves at ZeRO stage 2 after SAVED_AT steps: each expert is held by
two data-parallel ranks (partitioned over that pair) on each of the two tensor-parallel ranks; the
files hold every expert once (from tensor-parallel rank 0's ranks) as whole `(num_experts, ...)`
tensors, and the tensor-parallel weights whole, all equal to one process's. The checkpoint loads at
TP2 x DP2 (ep_size 2: no expert replicas; and ep_size 1: every expert local on every rank), at
TP1 x DP2 (ep_size 2) and at world 1, and training goes on exactly like the uninterrupted
single-process run.
"""
from __future__ import annotations

import glob
import os

from distributed import run_distributed
from models_for_tests import assert_tensors_close
from tp_moe_common import EXPERTS, SAVED_AT, STEPS, build_engine, reference, train_steps


def segment(directory: str, stage: int, tp: int, ep_size: int, first: int, last: int):
    """Train steps [first, last): load `directory` first when first > 0, else save it after.
    Returns (losses, whole weights on rank 0)."""
    engine = build_engine(stage, tp, ep_size)
    if first > 0:
        path, _ = engine.load_checkpoint(directory)
        assert path is not None, f"nothing loaded from {directory}"
    losses = train_steps(engine, first, last)
    if first == 0:
        engine.save_checkpoint(directory, tag="tp_experts")
    return losses, engine.full_state_dict()


def resumes(directory: str, loads: list[tuple[int, int, int]]) -> list:
    """Each (stage, tp, ep_size) of `loads` in turn, in one spawned run: a fresh engine loads `directory` and
    trains steps [SAVED_AT, STEPS). Returns each one's (losses, whole weights on rank 0)."""
    return [segment(directory, stage, tp, ep_size, SAVED_AT, STEPS) for stage, tp, ep_size in loads]


def test_tp2_dp4_experts_save_once_and_resume_at_tp2_dp2_tp1_dp2_and_world_1(tmp_path):
    from safetensors.torch import load_file

    ref_losses, _, at_save, ref_final = reference()
    directory = str(tmp_path)
    saved = run_distributed(segment, 8, directory, 2, 2, 2, 0, SAVED_AT, timeout=180)
    losses = saved[0][0]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses[:SAVED_AT])) <= 1e-5, (losses, ref_losses)
    files = {}
    for path in sorted(glob.glob(os.path.join(directory, "tp_experts", "model-*.safetensors"))):
        files.update(load_file(path))
    assert files["moe.w_in"].shape[0] == EXPERTS and files["fc.weight"].shape == at_save["fc.weight"].shape
    assert_tensors_close(files, at_save, "model files written at TP2 x DP4")

    # (stage, tp, ep_size) at world 4 = TP2 x DP2, in one spawned run: no expert replicas; every expert local
    results = run_distributed(resumes, 4, directory, [(3, 2, 2), (2, 2, 1)], timeout=120)[0]
    results += [run_distributed(segment, 2, directory, 1, 1, 2, SAVED_AT, STEPS, timeout=120)[0],
                run_distributed(segment, 1, directory, 2, 1, 1, SAVED_AT, STEPS, timeout=120)[0]]
    shapes = ["TP2 x DP2 ep 2 stage 3", "TP2 x DP2 ep 1 stage 2", "TP1 x DP2 ep 2 stage 1", "world 1 stage 2"]
    for shape, (losses, weights) in zip(shapes, results, strict=True):
        where = f"saved at TP2 x DP4 ep 2, loaded at {shape}"
        expected = ref_losses[SAVED_AT:]
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, expected)) <= 1e-5, (where, losses, expected)
        assert_tensors_close(weights, ref_final, where)
