"""A save that runs out of disk space: named error, no partial directory, the previous checkpoint intact.

The disk is real: a 1 MiB tmpfs mounted for the test (these machines run as root); where mounting
is refused, each rank caps its file size with RLIMIT_FSIZE instead (EFBIG rather than ENOSPC).
"""
from __future__ import annotations

import os
import resource
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from ckpt_common import GLOBAL_BATCH, MICRO, make_engine
from distributed import run_distributed
from models_for_tests import make_batches, train_global_step


@pytest.fixture
def small_disk(tmp_path):
    """(directory, how): a directory on a 1 MiB file system, or ("rlimit") a plain one to cap by file size."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        yield mount, "rlimit"
        return
    try:
        yield mount, "tmpfs"
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _fill(directory: Path, leave: int) -> None:
    """Write a filler file so that about `leave` bytes stay free."""
    free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
    with open(directory / "filler", "wb") as handle:
        handle.write(b"\0" * max(0, free - leave))


def _disk_full_run(save_dir: str, how: str) -> dict:
    from zerotrain.checkpoint import CheckpointError

    engine = make_engine(2)
    rank = engine.topology.rank
    batches = make_batches(6, GLOBAL_BATCH, seed=3)
    train_global_step(engine, batches[0], MICRO)
    first = engine.save_checkpoint(save_dir)  # fits
    train_global_step(engine, batches[1], MICRO)
    torch.distributed.barrier()
    if how == "tmpfs":
        if rank == 0:
            _fill(Path(save_dir), leave=2048)
    else:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))
    torch.distributed.barrier()
    out = {"first": first}
    try:
        engine.save_checkpoint(save_dir)
    except CheckpointError as error:
        out["error"] = str(error)
    # training goes on after the failed save; an async save's failure surfaces at the next step
    train_global_step(engine, batches[2], MICRO)
    engine.save_checkpoint(save_dir, async_save=True)
    try:
        train_global_step(engine, batches[3], MICRO)
        engine.wait_checkpoint()
    except CheckpointError as error:
        out["async_error"] = str(error)
    # with on_save_error "warn", a failed save is a warning and training goes on
    engine.config.checkpoint.on_save_error = "warn"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["warned_path"] = engine.save_checkpoint(save_dir)
        train_global_step(engine, batches[4], MICRO)
    out["warnings"] = [str(w.message) for w in caught if "checkpoint save failed" in str(w.message)]
    if how == "rlimit":
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    torch.distributed.barrier()
    out["entries"] = sorted(os.listdir(save_dir))
    # the previous checkpoint loads
    fresh = make_engine(2, seed=1)
    path, _ = fresh.load_checkpoint(save_dir)
    out["loaded"] = path
    out["loaded_step"] = fresh.global_steps
    engine.close()
    fresh.close()
    return out


def test_a_save_that_runs_out_of_space_leaves_the_previous_checkpoint(small_disk):
    directory, how = small_disk
    save_dir = str(directory / "ckpt")
    results = run_distributed(_disk_full_run, 2, save_dir, how, timeout=240)
    for out in results:
        reason = "no space left on the device" if how == "tmpfs" else "file too large"
        assert reason in out["error"], out["error"]
        assert "the checkpoint needs about" in out["error"] and "bytes in" in out["error"]
        assert save_dir in out["error"]
        assert reason in out["async_error"], out["async_error"]
        assert out["warned_path"] is None and out["warnings"], out
        assert out["loaded"] == out["first"] and out["loaded_step"] == 1
    entries = results[0]["entries"]
    assert not [e for e in entries if e.startswith(".tmp") or e.endswith(".tmp") or "tmp" in e], entries
    assert (directory / "ckpt" / "latest").read_text().strip() == "global_step1"
