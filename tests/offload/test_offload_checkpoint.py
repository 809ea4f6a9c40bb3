"""Offloaded optimizer states round-trip through the unified checkpoint.

cpu offload at stage 2 and nvme offload at stage 3 (world 2, two parameter groups, clipping,
global batch 8), super_offload at stage 2 and `ratio` 0.5 (part of the states on the device): N steps,
save, load into a fresh engine with other initial weights, M more steps == N+M steps of
single-process AdamW (fp32, 1e-5 relative). The same checkpoints also load into an engine with
another setting: no offload at world size 1 (accumulation 4, same global batch), ratio 0.5 at
stage 1, or plain cpu offload.
"""
from __future__ import annotations

import glob
import os
import time

import pytest
import torch

from distributed import run_distributed
from models_for_tests import OddMLP, make_batches, micro_slice
from offload_common import (GROUPS, MICRO, assert_matches_reference, assert_same_snapshot, engine_config,
                            param_groups, reference_training, snapshot)

FIRST, SECOND, GLOBAL_BATCH = 3, 3, 8


def make_engine(stage: int, offload, seed: int, precision: str = "fp32", accumulation: int = 0):
    import zerotrain

    world = int(os.environ["WORLD_SIZE"])
    config = engine_config(stage, offload, precision)
    config["gradient_accumulation_steps"] = accumulation or GLOBAL_BATCH // (MICRO * world)
    config["train_micro_batch_size_per_gpu"] = GLOBAL_BATCH // (config["gradient_accumulation_steps"] * world)
    config["comm_timeout_seconds"] = 60
    torch.manual_seed(seed)
    model = OddMLP()
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def train(engine, first: int, count: int) -> list[float]:
    """Global steps [first, first+count) of the fixed batch sequence; the global mean loss of each."""
    import torch.distributed as dist

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    accumulation = engine.gradient_accumulation_steps()
    losses = []
    for batch in make_batches(FIRST + SECOND, GLOBAL_BATCH)[first:first + count]:
        total = torch.zeros(1)
        for a in range(accumulation):
            x, y = micro_slice(batch, a, rank, world, GLOBAL_BATCH // (accumulation * world))
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (accumulation * world))
    return losses


def first_leg(save_dir: str, stage: int, offload: dict) -> dict:
    engine = make_engine(stage, offload, seed=0)
    losses = train(engine, 0, FIRST)
    engine.save_checkpoint(save_dir, tag="first")
    saved = snapshot(engine)
    report = engine.memory_report()
    stats = engine.offload_stats()
    engine.close()
    return {"losses": losses, "saved": saved, "report": report, "stats": stats}


def next_leg(save_dir: str, stage: int, offload) -> dict:
    engine = make_engine(stage, offload, seed=123)
    engine.load_checkpoint(save_dir)
    loaded = snapshot(engine)
    lrs = engine.get_lr()
    losses = train(engine, FIRST, SECOND)
    weights = engine.full_state_dict()
    stats = engine.offload_stats()
    # the same checkpoint into this trained engine (a rollback in the process): its states, offloaded or not, are
    # replaced by the loaded ones (read into new tensors when the host has room), and the same steps follow
    engine.load_checkpoint(save_dir)
    rolled_back = {"losses": train(engine, FIRST, SECOND), "weights": engine.full_state_dict()}
    engine.close()
    engine.close()  # idempotent
    return {"losses": losses, "loaded": loaded, "weights": weights, "lrs": lrs, "stats": stats,
            "rolled_back": rolled_back}


def _modes(tmp_path) -> dict:
    """mode: (stage, offload block it saves with, (world, stage, offload block) of the other engine it loads into)."""
    return {
        "cpu stage 2": (2, {"device": "cpu"}, (1, 0, None)),
        "nvme stage 3": (3, {"device": "nvme", "nvme_path": str(tmp_path / "nvme"), "buffer_count": 2}, (1, 3, None)),
        "super_offload stage 2": (2, {"device": "cpu", "super_offload": True, "super_offload_speculation": "always"}, (1, 1, {"device": "cpu", "ratio": 0.5})),
        "cpu ratio 0.5 stage 2": (2, {"device": "cpu", "ratio": 0.5}, (2, 2, {"device": "cpu"})),
    }


