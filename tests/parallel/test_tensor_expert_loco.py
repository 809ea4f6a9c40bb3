"""LoCo (qgZ error feedback) with tensor parallelism and expert parallelism, and its checkpoint round trip.

World 8 = TP2 x DP4 with ep_size 2, as 2 pretend nodes per tensor-parallel index (ZEROTRAIN_RANKS_PER_NODE=4),
stage 2, qgZ int4 + LoCo: dense buckets are reduced quantized over the 4 data-parallel ranks, expert buckets
over their expert-data-parallel pair, each with its error buffer. The losses stay within 0.6% of the exact
single-process run, and the untrained run's do not (assert_tolerance_discriminates). The run saves after SAVED_AT steps
and goes on; a fresh engine loading that checkpoint holds bit-equal error buffers (expert ones included)
and trains the remaining steps exactly like the uninterrupted run (losses and final whole weights, which
the last step's loaded buffers shape, within 1e-5); control: the same resume with the buffers zeroed
ends on other weights.
"""
from __future__ import annotations

import os

import torch

from distributed import run_distributed
from models_for_tests import assert_tolerance_discriminates
from tp_moe_common import SAVED_AT, STEPS, build_engine, do_nothing, reference, train_steps

LOCO = {"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}


def error_buffers(engine) -> list[torch.Tensor]:
    """Every LoCo error buffer of this rank, dequantized (expert buckets' included); empty ones as zero-size."""
    return [torch.empty(0) if feedback.error() is None else feedback.error().clone()
            for reducer in engine.reducer.reduce.per_bucket if reducer is not None for feedback in reducer.feedbacks]


def expert_reducer_sizes(engine) -> list:
    """The size of the group each expert bucket is reduced over (None: not reduced)."""
    reducers = engine.reducer.reduce.per_bucket
    return [None if reducers[i] is None else reducers[i].comm.size
            for i, bucket in enumerate(engine.buckets) if bucket.group.expert]


def loco_round_trip(directory: str) -> dict:
    os.environ["ZEROTRAIN_RANKS_PER_NODE"] = "4"
    engine = build_engine(2, 2, 2, **LOCO)
    out = {"expert_reducers": expert_reducer_sizes(engine)}
    losses = train_steps(engine, 0, SAVED_AT)
    saved = error_buffers(engine)
    engine.save_checkpoint(directory, tag="loco")
    out["uninterrupted"] = losses + train_steps(engine, SAVED_AT, STEPS)
    out["uninterrupted_weights"] = engine.full_state_dict()
    engine.close()

    resumed = build_engine(2, 2, 2, **LOCO)
    path, _ = resumed.load_checkpoint(directory)
    assert path is not None, f"nothing loaded from {directory}"
    loaded = error_buffers(resumed)
    out["buffers"] = (len(saved), sum(buffer.numel() for buffer in saved),
                      len(saved) == len(loaded) and all(torch.equal(a, b) for a, b in zip(saved, loaded)))
    out["expert_bytes"] = sum(feedback.nbytes for i, bucket in enumerate(resumed.buckets)
                              if bucket.group.expert and resumed.reducer.reduce.per_bucket[i] is not None
                              for feedback in resumed.reducer.reduce.per_bucket[i].feedbacks)
    out["resumed"] = train_steps(resumed, SAVED_AT, STEPS)
    out["resumed_weights"] = resumed.full_state_dict()
    resumed.close()

    control = build_engine(2, 2, 2, **LOCO)  # the buffers zeroed after loading: the comparison can see them
    control.load_checkpoint(directory)
    control.reducer.reset_loco_state()
    train_steps(control, SAVED_AT, STEPS)
    out["control_weights"] = control.full_state_dict()
    control.close()
    return out


def test_loco_with_tp_and_experts_trains_close_and_resumes_with_its_error_buffers(tmp_path):
    ref_losses, *_ = reference()
    untrained = do_nothing()
    results = run_distributed(loco_round_trip, 8, str(tmp_path), timeout=240)
    for rank, out in enumerate(results):
        where = f"TP2 x DP4, ep_size 2, stage 2 qgZ+LoCo, rank {rank}"
        assert out["expert_reducers"] and all(size == 2 for size in out["expert_reducers"]), (where, out)
        losses = out["uninterrupted"]
        # lossy: the untrained run (1.7e-2 off) must fall outside the tolerance by 2x; the weights are not
        # bounded (3 steps of qgZ leave them half the untrained run's distance off: test_tensor_expert_parallel.py)
        assert_tolerance_discriminates(where, (ref_losses, None), (losses, None), untrained, loss_tol=6e-3)
        count, elements, equal = out["buffers"]
        assert count > 0 and elements > 0 and equal, (where, out["buffers"])
        assert out["expert_bytes"] > 0, (where, "no expert LoCo buffer after loading")
        resumed, want = out["resumed"], losses[SAVED_AT:]
        assert max(abs(a - b) / abs(b) for a, b in zip(resumed, want)) <= 1e-5, (where, resumed, want)
    uninterrupted, resumed, control = (results[0][key] for key in
                                       ("uninterrupted_weights", "resumed_weights", "control_weights"))
    assert sorted(uninterrupted) == sorted(resumed) and uninterrupted["moe.w_in"].shape[0] == 4
    for name, expected in uninterrupted.items():  # the last step's update used the loaded error buffers
        torch.testing.assert_close(resumed[name], expected, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"resumed with LoCo buffers, {name}: {m}")
    assert any(not torch.allclose(control[name], expected, rtol=1e-5, atol=1e-6)
               for name, expected in uninterrupted.items()), "zeroed LoCo buffers did not change the weights"
    files = os.listdir(os.path.join(str(tmp_path), "loco"))
    assert all(f"loco_state_{rank}.safetensors" in files for rank in range(8)), files
