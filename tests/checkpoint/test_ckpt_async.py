"""Async save: training goes on during the write, wait commits, writer failures surface on the next call."""
from __future__ import annotations

import os
import threading
import time

from ckpt_common import assert_weights_equal, make_engine, train
from distributed import run_distributed


def async_run(save_dir: str) -> dict:
    import zerotrain.checkpoint.write as write
    from zerotrain.checkpoint import CheckpointError

    rank = int(os.environ["RANK"])
    original = write.SaveJob._write_in_place
    out: dict = {}
    engine = make_engine(stage=2, async_save=True)
    train(engine, 0, 2)
    at_save = engine.full_state_dict()

    release, written = threading.Event(), threading.Event()

    def held(self, *args, **kwargs):  # the write waits for the test (at most 60 s: a blocking save then fails)
        release.wait(60)
        result = original(self, *args, **kwargs)
        written.set()
        return result

    write.SaveJob._write_in_place = held
    path = engine.save_checkpoint(save_dir, tag="async")
    out["written_at_return"] = written.is_set()
    out["visible_at_return"] = os.path.exists(path)
    train(engine, 2, 2)  # the weights move on while the save is written
    out["visible_after_training"] = os.path.exists(path)
    release.set()
    engine.wait_checkpoint()
    out["committed"] = os.path.exists(os.path.join(path, "manifest.json"))
    out["latest"] = open(os.path.join(save_dir, "latest")).read()
    # the whole tensors outside the slots (buffers, the frozen layer) each copied by the one rank that writes them
    out["extras_copied"] = sorted(key[1] for key in engine.checkpointer.buffers.addresses() if key[0] == "extra")
    write.SaveJob._write_in_place = original
    fresh = make_engine(stage=1, seed=9)
    fresh.load_checkpoint(save_dir)
    out["loaded"], out["at_save"] = fresh.full_state_dict(), at_save

    def broken(self, *args, **kwargs):
        if self.comm.rank == 1:
            raise OSError("disk on fire (injected)")
        return original(self, *args, **kwargs)

    # A failed background write surfaces on a following engine.step(), on every rank at the same step.
    write.SaveJob._write_in_place = broken
    engine.save_checkpoint(save_dir, tag="broken")
    out["step_error"] = None
    for attempt in range(200):
        try:
            train(engine, 4, 1)
        except CheckpointError as error:
            out["step_error"], out["failed_at_attempt"] = str(error), attempt
            break
    # ... or on wait_checkpoint().
    engine.save_checkpoint(save_dir, tag="broken2")
    try:
        engine.wait_checkpoint()
        out["wait_error"] = None
    except CheckpointError as error:
        out["wait_error"] = str(error)
    write.SaveJob._write_in_place = original
    engine.wait_checkpoint()  # nothing pending, nothing raised twice
    # A client_state that cannot be stored is refused on every rank before anything is written.
    try:
        engine.save_checkpoint(save_dir, tag="bad_state", client_state={"sampler": object()})
        out["client_state_error"] = None
    except CheckpointError as error:
        out["client_state_error"] = str(error)
    # The engine saves again after failures; nothing half-written is left behind.
    engine.save_checkpoint(save_dir, tag="after", async_save=False)
    out["latest_after"] = open(os.path.join(save_dir, "latest")).read()
    out["entries"] = sorted(os.listdir(save_dir)) if rank == 0 else None
    return out


