"""zerotrain.comm.at_exit: at the interpreter's exit, gloo's worker threads are let run until each is parked.

Real gloo workers cannot be made to stall on demand, so the decision is tested on scripted looks at the threads
(`look=`), and what a look sees on threads of this process that name themselves as gloo's workers are named."""
from __future__ import annotations

import ctypes
import itertools
import threading
import time

from distributed import run_python

from zerotrain.comm.at_exit import QUIET_POLLS, WORKER_NAME, wait_for_idle_gloo_workers, worker_signatures

_PR_SET_NAME = 15


def _named_waiting(release: threading.Event) -> tuple[threading.Thread, threading.Event]:
    """A daemon thread that names itself as gloo's workers are named, then waits for `release`."""
    named = threading.Event()

    def run() -> None:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, WORKER_NAME.encode(), 0, 0, 0)
        named.set()
        release.wait()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, named


def _script(*looks: dict) -> tuple[list, callable]:
    """A `look` that returns `looks` in turn, then the last one forever; and the list of looks it gave."""
    given: list = []
    sequence = itertools.chain(looks, itertools.repeat(looks[-1]))

    def look() -> dict:
        given.append(next(sequence))
        return given[-1]
    return given, look


def test_parked_workers_end_the_wait_after_the_quiet_looks():
    parked = {"11": ("S", "40", "2"), "12": ("S", "7", "0")}
    given, look = _script(parked)
    assert wait_for_idle_gloo_workers(5.0, 0.001, look) is True
    assert len(given) == 1 + QUIET_POLLS  # the first look, then QUIET_POLLS unchanged ones


def test_no_worker_ends_the_wait_at_the_first_look():
    given, look = _script({})
    assert wait_for_idle_gloo_workers(5.0, 0.001, look) is True and len(given) == 1


def test_a_running_or_switching_worker_holds_the_wait_until_its_bound():
    running = {"11": ("S", "40", "2"), "12": ("R", "7", "0")}  # running, nothing else changes
    assert wait_for_idle_gloo_workers(0.1, 0.001, _script(running)[1]) is False
    switching = ({"11": ("S", str(n), "2")} for n in itertools.count())  # asleep at each look, yet it ran between
    assert wait_for_idle_gloo_workers(0.1, 0.001, lambda: next(switching)) is False
    preempted = ({"11": ("S", "40", str(n))} for n in itertools.count())
    assert wait_for_idle_gloo_workers(0.1, 0.001, lambda: next(preempted)) is False


def test_the_quiet_count_starts_again_when_a_worker_moves():
    parked, moved = {"11": ("S", "40", "2")}, {"11": ("S", "41", "2")}
    looks = [parked] * QUIET_POLLS + [moved] + [moved] * QUIET_POLLS
    given, look = _script(*looks)
    assert wait_for_idle_gloo_workers(5.0, 0.001, look) is True
    assert len(given) == 2 * QUIET_POLLS + 1


def test_a_look_sees_this_process_s_gloo_workers_asleep_and_nothing_without_a_thread_list(tmp_path):
    assert worker_signatures(str(tmp_path / "missing")) == {}
    before = worker_signatures()
    release = threading.Event()
    thread, named = _named_waiting(release)
    try:
        named.wait(5)
        assert wait_for_idle_gloo_workers(5.0) is True  # a real worker-named thread, once it waits: parked
        new = {tid: signature for tid, signature in worker_signatures().items() if tid not in before}
        assert len(new) == 1, new
        state, voluntary, involuntary = next(iter(new.values()))
        assert state == "S" and voluntary.isdigit() and involuntary.isdigit(), new
    finally:
        release.set()
        thread.join(5)


def test_a_real_worker_that_keeps_waking_is_never_parked():
    """A thread asleep whenever it is looked at, but woken every 2 ms (a worker taking the GIL to drop a
    collective, a collective's rounds): the wait sleeps between looks, so its switches move and it never
    counts as parked."""
    stop = threading.Event()

    def wake_often() -> None:
        while not stop.is_set():
            time.sleep(0.002)
    named = threading.Event()

    def run() -> None:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, WORKER_NAME.encode(), 0, 0, 0)
        named.set()
        wake_often()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        named.wait(5)
        assert wait_for_idle_gloo_workers(0.3) is False
    finally:
        stop.set()
        thread.join(5)


_BUSY_AT_EXIT = f"""
import ctypes, threading
import zerotrain.comm

named = threading.Event()

def spin():
    ctypes.CDLL(None).prctl({_PR_SET_NAME}, {WORKER_NAME.encode()!r}, 0, 0, 0)
    named.set()
    while True:
        sum(range(1000))

threading.Thread(target=spin, daemon=True).start()
named.wait(60)  # named before the exit looks for it
print("done")
"""


def test_importing_zerotrain_comm_waits_at_exit_and_says_so_when_a_worker_stays_busy():
    """The wait runs at exit in any process that imported zerotrain's collectives; a worker still running after
    its bound is named in one line (the process still ends with its own status)."""
    proc = run_python(["-c", _BUSY_AT_EXIT], timeout=120)
    assert proc.returncode == 0 and proc.stdout == "done\n", proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("zerotrain:")]
    assert len(said) == 1 and "gloo worker thread is still busy 2 s into this process's exit" in said[0], proc.stderr
