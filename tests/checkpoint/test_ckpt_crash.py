"""Crash safety and rotation: a save killed at any point leaves the last committed checkpoint as `latest`."""
from __future__ import annotations

import glob
import json
import os
import signal

from ckpt_common import make_engine, train
from distributed import run_distributed


RANK_0_ONLY = {"manifest-written", "committed", "latest-written", "replaced-aside"}  # the commit is rank 0's


def _kill_at(point: str, save_dir: str) -> None:
    """SIGKILL this rank when its save reaches `point`: a crash of the whole job there.

    At a point only rank 0 reaches, the other ranks wait in a collective for it; a dead rank 0 would make
    them fail there rather than die. So rank 0 leaves a marker at the point and waits until every other
    rank (watching for the marker in a thread) has left an answer and exited, then dies: the files on disk
    are exactly those of a job killed at `point`."""
    import threading
    import time

    import zerotrain.checkpoint.commit as commit

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    marker = os.path.join(save_dir, f"died-at-{point}")
    answers = [f"{marker}.rank{r}" for r in range(1, world)]

    def wait_for(paths: list[str]) -> None:
        deadline = time.monotonic() + 60
        while not all(os.path.exists(path) for path in paths) and time.monotonic() < deadline:
            time.sleep(0.02)

    def hook(event: str) -> None:
        if event == point:
            if point in RANK_0_ONLY:
                open(marker, "w").close()
                wait_for(answers)
            os.kill(os.getpid(), signal.SIGKILL)

    if point in RANK_0_ONLY and rank > 0:
        def watch() -> None:
            wait_for([marker])
            open(answers[rank - 1], "w").close()
            os._exit(0)

        threading.Thread(target=watch, daemon=True).start()
    commit.fault_hook = hook


def _run_killed(fn, save_dir: str, *args) -> None:
    """Launch `fn(save_dir, *args)` on two ranks that both die; then remove _kill_at's markers."""
    run_distributed(fn, 2, save_dir, *args, expect_exit={0, 1})
    for path in glob.glob(os.path.join(save_dir, "died-at-*")):
        os.remove(path)


def save_two_then_die(save_dir: str) -> None:
    engine = make_engine(stage=2, keep_last=2)
    for tag in ("t1", "t2"):
        train(engine, engine.global_steps, 1)
        engine.save_checkpoint(save_dir, tag=tag)
    train(engine, engine.global_steps, 1)
    _kill_at("round-written", save_dir)  # SIGKILL on both ranks in the middle of writing files
    engine.save_checkpoint(save_dir, tag="t3")


def load_then_die(save_dir: str, point: str, tag: str) -> None:
    """Load `latest` (the previous kill left t2 there), then save `tag` and die at `point`."""
    engine = make_engine(stage=0, seed=5)
    path, _ = engine.load_checkpoint(save_dir)
    assert path.endswith("t2") and engine.global_steps == 2, (path, engine.global_steps)
    _kill_at(point, save_dir)
    engine.save_checkpoint(save_dir, tag=tag)


def load_save_rotate(save_dir: str) -> dict:
    engine = make_engine(stage=0, seed=7, keep_last=2)
    path, _ = engine.load_checkpoint(save_dir)
    out = {"loaded": os.path.basename(path), "steps": engine.global_steps}
    engine.save_checkpoint(save_dir, tag="t8")  # saved twice under one tag: the second replaces the first
    train(engine, engine.global_steps, 1)
    engine.save_checkpoint(save_dir, tag="t8")
    fresh = make_engine(stage=2, seed=8)
    out["reloaded"] = os.path.basename(fresh.load_checkpoint(save_dir)[0])
    out["reloaded_steps"] = fresh.global_steps
    return out


def _latest(save_dir: str) -> str:
    return open(os.path.join(save_dir, "latest")).read()


def _entries(save_dir: str) -> list[str]:
    """The save directory's entries, less the one-writer lock (a killed job leaves its stale lock behind)."""
    from zerotrain.checkpoint.lock import LOCK_FILE
    return sorted(name for name in os.listdir(save_dir) if name != LOCK_FILE)


