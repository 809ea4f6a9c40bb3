"""gloo's worker threads idle before the interpreter finalizes, for process groups that outlive teardown.

A gloo process group runs its collectives on worker threads (`pt_gloo_runloop`). A worker drops a finished
collective (and with it tensors Python made, which takes the GIL) only after the waiting thread was told it is
done. If that drop comes after the interpreter began to finalize, the worker cannot take the GIL, Python ends the
thread, and the C++ unwind through a `noexcept` destructor aborts the process ("terminate called without an active
exception", SIGABRT after a complete run). A group's destructor joins its workers, so zerotrain destroys its own
groups at teardown and holds none past it (`Comm` holds its group weakly, `release_groups`). A group that other
code keeps alive cannot be destroyed: DeepSpeed's `TorchBackend.barrier(group=GroupMember.WORLD)` binds the world
group into a default argument when `deepspeed.comm` is imported, and accelerate imports it in the middle of every
HF Trainer run where DeepSpeed is installed. For those, `wait_for_idle_gloo_workers` runs at exit (registered when
this package is imported; atexit callbacks run before finalization starts): it lets the workers run, the GIL free,
until every one is parked (sleeping, its context switches unchanged over consecutive polls), so that a worker
descheduled between finishing its last collective and dropping it finishes the drop first.

It also imports `torch.distributed.nn.functional` with zerotrain, before any world starts (below).

Linux only (`/proc/self/task`); elsewhere it returns at once. Where no gloo worker is left it costs one
directory listing.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Callable

# torch.distributed.nn.functional's collectives take `group=group.WORLD` as a default, evaluated at import, and torch
# imports it lazily (the first optimizer built imports torch._dynamo, which imports it). Imported after the world
# group exists, its defaults would hold that group past teardown. Imported with zerotrain (before a script, the HF
# Trainer or zerotrain starts the world), its defaults are None: the world, whichever it is then.
import torch.distributed.nn.functional  # noqa: F401,E402

WORKER_NAME = "pt_gloo_runloop"  # the name torch gives gloo's worker threads
TASKS = "/proc/self/task"
BOUND_SECONDS = 2.0  # the longest an exit waits
POLL_SECONDS = 0.01  # the GIL is free this long between two looks
QUIET_POLLS = 3  # consecutive looks that must find every worker parked and unchanged

Signatures = dict[str, tuple[str, str, str]]


def worker_signatures(tasks: str = TASKS) -> Signatures:
    """{thread id: (state, voluntary, involuntary context switches)} of this process's gloo workers ({} where
    `tasks`, Linux's list of this process's threads, is not there)."""
    signatures = {}
    try:
        threads = os.listdir(tasks)
    except OSError:
        threads = []
    for thread in threads:
        try:
            with open(os.path.join(tasks, thread, "status")) as status:
                fields = {name: value.strip() for name, _, value in (line.partition(":") for line in status)}
        except OSError:  # the thread ended meanwhile
            continue
        if fields["Name"] == WORKER_NAME:
            signatures[thread] = (fields["State"][:1], fields["voluntary_ctxt_switches"],
                                  fields["nonvoluntary_ctxt_switches"])
    return signatures


def wait_for_idle_gloo_workers(timeout_seconds: float = BOUND_SECONDS, poll_seconds: float = POLL_SECONDS,
                               look: Callable[[], Signatures] = worker_signatures) -> bool:
    """Sleep (the GIL free) until every gloo worker thread is parked: asleep ("S"), its context switches unchanged,
    over QUIET_POLLS consecutive looks. True when they are (or none is left), False at the timeout. A worker
    waiting for the GIL takes it while this sleeps, so it cannot look parked; `look` is where the threads are seen."""
    deadline = time.monotonic() + timeout_seconds
    previous, quiet = look(), 0
    while previous and quiet < QUIET_POLLS:
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_seconds)
        current = look()
        parked = all(state == "S" for state, _, _ in current.values())
        quiet = quiet + 1 if parked and current == previous else 0
        previous = current
    return True


def _at_exit() -> None:
    if not wait_for_idle_gloo_workers():
        print(f"zerotrain: a gloo worker thread is still busy {BOUND_SECONDS:g} s into this process's exit (pid "
              f"{os.getpid()}); should it drop a collective's tensors once the interpreter finalizes, the process "
              "aborts", file=sys.stderr)


atexit.register(_at_exit)