@pytest.mark.parametrize("mode", ["cpu stage 2", "nvme stage 3", "super_offload stage 2", "cpu ratio 0.5 stage 2"])
def test_offloaded_states_round_trip(tmp_path, mode):
    stage, offload, (other_world, other_stage, other_offload) = _modes(tmp_path)[mode]
    save_dir = str(tmp_path / "ckpt")
    ref_losses, ref_weights = reference_training(make_batches(FIRST + SECOND, GLOBAL_BATCH))

    first = run_distributed(first_leg, 2, save_dir, stage, offload, timeout=120)
    head = first[0]
    assert head["report"]["offload"]["offloaded_bytes"] > 0, head["report"]
    assert head["report"]["offload"]["nvme" if offload["device"] == "nvme" else "host"] > 0, head["report"]
    assert head["stats"]["steps"] == FIRST, head["stats"]
    if "ratio" in mode:
        assert head["report"]["optimizer_states"] > 0, "ratio 0.5 keeps part of the states on the device"
    if "super_offload" in mode:
        assert head["stats"]["speculative_steps"] == FIRST and head["stats"]["clip_redos"] >= 1, head["stats"]

    # Same world, same offload mode: the load is exact, and training goes on as if never stopped.
    again = run_distributed(next_leg, 2, save_dir, stage, offload, timeout=120)
    for rank in range(2):
        assert_same_snapshot(again[rank]["loaded"], first[rank]["saved"], f"{mode} rank {rank} after load")
    assert again[0]["lrs"] == [g["lr"] for g in GROUPS]
    assert again[0]["stats"]["steps"] == SECOND
    assert_matches_reference(f"{mode} resumed", head["losses"] + again[0]["losses"], again[0]["weights"],
                             ref_losses, ref_weights)
    assert again[0]["rolled_back"]["losses"] == again[0]["losses"], f"{mode}: loaded into the trained engine"
    rolled = again[0]["rolled_back"]["weights"]
    assert set(rolled) == set(again[0]["weights"]) and all(
        torch.equal(rolled[name], again[0]["weights"][name]) for name in rolled), f"{mode}: rolled back weights"

    # Another setting (world size, stage, offload): the offloaded states load where that engine keeps them.
    other = run_distributed(next_leg, other_world, save_dir, other_stage, other_offload, timeout=120)[0]
    if other_offload is None:
        assert other["stats"] == {}
    else:
        assert other["stats"]["steps"] == SECOND, other["stats"]
    assert_matches_reference(f"{mode} resumed at world {other_world}, stage {other_stage}, offload {other_offload}",
                             head["losses"] + other["losses"], other["weights"], ref_losses, ref_weights)


def async_save_during_speculation(save_dir: str, precision: str) -> dict:
    """super_offload ("always"), no accumulation (the first backward after the save is a boundary one), an
    asynchronous save whose snapshot copy is slowed down past the next backward: the speculative updates of that
    backward must not reach what the snapshot copies (model shards, masters, states), so the checkpoint holds
    exactly the state at save time."""
    import zerotrain.checkpoint.snapshot as snapshot_module

    offload = {"device": "cpu", "super_offload": True, "super_offload_speculation": "always"}
    engine = make_engine(2, offload, seed=0, precision=precision, accumulation=1)
    train(engine, 0, 2)
    at_save, state_at_save = engine.full_state_dict(), snapshot(engine)
    model_at_save = {name: param.detach().clone() for name, param in engine.module.named_parameters()}
    original = snapshot_module.Sources.complete

    def slow(self):
        time.sleep(0.5)
        return original(self)

    snapshot_module.Sources.complete = slow
    try:
        engine.save_checkpoint(save_dir, tag="speculating", async_save=True)
        train(engine, 2, 1)  # its backward speculates while the copy is still pending
        speculated = engine.offload_stats()["bucket_updates"]
        engine.wait_checkpoint()
    finally:
        snapshot_module.Sources.complete = original
    fresh = make_engine(2, offload, seed=5, precision=precision, accumulation=1)
    fresh.load_checkpoint(save_dir, tag="speculating")
    from safetensors.torch import load_file

    in_files = {}
    for path in glob.glob(os.path.join(save_dir, "speculating", "model*.safetensors")):
        in_files.update(load_file(path))  # the model weights as transformers would read them
    out = {"at_save": at_save, "loaded": fresh.full_state_dict(), "speculated": speculated, "same_state": True,
           "model_at_save": model_at_save, "in_files": in_files}
    try:
        assert_same_snapshot(state_at_save, snapshot(fresh), "loaded vs at save")
    except AssertionError as error:
        out["same_state"] = str(error)
    engine.close()
    fresh.close()
    return out


@pytest.mark.parametrize("precision", ["bf16"])  # bf16: model shards and masters are separate tensors
def test_async_save_is_not_touched_by_the_next_speculative_backward(tmp_path, precision):
    for rank, out in enumerate(run_distributed(async_save_during_speculation, 2, str(tmp_path / "ckpt"), precision,
                                               timeout=120)):
        assert out["speculated"] > 0, rank
        assert out["same_state"] is True, (rank, out["same_state"])
        if rank == 0:
            for name, want in out["at_save"].items():
                assert torch.equal(out["loaded"][name], want), name
            assert set(out["in_files"]) == set(out["model_at_save"])
            for name, want in out["model_at_save"].items():
                assert torch.equal(out["in_files"][name], want), f"{precision}: {name} in the model files"
