"""The torchrun agent as the `zerotrain` commands run it, and the error files that carry a rank's usage error to
the launcher as one line.

A worker that stops on a usage error (a `CLIError`, config or checkpoint error: one line, no traceback) writes the
line to its torchelastic error file (`TORCHELASTIC_ERROR_FILE`, in the format of torchelastic's `ErrorHandler`,
marked as ours) and exits with its status without printing. The agent, ``python -m zerotrain.elastic`` (torchrun's
own `run` inside), copies that rank's file to its own error file, as torchrun's ``@record`` does, and ends quietly
when every failure is such an error or a peer the agent stopped; the launcher (`command.run_torchrun`) reads the
file and prints the line once. A stop signal ends the agent quietly too (the launcher reports the stop). Any
other failure keeps torchrun's whole report (its log lines, failure table and traceback).

Why our own agent entry point: torchrun prints a ``ChildFailedError`` table and traceback, and its elastic agent
logs a line per stopped worker, for every failure; a usage error in one rank of many read as 40-70 lines.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import Optional, Sequence

__all__ = ["AGENT_ENV", "ERROR_FILE_ENV", "record_usage_error", "record_failure", "read_usage_error", "agent_main",
           "stop_left_workers"]

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
AGENT_ENV = "ZEROTRAIN_ELASTIC_AGENT"  # set for the agent (and so its workers) that `command.run_torchrun` starts
_MARK = "zerotrain_usage_error"  # in the error file's message: the exit status of a one-line usage error
# What torchelastic logs about the workers it stops or lost (held back; shown only with torchrun's full report).
_HELD_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")
_HELD_MESSAGES = ("failed (exitcode", "Sending process", "Received %s death signal", "Received {} death signal")


def record_usage_error(message: str, status: int) -> bool:
    """In a worker under an agent: write the one-line `message` (exit status `status`) to this rank's error file;
    False when there is no error file (not started by an agent: the caller prints it itself)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    data = {"message": {"message": message, "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))},
                        _MARK: int(status)}}
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle)
    return True


def record_failure(exc: BaseException) -> bool:
    """In a rank's ``except`` block, for an exception that is not a usage error: what torchrun's ``@record`` does,
    `exc` and its traceback written to this rank's error file (torchelastic's format), so the agent's failure
    report names the exception under the rank instead of ``error_file: <N/A>``. True when the rank should end with
    status 1 without printing the traceback itself: under our agent (`AGENT_ENV`) with no restart left, whose
    report shows it once; False otherwise (no error file, or a restart ahead that would not show it): the caller
    re-raises, as ``@record`` does."""
    if not os.environ.get(ERROR_FILE_ENV):
        return False
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    get_error_handler().record_exception(exc)
    restarts_left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) - \
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return os.environ.get(AGENT_ENV) == "1" and restarts_left <= 0


def _usage_error(data) -> Optional[tuple[str, int]]:
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict) and isinstance(message.get(_MARK), int):
        return str(message.get("message", "")), message[_MARK]
    return None


def read_usage_error(path: str) -> Optional[tuple[str, int]]:
    """``(line, exit status)`` of the usage error an agent copied to `path`; None for anything else."""
    try:
        with open(path, encoding="utf-8") as handle:
            return _usage_error(json.load(handle))
    except (OSError, ValueError):
        return None


class _HoldBack(logging.Filter):
    """Keeps torchelastic's lines about stopped and failed workers until the run's outcome is known."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(_HELD_MESSAGES):
            self.held.append(record)
            return False
        return True


def _children() -> list[int]:
    """This process's child processes (Linux: /proc/self/task/*/children); [] where /proc does not say."""
    found: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children", encoding="ascii") as handle:
                found += [int(pid) for pid in handle.read().split()]
        except OSError:
            continue
    return found


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # torchrun starts each worker in its own session: its group, its children too
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _ended(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:  # reaped already (or not ours)
        return True


def stop_left_workers(sig: int, timeout: float) -> tuple[list[int], list[int]]:
    """After a stop signal ended torchrun's agent in this process: `sig` to every child process still there, and
    SIGKILL to those still running `timeout` seconds later; returns (the children signalled, those killed).

    torch's agent registers its stop handlers before it spawns the workers but holds their context only once
    `start_processes` returns: a signal in between (a preemption at the job's start; a worker that is quick)
    raises out of the start, the agent's shutdown finds nothing to close and the workers run on without it. In
    the normal case the agent has stopped and reaped them: there is no child left and this does nothing."""
    children = _children()
    for pid in children:
        _signal_group(pid, sig)
    deadline = time.monotonic() + timeout
    left = [pid for pid in children if not _ended(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if not _ended(pid)]
    for pid in left:
        _signal_group(pid, signal.SIGKILL)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    return children, left


def agent_main(argv: Sequence[str]) -> int:
    """torchrun (``python -m torch.distributed.run ARGV``) with a quiet end for usage errors and stop signals."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, get_error_handler
    from torch.distributed.run import parse_args, run

    handler = get_error_handler()
    handler.initialize()
    hold = _HoldBack()
    loggers = [logging.getLogger(name) for name in _HELD_LOGGERS]
    for logger in loggers:
        logger.addFilter(hold)
    args = parse_args(list(argv))
    try:
        run(args)
        return 0
    except SignalException as stop:  # forwarded to the workers, which saved and stopped: the launcher reports it
        timeout = args.shutdown_timeout if args.shutdown_timeout is not None else 30
        stop_left_workers(int(stop.sigval), float(timeout))  # none, unless the signal came while they started
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:
        usage = {rank: f for rank, f in failed.failures.items() if _usage_error(f.error_file_data) is not None}
        if usage and all(rank in usage or f.exitcode < 0 for rank, f in failed.failures.items()):
            rank = min(usage, key=lambda r: (usage[r].timestamp, r))
            handler.dump_error_file(usage[rank].error_file, usage[rank].exitcode)
            return usage[rank].exitcode
        for logger in loggers:
            logger.removeFilter(hold)
        for record in hold.held:
            logging.getLogger(record.name).handle(record)
        _, first = failed.get_first_failure()
        if first.error_file != "<N/A>":
            handler.dump_error_file(first.error_file, first.exitcode)
        raise  # torchrun's own report
    finally:
        for logger in loggers:
            logger.removeFilter(hold)


if __name__ == "__main__":
    sys.exit(agent_main(sys.argv[1:]))