def test_killed_saves_leave_latest_loadable_and_rotation_keeps_committed(tmp_path):
    """World 2, one synchronous save killed at each point in turn; each launch first loads what the last
    kill left (t2) and checks it."""
    save_dir = str(tmp_path / "ckpt")
    _run_killed(save_two_then_die, save_dir)
    assert _latest(save_dir) == "t2"
    assert glob.glob(os.path.join(save_dir, "t3.zerotrain-tmp-*")) and not os.path.exists(os.path.join(save_dir, "t3"))

    # Killed with every file written on both ranks, before the manifest.
    _run_killed(load_then_die, save_dir, "files-written", "t4")
    [t4_tmp] = glob.glob(os.path.join(save_dir, "t4.zerotrain-tmp-*"))
    assert not os.path.exists(os.path.join(t4_tmp, "manifest.json")) and _latest(save_dir) == "t2"

    # Killed after the manifest was written in the temporary directory, before the rename.
    _run_killed(load_then_die, save_dir, "manifest-written", "t5")
    [t5_tmp] = glob.glob(os.path.join(save_dir, "t5.zerotrain-tmp-*"))
    assert os.path.exists(os.path.join(t5_tmp, "manifest.json")) and _latest(save_dir) == "t2"

    # Killed after the rename, before `latest` was replaced: t6 is complete, latest still names t2.
    _run_killed(load_then_die, save_dir, "committed", "t6")
    assert os.path.exists(os.path.join(save_dir, "t6", "manifest.json")) and _latest(save_dir) == "t2"

    # Killed after `latest` was replaced (before rotation and cleanup): t7 is complete and is latest.
    _run_killed(load_then_die, save_dir, "latest-written", "t7")
    assert os.path.exists(os.path.join(save_dir, "t7", "manifest.json")) and _latest(save_dir) == "t7"

    # A later save (keep_last=2) loads t7, commits t8, rotates t1, t2, t6 out (t7 and t8 are newer), removes the
    # leftovers (the three temporary directories).
    out = run_distributed(load_save_rotate, 2, save_dir)[0]
    assert out == {"loaded": "t7", "steps": 2, "reloaded": "t8", "reloaded_steps": 3}
    assert _entries(save_dir) == ["latest", "t7", "t8"]
    manifest = json.load(open(os.path.join(save_dir, "t8", "manifest.json")))
    assert manifest["global_steps"] == 3 and manifest["world_size"] == 2


def resave_then_die(save_dir: str) -> None:
    """Save t1, train on, save t1 again and die between moving the old t1 aside and renaming the new one in."""
    engine = make_engine(stage=0)
    train(engine, 0, 1)
    engine.save_checkpoint(save_dir, tag="t1")
    train(engine, 1, 1)
    _kill_at("replaced-aside", save_dir)
    engine.save_checkpoint(save_dir, tag="t1")


def load_latest_verified(save_dir: str) -> dict:
    """Load `latest` (checksums verified) into a differently seeded engine; compare with 1 uninterrupted step."""
    from ckpt_common import assert_weights_equal

    from zerotrain.checkpoint import verify_checkpoint

    reference = make_engine(stage=2)
    train(reference, 0, 1)
    engine = make_engine(stage=2, seed=3, verify_on_load=True)
    path, _ = engine.load_checkpoint(save_dir)
    weights, want = engine.full_state_dict(), reference.full_state_dict()  # collectives: every rank
    if int(os.environ["RANK"]) == 0:
        assert_weights_equal(weights, want, what="recovered t1")
    return {"loaded": os.path.basename(path), "steps": engine.global_steps, "verified": verify_checkpoint(save_dir)["ok"]}


def save_other_tag(save_dir: str) -> int:
    """A save of another tag, with no load before it: the save itself restores the interrupted re-save."""
    engine = make_engine(stage=0, seed=4)
    train(engine, 0, 2)
    engine.save_checkpoint(save_dir, tag="t2", save_latest=False)
    return engine.global_steps