def test_async_save_overlaps_training_and_surfaces_errors(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    results = run_distributed(async_run, 2, save_dir)
    out = results[0]
    assert not out["written_at_return"] and not out["visible_at_return"]  # the call did not wait for the write
    assert not out["visible_after_training"]  # two training steps ran while the writer was still busy
    assert out["committed"] and out["latest"] == "async"
    copied = [name for result in results for name in result["extras_copied"]]
    assert copied and len(copied) == len(set(copied)), [result["extras_copied"] for result in results]
    assert_weights_equal(out["loaded"], out["at_save"], rtol=0, atol=0, what="async snapshot")
    for rank, result in enumerate(results):
        assert result["step_error"] and "failed on rank 1" in result["step_error"], (rank, result["step_error"])
        assert "disk on fire" in result["step_error"]
        assert result["wait_error"] and "disk on fire" in result["wait_error"]
        assert "client_state['sampler']" in result["client_state_error"], result["client_state_error"]
        assert result["client_state_error"].startswith("cannot save checkpoint bad_state (rank 0): ")  # the rank
    assert results[0]["failed_at_attempt"] == results[1]["failed_at_attempt"]
    assert out["latest_after"] == "after"
    assert out["entries"] == [".zerotrain-lock.json", "after", "async", "latest"]  # the job holds the lock


def hold_copies_until_a_fence_waits(snapshot, fence_module) -> tuple:
    """Patch the snapshot copy to start only once something waits at a snapshot fence, then take 0.3 s more, so
    the first fence's wait is > 0.2 s however loaded the machine is (no race between the copy and the writer).
    Returns (restore, copied): `copied` is set once the copy is done."""
    original_complete, original_wait = snapshot.Sources.complete, fence_module.SnapshotFence.wait
    waiting, copied = threading.Event(), threading.Event()

    def complete(self):
        waiting.wait(60)  # a save that blocked on its own copy would wait here 60 s, then fail its test
        time.sleep(0.3)
        result = original_complete(self)
        copied.set()
        return result

    def wait(self):
        waiting.set()
        return original_wait(self)

    snapshot.Sources.complete, fence_module.SnapshotFence.wait = complete, wait

    def restore():
        snapshot.Sources.complete, fence_module.SnapshotFence.wait = original_complete, original_wait
    return restore, copied


def fenced_run(save_dir: str) -> dict:
    """The snapshot copy is slowed down: the next optimizer update must wait for it (stage 3)."""
    import zerotrain.checkpoint.snapshot as snapshot
    from ckpt_common import optimizer_state

    import zerotrain.checkpoint.fence as fence_module

    engine = make_engine(stage=3, async_save=True)
    train(engine, 0, 2)
    at_save, state_at_save = engine.full_state_dict(), optimizer_state(engine)
    restore, copied = hold_copies_until_a_fence_waits(snapshot, fence_module)
    engine.save_checkpoint(save_dir, tag="fenced")
    copied_at_return = copied.is_set()
    train(engine, 2, 2)  # the first step() waits for the copy, then moves the weights on
    fence_seconds = engine.checkpointer.last_fence_seconds
    moved = engine.full_state_dict()
    engine.wait_checkpoint()
    engine.save_checkpoint(save_dir, tag="sync", async_save=False)
    sync_fence_seconds = engine.checkpointer.last_fence_seconds
    restore()
    fresh = make_engine(stage=3, seed=9)
    fresh.load_checkpoint(save_dir, tag="fenced")
    return {"copied_at_return": copied_at_return, "at_save": at_save, "moved": moved, "loaded": fresh.full_state_dict(),
            "state_at_save": state_at_save, "state_loaded": optimizer_state(fresh), "fence_seconds": fence_seconds,
            "sync_fence_seconds": sync_fence_seconds}


def test_async_snapshot_copy_is_fenced_before_the_next_update(tmp_path):
    results = run_distributed(fenced_run, 2, str(tmp_path / "ckpt"))
    out = results[0]
    assert not out["copied_at_return"]  # the copy did not block the call
    for result in results:  # the next step() waited for the slowed copy, and says how long
        assert result["fence_seconds"] > 0.2, result["fence_seconds"]
        assert result["sync_fence_seconds"] == 0.0
    assert any(not (out["moved"][n] == out["at_save"][n]).all() for n in out["at_save"])
    assert_weights_equal(out["loaded"], out["at_save"], rtol=0, atol=0, what="fenced snapshot")
    for result in results:  # every rank's optimizer shard is the one at save time
        for got, want in zip(result["state_loaded"], result["state_at_save"]):
            for key in want:
                assert (got[key] == want[key]).all(), key


def gathered_write_run(save_dir: str) -> dict:
    """GatheredParameters(modifier_rank=0) right after an async save (slowed copy): it must not change the snapshot."""
    import torch

    import zerotrain
    import zerotrain.checkpoint.snapshot as snapshot

    import zerotrain.checkpoint.fence as fence_module

    engine = make_engine(stage=3, async_save=True)
    train(engine, 0, 2)
    at_save = engine.full_state_dict()
    restore, _ = hold_copies_until_a_fence_waits(snapshot, fence_module)
    engine.save_checkpoint(save_dir, tag="gathered")
    weight = engine.module.fc1.weight
    started = time.perf_counter()
    with zerotrain.zero.GatheredParameters([weight], modifier_rank=0):
        if int(os.environ["RANK"]) == 0:
            with torch.no_grad():
                weight.fill_(7.0)
    write_back_seconds = time.perf_counter() - started
    modified = engine.full_state_dict()
    train(engine, 2, 1)
    fence_seconds = engine.checkpointer.last_fence_seconds
    engine.wait_checkpoint()
    restore()
    fresh = make_engine(stage=3, seed=9)
    fresh.load_checkpoint(save_dir)
    return {"at_save": at_save, "modified": modified, "loaded": fresh.full_state_dict(),
            "write_back_seconds": write_back_seconds, "fence_seconds": fence_seconds}


def test_gathered_parameters_write_back_waits_for_the_async_snapshot(tmp_path):
    results = run_distributed(gathered_write_run, 2, str(tmp_path / "ckpt"))
    out = results[0]
    assert (out["modified"]["fc1.weight"] == 7.0).all()  # the write-back happened (shards and masters)
    assert_weights_equal(out["loaded"], out["at_save"], rtol=0, atol=0, what="snapshot under GatheredParameters")
    for result in results:  # the write-back was the first writer: it waited, and the step's fence reports it
        assert result["write_back_seconds"] > 0.2 and result["fence_seconds"] > 0.2, result
