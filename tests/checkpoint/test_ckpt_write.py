"""The write path: in-place writes into several files per writer (no exchange) load exactly; host buffers are reused."""
from __future__ import annotations

import json
import os

import torch

from ckpt_common import assert_weights_equal, make_engine, optimizer_state, train
from distributed import run_distributed


def small_rounds_and_files(save_dir: str) -> dict:
    """Save with tiny round and file limits (counting the real all-to-all calls), then load into a fresh engine."""
    from safetensors.torch import load_file

    from zerotrain.checkpoint import Checkpointer, verify_checkpoint

    engine = make_engine(stage=2)
    train(engine, 0, 2)
    engine.checkpointer = Checkpointer(engine.checkpoint_state())
    engine.checkpointer.round_bytes, engine.checkpointer.max_file_bytes = 64, 100
    comm = engine.checkpointer.comm
    exchanges = []
    real_all_to_all = comm.all_to_all_bytes

    def counting(*args, **kwargs):
        exchanges.append(1)
        return real_all_to_all(*args, **kwargs)

    comm.all_to_all_bytes = counting
    path = engine.save_checkpoint(save_dir, tag="small")
    plan = engine.checkpointer.last_plan
    files_per_writer = {}
    for spec in plan.files:
        key = (spec.writer, spec.kind)
        files_per_writer[key] = files_per_writer.get(key, 0) + 1
    saved_weights, saved_state = engine.full_state_dict(), optimizer_state(engine)

    # a commit that fails on rank 0 after every file is written: the same error on every rank, the partial
    # directory removed, "small" still the latest
    from zerotrain.checkpoint import CheckpointError, commit

    def refuse(point: str) -> None:
        if point == "manifest-written":
            raise OSError("injected: the rename was refused")

    commit.fault_hook = refuse
    try:
        engine.save_checkpoint(save_dir, tag="failed")
        commit_error = None
    except CheckpointError as error:
        commit_error = str(error)
    finally:
        commit.fault_hook = None
    torch.distributed.barrier()
    entries = sorted(os.listdir(save_dir))  # (the job lock, latest, small)

    fresh = make_engine(stage=2, seed=9, verify_on_load=True)
    fresh.load_checkpoint(save_dir)
    out = {"rounds": len(plan.rounds), "exchanges": len(exchanges), "files_per_writer": files_per_writer,
           "saved": saved_weights, "loaded": fresh.full_state_dict(),
           "saved_state": saved_state, "loaded_state": optimizer_state(fresh),
           "commit_error": commit_error, "entries": entries}
    if int(os.environ["RANK"]) == 0:
        out["verified"] = verify_checkpoint(path)["files"]
        weight_map = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
        out["model_files"] = sorted(set(weight_map.values()))
        out["indexes"] = {kind: json.load(open(os.path.join(path, f"{kind}.safetensors.index.json")))["metadata"]
                          for kind in ("model", "optimizer")}
        out["file_bytes"] = {kind: sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path)
                                       if name.startswith(kind + "-")) for kind in ("model", "optimizer")}
        out["header_bytes"] = {kind: sum(8 + int.from_bytes(open(os.path.join(path, name), "rb").read(8), "little")
                                         for name in os.listdir(path) if name.startswith(kind + "-"))
                               for kind in ("model", "optimizer")}
        out["from_files"] = {name: load_file(os.path.join(path, file))[name] for name, file in weight_map.items()}
    return out


def test_many_rounds_and_files_per_writer_load_exactly(tmp_path):
    results = run_distributed(small_rounds_and_files, 2, str(tmp_path / "ckpt"))
    out = results[0]
    # no bytes move between ranks: each writes its own pieces in place in the shared files (#50); the files'
    # crc32s, joined from every rank's runs, are checked by verify_checkpoint and the verified load below
    assert out["rounds"] >= 3 and all(r["exchanges"] == 0 for r in results), (out["rounds"], results[1]["exchanges"])
    counts = out["files_per_writer"]  # both ranks write; one writes several model and optimizer files
    assert all((writer, "model") in counts for writer in (0, 1)), counts
    assert any(counts[(w, "model")] >= 2 and counts[(w, "optimizer")] >= 2 for w in (0, 1)), counts
    assert len(out["model_files"]) >= 4 and out["verified"] > 8
    for kind, metadata in out["indexes"].items():  # each index: its kind and its tensors' bytes (files less headers)
        assert metadata["zerotrain"] == kind, metadata
        assert metadata["total_size"] == out["file_bytes"][kind] - out["header_bytes"][kind], (kind, metadata)
    for result in results:
        assert "committing checkpoint" in result["commit_error"] and "failed on rank 0" in result["commit_error"] \
            and "injected" in result["commit_error"], result["commit_error"]
    assert out["entries"] == [".zerotrain-lock.json", "latest", "small"], out["entries"]  # no partial "failed"
    assert_weights_equal(out["loaded"], out["saved"], rtol=0, atol=0, what="reloaded")
    for name, tensor in out["from_files"].items():  # each whole tensor, as safetensors reads it
        want = out["saved"].get(name)
        if want is not None:
            assert torch.equal(tensor.float(), want), name
    for result in results:
        for got, want in zip(result["loaded_state"], result["saved_state"]):
            assert set(got) == set(want) == {"step", "exp_avg", "exp_avg_sq"}
            for key in want:
                assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(want[key])), key


def two_async_saves(save_dir: str) -> dict:
    engine = make_engine(stage=2, async_save=True)
    train(engine, 0, 1)
    engine.save_checkpoint(save_dir, tag="a")
    engine.wait_checkpoint()
    buffers = engine.checkpointer.buffers
    first = (buffers.allocations, buffers.addresses(), buffers.nbytes())
    train(engine, 1, 1)
    at_second = engine.full_state_dict()
    engine.save_checkpoint(save_dir, tag="b")
    train(engine, 2, 1)  # moves on while "b" is written from the reused buffers
    engine.wait_checkpoint()
    second = (buffers.allocations, buffers.addresses(), buffers.nbytes())
    fresh = make_engine(stage=2, seed=9)
    fresh.load_checkpoint(save_dir)
    return {"first": first, "second": second, "at_second": at_second, "loaded": fresh.full_state_dict()}


def test_async_host_buffers_are_reused_between_saves(tmp_path):
    results = run_distributed(two_async_saves, 2, str(tmp_path / "ckpt"))
    for out in results:
        allocations, addresses, nbytes = out["first"]
        assert allocations > 0 and nbytes > 0 and addresses
        assert out["second"] == out["first"]  # no new buffer, the same memory, the same size
    # What the reused buffers held is the state at the second save (rank 0 holds the full weights).
    assert_weights_equal(results[0]["loaded"], results[0]["at_second"], rtol=0, atol=0, what="second save")