def test_killed_resave_of_latest_tag_is_recovered(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    _run_killed(resave_then_die, save_dir)
    # The crash window: `latest` names t1, t1 is gone, the old copy survives aside, the new one is complete aside.
    assert _latest(save_dir) == "t1" and not os.path.exists(os.path.join(save_dir, "t1"))
    [replaced] = glob.glob(os.path.join(save_dir, "t1.zerotrain-replaced-*"))
    assert os.path.exists(os.path.join(replaced, "manifest.json"))
    assert glob.glob(os.path.join(save_dir, "t1.zerotrain-tmp-*"))

    # A load (two ranks at once) restores the old t1 and loads it, checksums verified.
    for out in run_distributed(load_latest_verified, 2, save_dir):
        assert out == {"loaded": "t1", "steps": 1, "verified": True}
    assert not glob.glob(os.path.join(save_dir, "*.zerotrain-replaced-*"))

    # The same crash again; this time the next save (of another tag) restores t1 before it commits.
    _run_killed(resave_then_die, save_dir)
    assert not os.path.exists(os.path.join(save_dir, "t1"))
    assert run_distributed(save_other_tag, 1, save_dir) == [2]
    assert _entries(save_dir) == ["latest", "t1", "t2"] and _latest(save_dir) == "t1"
    assert run_distributed(load_latest_verified, 1, save_dir)[0] == {"loaded": "t1", "steps": 1, "verified": True}


def async_save_then_die(save_dir: str, point: str) -> None:
    """World 2: t1 committed, then an async save of t2 killed at `point` in its writer thread. Rank-0-only points
    (manifest, latest):
    rank 0 leaves a marker file as it dies, and rank 1 (waiting on rank 0's commit) exits when it sees it."""
    import time

    import zerotrain.checkpoint.commit as commit

    rank = int(os.environ["RANK"])
    engine = make_engine(stage=2, async_save=True)
    train(engine, 0, 1)
    engine.save_checkpoint(save_dir, tag="t1")
    engine.wait_checkpoint()
    train(engine, 1, 1)
    marker = os.path.join(save_dir, f"died-at-{point}")
    if rank == 0 or point == "files-written":
        def hook(event: str) -> None:
            if event == point:
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

        commit.fault_hook = hook
    engine.save_checkpoint(save_dir, tag="t2")  # returns at once: the writer thread dies at `point`
    deadline = time.monotonic() + 60
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)  # the survivor of a rank-0-only kill point: like a crash of the whole job


def load_latest(save_dirs: list[str]) -> list[tuple[str, int]]:
    """Load `latest` of each directory into a fresh engine: (the tag loaded, its global steps) of each."""
    loaded = []
    for save_dir in save_dirs:
        engine = make_engine(stage=1, seed=3)
        path, _ = engine.load_checkpoint(save_dir)
        loaded.append((os.path.basename(path), engine.global_steps))
    return loaded


def test_async_save_killed_at_world_2_leaves_the_last_committed_checkpoint(tmp_path):
    """Before the commit (files written on every rank, the manifest written) `latest` still names t1 and t2 is
    only a temporary directory; killed after the rename, t2 is complete but `latest` still names t1; killed
    after `latest` was replaced, t2 is complete and loads. One launch loads every directory at the end."""
    points = (("files-written", "t1", False), ("manifest-written", "t1", False), ("committed", "t1", True),
              ("latest-written", "t2", True))
    for point, want, committed in points:
        save_dir = str(tmp_path / point)
        run_distributed(async_save_then_die, 2, save_dir, point, expect_exit={0, 1})
        assert os.path.exists(os.path.join(save_dir, f"died-at-{point}")), f"{point}: never reached"
        assert _latest(save_dir) == want, point
        assert os.path.exists(os.path.join(save_dir, "t2", "manifest.json")) == committed, point
        if not committed:
            assert glob.glob(os.path.join(save_dir, "t2.zerotrain-tmp-*")), point
    loaded = run_distributed(load_latest, 1, [str(tmp_path / point) for point, _, _ in points])[0]
    assert loaded == [(want, 1 if want == "t1" else 2) for _, want, _ in points], loaded
