"""LoCo's error buffers go through the unified checkpoint.

- Same layout (world 2, stage 2, qgZ int4 + LoCo, reset_T 3 so a reset falls after the
  resume): a run saved at step 4 and resumed into a fresh engine continues exactly like the
  uninterrupted run (losses within 1e-5 relative, error buffers bit-equal), both with a
  synchronous and an asynchronous save; the buffers are in the manifest with a checksum.
  Control: resuming with the buffers zeroed instead does change the losses, so the
  comparison can see a lost buffer.
- Another layout (loaded at world 4): ranks 0-1 find buffers of another layout, ranks 2-3
  none; every rank warns once, its buffers restart from zero, and training goes on.
"""
from __future__ import annotations

import json
import os
import warnings

import torch

from distributed import run_distributed
from zerotrain.checkpoint import verify_checkpoint
from models_for_tests import OddMLP, make_batches, micro_slice

MICRO, STEPS, SAVE_AT = 2, 8, 4


def _config(bucket: int = 40) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": bucket, "zero_quantized_gradients": True,
                                  "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 3}},
            "steps_per_print": 0, "comm_timeout_seconds": 60}


def _engine(seed: int = 0, bucket: int = 40):
    import zerotrain

    torch.manual_seed(seed)
    engine, *_ = zerotrain.initialize(model=OddMLP(), config=_config(bucket))
    return engine


def _train(engine, first: int, count: int) -> list[float]:
    """Global steps [first, first+count) of a fixed batch sequence (global batch MICRO·world)."""
    import torch.distributed as dist

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    losses = []
    for batch in make_batches(STEPS, MICRO * world)[first:first + count]:
        x, y = micro_slice(batch, 0, rank, world, MICRO)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _errors(engine) -> list[torch.Tensor]:
    return [f.error().clone() for r in engine.reducer.reduce.per_bucket for f in r.feedbacks]


def same_layout(save_dir: str) -> dict:
    out = {}
    engine = _engine()
    out["uninterrupted"] = _train(engine, 0, STEPS)
    for mode in ("sync", "async"):
        engine = _engine()
        _train(engine, 0, SAVE_AT)
        saved = _errors(engine)
        engine.save_checkpoint(os.path.join(save_dir, mode), tag="step4", async_save=mode == "async")
        engine.wait_checkpoint()
        resumed = _engine(seed=1)  # other initial weights: everything must come from the checkpoint
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "restart from zero" warning on the same layout
            resumed.load_checkpoint(os.path.join(save_dir, mode))
        out[f"{mode}_buffers_equal"] = all(torch.equal(a, b) for a, b in zip(_errors(resumed), saved))
        out[f"{mode}_steps"] = (resumed.reducer.optimizer_steps, resumed.global_steps)
        out[mode] = _train(resumed, SAVE_AT, STEPS - SAVE_AT)
    control = _engine(seed=1)
    control.load_checkpoint(os.path.join(save_dir, "sync"))
    control.reducer.reset_loco_state()
    out["buffers_zeroed"] = _train(control, SAVE_AT, STEPS - SAVE_AT)
    with open(os.path.join(save_dir, "sync", "step4", "manifest.json")) as handle:
        out["manifest_entry"] = json.load(handle)["files"].get(f"loco_state_{int(os.environ['RANK'])}.safetensors")
    return out


def other_layout(save_dir: str) -> dict:
    engine = _engine(seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(os.path.join(save_dir, "sync"))
    messages = [str(w.message) for w in caught if "restart from zero" in str(w.message)]
    out = {"warnings": messages, "loco_bytes": engine.memory_report()["loco_errors"],
           "optimizer_steps": engine.reducer.optimizer_steps}
    out["losses"] = _train(engine, SAVE_AT, 1)  # step 5 (step 6 would hit reset_T)
    out["loco_bytes_after"] = engine.memory_report()["loco_errors"]
    return out


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_loco_resume_exact_on_same_layout_and_restart_on_another(tmp_path):
    save_dir = str(tmp_path)
    for rank, out in enumerate(run_distributed(same_layout, 2, save_dir)):
        want = out["uninterrupted"][SAVE_AT:]
        for mode in ("sync", "async"):
            assert out[f"{mode}_buffers_equal"], (rank, mode)
            assert out[f"{mode}_steps"] == (SAVE_AT, SAVE_AT), (rank, mode, out[f"{mode}_steps"])
            assert _max_rel(out[mode], want) <= 1e-5, (rank, mode, out[mode], want)
        assert _max_rel(out["buffers_zeroed"], want) > 1e-5, (rank, out["buffers_zeroed"], want)
        entry = out["manifest_entry"]
        assert entry is not None and entry["size"] > 0 and len(entry["crc32"]) == 8, (rank, entry)
    assert verify_checkpoint(os.path.join(save_dir, "sync", "step4"))["ok"]  # sizes, crc32, headers

    for rank, out in enumerate(run_distributed(other_layout, 4, save_dir)):
        what = f"world 4, rank {rank}: {out}"
        assert len(out["warnings"]) == 1, what
        expected = "another layout" if rank < 2 else "holds no LoCo error buffers"
        assert expected in out["warnings"][0], what
        assert out["loco_bytes"] == 0 and out["optimizer_steps"] == SAVE_AT, what
        assert all(map(torch.isfinite, map(torch.tensor, out["losses"]))) and out["loco_bytes_after"] > 0, what
