"""One writer per save directory (zerotrain.checkpoint.lock), with real processes holding the lock (those that
only try to take it are forked from the test forkserver, `run_python`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distributed import run_cli, run_python, start_python

REPO = Path(__file__).resolve().parents[2]

_HOLD = """
import sys, time
from zerotrain.checkpoint.lock import SaveDirLock
lock = SaveDirLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""

_TAKE = """
import sys
from zerotrain.checkpoint import CheckpointError
from zerotrain.checkpoint.lock import SaveDirLock
lock = SaveDirLock(sys.argv[1])
try:
    lock.acquire()
except CheckpointError as error:
    print("refused:", error)
    sys.exit(3)
print("took it")
lock.release()
"""


def _env(**extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **extra)
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID"):
        if var not in extra:
            env.pop(var, None)
    return env


def _take(save_dir: Path, **env: str) -> subprocess.CompletedProcess:
    return run_python(["-c", _TAKE, str(save_dir)], env=_env(**env), timeout=60)  # its own process


def test_a_second_job_is_refused_naming_the_holder_and_a_stale_lock_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path), "30"], env=_env(TORCHELASTIC_RUN_ID="job-a"),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        record = json.loads((tmp_path / ".zerotrain-lock.json").read_text())
        assert record["pid"] == holder.pid and record["job_id"] == "TORCHELASTIC_RUN_ID=job-a"

        other = _take(tmp_path, TORCHELASTIC_RUN_ID="job-b")
        assert other.returncode == 3, other.stdout + other.stderr
        assert f"job TORCHELASTIC_RUN_ID=job-a, pid {holder.pid} on host" in other.stdout
        assert str(tmp_path) in other.stdout

        same_job = _take(tmp_path, TORCHELASTIC_RUN_ID="job-a")  # an elastic restart of the holder's job
        assert same_job.returncode == 0 and "took it" in same_job.stdout, same_job.stdout + same_job.stderr
    finally:
        holder.kill()
        holder.wait()

    # the holder wrote the lock again? no: the restart took it and released it; make a stale one by hand
    stale = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path), "0"], env=_env(TORCHELASTIC_RUN_ID="job-c"),
                             stdout=subprocess.PIPE, text=True)
    stale.communicate(timeout=60)  # exits holding the lock (no release): its process is gone
    assert json.loads((tmp_path / ".zerotrain-lock.json").read_text())["job_id"] == "TORCHELASTIC_RUN_ID=job-c"
    taken = _take(tmp_path, TORCHELASTIC_RUN_ID="job-d")
    assert taken.returncode == 0, taken.stdout + taken.stderr
    assert "taking over the stale checkpoint lock" in taken.stderr
    assert not (tmp_path / ".zerotrain-lock.json").exists()  # released by its holder


def test_lock_from_another_host_is_never_guessed_stale(tmp_path):
    (tmp_path / ".zerotrain-lock.json").write_text(json.dumps(
        {"host": "some-other-node", "job_id": "SLURM_JOB_ID=77", "pid": 1, "pid_start": None, "since": "then"}))
    refused = _take(tmp_path, SLURM_JOB_ID="78")
    assert refused.returncode == 3
    assert "on another host" in refused.stdout and "some-other-node" in refused.stdout


def test_second_train_command_on_the_same_save_dir_is_refused_before_training(tmp_path):
    cmd = [sys.executable, "-m", "zerotrain.cli", "train", "--config", str(REPO / "examples/zero2.json"),
           "--model", "tiny", "--max-corpus-bytes", "200000", "--val-fraction", "0", "--save-dir", str(tmp_path)]
    first = start_python([*cmd[1:], "--steps", "100000"], env=_env())  # forked from the test forkserver
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / ".zerotrain-lock.json").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        second = run_cli([*cmd[3:], "--steps", "2"], env=_env(), timeout=120)
        assert second.returncode == 1, second.stdout + second.stderr
        assert "another job writes checkpoints to" in second.stderr and f"pid {first.pid}" in second.stderr
        assert "step 1" not in second.stdout  # refused before training
    finally:
        first.kill()
        first.wait()
