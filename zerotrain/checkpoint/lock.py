"""One writer per save directory: a lock file naming the job that writes there.

A restarted job resumes from its save directory, so a second job, or a leftover rank of an
earlier one, writing checkpoints into the same directory corrupts what the restart reads. The
first save of a job (rank 0) creates ``SAVE_DIR/.zerotrain-lock.json`` exclusively (``O_EXCL``,
which also holds on NFS v3+ and the usual shared file systems) with the holder's host, job id,
pid and process start time. Then:

- the same job (same job id: torchrun's run id, kept across its elastic restarts, else the
  scheduler's job id) re-enters the lock;
- a lock whose process is gone on this host (no such pid, or a pid reused by a process that
  started later) is stale and taken over with a warning;
- anything else is refused with an error naming the holder; a lock held from another host is
  never guessed stale (its process cannot be checked from here): the error says to delete the
  file if that job is gone.

``release`` (engine.close()) deletes the lock if this job still holds it.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Optional

from .format import CheckpointError

__all__ = ["LOCK_FILE", "SaveDirLock", "job_id"]

logger = logging.getLogger("zerotrain")

LOCK_FILE = ".zerotrain-lock.json"


def job_id() -> str:
    """This job's identity, the same on every rank and across elastic restarts where the launcher says so."""
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID"):
        value = os.environ.get(var)
        if value:
            return f"{var}={value}"
    return f"pid={socket.gethostname()}:{os.getpid()}"  # a single process: itself


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: Optional[str]) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    now = _start_time(pid)
    return started is None or now is None or now == started


class SaveDirLock:
    """The lock of one save directory, as held (or not) by this process; used on rank 0 only."""

    def __init__(self, save_dir: str):
        self.save_dir = os.path.abspath(save_dir)
        self.path = os.path.join(self.save_dir, LOCK_FILE)
        self.held = False

    def _record(self) -> dict:
        return {"host": socket.gethostname(), "job_id": job_id(), "pid": os.getpid(),
                "pid_start": _start_time(os.getpid()), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    def _read(self) -> Optional[dict]:
        try:
            with open(self.path, encoding="utf-8") as handle:
                return json.load(handle)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            raise CheckpointError(f"the lock file {self.path} cannot be read ({error}); if no job writes to "
                                  f"{self.save_dir}, delete it") from error

    def _write_new(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(self._record(), handle)
            handle.flush()
            os.fsync(handle.fileno())
        return True

    def _replace(self) -> None:
        temp = f"{self.path}.{os.getpid()}.tmp"
        with open(temp, "w", encoding="utf-8") as handle:
            json.dump(self._record(), handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, self.path)

    def acquire(self) -> None:
        """Hold the lock for this job, or raise CheckpointError naming the holder."""
        if self.held:
            return
        os.makedirs(self.save_dir, exist_ok=True)
        for _ in range(3):  # a racing job may create or replace the file between our steps
            if self._write_new():
                self.held = True
                return
            holder = self._read()
            if holder is None:
                continue
            if holder.get("job_id") == job_id():  # this job again (an elastic restart): re-enter
                self._replace()
                self.held = True
                return
            same_host = holder.get("host") == socket.gethostname()
            pid = int(holder.get("pid") or 0)
            if same_host and pid > 0 and not _alive(pid, holder.get("pid_start")):
                logger.warning("taking over the stale checkpoint lock %s of job %s (pid %s on %s, since %s): "
                               "its process is gone", self.path, holder.get("job_id"), pid, holder.get("host"),
                               holder.get("since"))
                self._replace()
                confirmed = self._read()
                if confirmed is not None and confirmed.get("pid") == os.getpid():
                    self.held = True
                    return
                continue
            where = "" if same_host else " (on another host: it cannot be checked from here)"
            raise CheckpointError(
                f"another job writes checkpoints to {self.save_dir}: job {holder.get('job_id')}, pid {pid} on "
                f"host {holder.get('host')}, since {holder.get('since')}{where}. Use another save directory, stop "
                f"that job, or delete {self.path} if it is gone")
        raise CheckpointError(f"cannot take the checkpoint lock {self.path}: other processes keep changing it")

    def release(self) -> None:
        """Delete the lock if this job holds it (idempotent)."""
        if not self.held:
            return
        self.held = False
        holder = None
        try:
            holder = self._read()
        except CheckpointError:
            pass
        if holder is not None and holder.get("job_id") == job_id() and holder.get("pid") == os.getpid():
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
