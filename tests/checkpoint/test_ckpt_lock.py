"""One writer per save directory (zerotrain.checkpoint.lock), with real processes holding and taking the lock, forked
from the test forkserver (`start_python`, `run_python`: a fresh interpreter's import outlasted the test's limit on
a loaded machine)."""
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
    return run_python(["-c", _TAKE, str(save_dir)], env=_env(**env), timeout=300)  # its own process


def _wait_for_lock(save_dir: Path, holder) -> None:
    """Until `holder` (a process taking the lock, forked from the test forkserver) has written the lock file whole
    (it is created exclusively, then written: it can be seen empty first)."""
    deadline = time.monotonic() + 240
    while True:
        try:
            if "pid" in json.loads((save_dir / ".zerotrain-lock.json").read_text()):
                return
        except (OSError, ValueError):
            pass
        assert holder.poll() is None and time.monotonic() < deadline, holder.communicate()
        time.sleep(0.05)


def test_a_second_job_is_refused_naming_the_holder_and_a_stale_lock_is_taken_over(tmp_path):
    holder = start_python(["-c", _HOLD, str(tmp_path), "600"], env=_env(TORCHELASTIC_RUN_ID="job-a"))
    try:
        _wait_for_lock(tmp_path, holder)
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
    stale = start_python(["-c", _HOLD, str(tmp_path), "0"], env=_env(TORCHELASTIC_RUN_ID="job-c"))
    assert stale.wait(300) == 0, stale.communicate()  # exits holding the lock (no release): its process is gone
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


def _write_lock(save_dir: Path, **record) -> Path:
    import socket

    from zerotrain.checkpoint.lock import LOCK_FILE

    path = save_dir / LOCK_FILE
    save_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict({"host": socket.gethostname(), "since": "then"}, **record)))
    return path


def test_a_reused_pid_is_told_apart_by_its_start_time(tmp_path, monkeypatch):
    """In-process: a lock whose pid is alive but was started at another time (the pid reused) is stale and taken
    over; with the live process's own start time it is that process's, and refused naming it."""
    from zerotrain.checkpoint import CheckpointError
    from zerotrain.checkpoint.lock import SaveDirLock, _start_time

    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    parent = os.getppid()  # alive, not this process, its start time readable
    started = _start_time(parent)
    assert started is not None and started.isdigit()
    _write_lock(tmp_path / "reused", job_id="SLURM_JOB_ID=1", pid=parent, pid_start=str(int(started) + 1))
    lock = SaveDirLock(str(tmp_path / "reused"))
    lock.acquire()
    assert lock.held and json.loads(Path(lock.path).read_text())["pid"] == os.getpid()
    lock.release()
    assert not Path(lock.path).exists()
    _write_lock(tmp_path / "live", job_id="SLURM_JOB_ID=1", pid=parent, pid_start=started)
    with pytest.raises(CheckpointError, match=f"job SLURM_JOB_ID=1, pid {parent} on host"):
        SaveDirLock(str(tmp_path / "live")).acquire()


def test_release_leaves_a_lock_another_process_of_the_job_took_over(tmp_path, monkeypatch):
    """In-process: after an elastic restart the same job's new process re-entered the lock (its pid in the file);
    the old process's release must not delete it. Its own lock it deletes."""
    from zerotrain.checkpoint.lock import SaveDirLock

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "restarted")
    lock = SaveDirLock(str(tmp_path))
    lock.acquire()
    record = json.loads(Path(lock.path).read_text())
    assert record["job_id"] == "TORCHELASTIC_RUN_ID=restarted" and record["pid"] == os.getpid()
    _write_lock(tmp_path, **dict(record, pid=os.getpid() + 1))  # the restarted process's record
    lock.release()
    assert Path(lock.path).exists() and not lock.held
    lock.acquire()  # the same job: re-entered, now this process's again
    lock.release()
    assert not Path(lock.path).exists()


def test_a_lock_of_another_users_process_is_never_taken_over(tmp_path, monkeypatch):
    """In-process: `kill(pid, 0)` refused (EPERM: the holder runs as another user; as root here, the kernel's
    answer is played by `os.kill`) means the process exists: the lock is refused, not taken over as stale."""
    from zerotrain.checkpoint import CheckpointError
    from zerotrain.checkpoint.lock import SaveDirLock

    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    other_users = 4_000_000  # above pid_max: no process of ours
    kill = os.kill

    def kill_as_another_user(pid, sig):
        if pid == other_users:
            raise PermissionError(1, "Operation not permitted")
        return kill(pid, sig)

    monkeypatch.setattr(os, "kill", kill_as_another_user)
    path = _write_lock(tmp_path, job_id="PBS_JOBID=7", pid=other_users, pid_start="1")
    with pytest.raises(CheckpointError, match=f"job PBS_JOBID=7, pid {other_users} on host"):
        SaveDirLock(str(tmp_path)).acquire()
    assert json.loads(path.read_text())["pid"] == other_users
