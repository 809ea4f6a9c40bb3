"""zerotrain.lifecycle in-process: a stopped rank's exit status under torchrun and outside it, the stop file the
launcher reads, the signal handlers a StopRequest installs and gives back, one stop line per job.

(tests/test_lifecycle.py runs the real `zerotrain train` with real signals; these are the rules one at a time.)
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from zerotrain import lifecycle
from zerotrain.lifecycle import StopRequest, parse_signals, read_stop_file


def test_a_stop_exits_0_under_torchrun_and_128_plus_the_signal_outside_it(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not lifecycle.under_torchrun()
    assert StopRequest.exit_status("SIGTERM") == 143
    assert StopRequest.exit_status("SIGUSR1") == 128 + int(signal.SIGUSR1)
    assert StopRequest.exit_status(None) == 0 and StopRequest.exit_status("SIGBOGUS") == 0
    # torchrun's agent restarts a worker that exits non-zero: a stop must exit 0 there, whatever the signal
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert lifecycle.under_torchrun()
    assert StopRequest.exit_status("SIGTERM") == 0 and StopRequest.exit_status("SIGHUP") == 0


def test_the_stop_file_carries_the_signal_and_the_whole_message(tmp_path, monkeypatch):
    stop = StopRequest()
    monkeypatch.delenv(lifecycle.STOP_FILE_ENV, raising=False)
    assert stop.tell_launcher("SIGTERM", "saved") is False  # no launcher listening
    path = tmp_path / "stop"
    monkeypatch.setenv(lifecycle.STOP_FILE_ENV, str(path))
    assert stop.tell_launcher("SIGUSR1", "saved at step 3\nresume with --resume") is True
    assert read_stop_file(str(path)) == (signal.SIGUSR1, "saved at step 3\nresume with --resume")
    monkeypatch.setenv(lifecycle.STOP_FILE_ENV, str(tmp_path / "no-such-dir" / "stop"))
    assert stop.tell_launcher("SIGTERM", "saved") is False  # unwritable: the launcher reports its own view
    assert read_stop_file(str(tmp_path / "missing")) is None
    (tmp_path / "empty").write_text("")
    assert read_stop_file(str(tmp_path / "empty")) is None
    (tmp_path / "odd").write_text("SIGBOGUS\nmessage\n")
    assert read_stop_file(str(tmp_path / "odd")) is None


def test_signals_are_parsed_from_names_numbers_and_defaults_once_each():
    assert parse_signals(None) == (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
    assert parse_signals("usr1,SIGTERM, term,") == (signal.SIGUSR1, signal.SIGTERM)
    assert parse_signals([int(signal.SIGHUP), signal.SIGINT, "SIGHUP"]) == (signal.SIGHUP, signal.SIGINT)
    with pytest.raises(ValueError, match="'STOP'"):
        parse_signals(["SIGTERM", "STOP"])


def test_install_takes_the_signals_and_uninstall_gives_the_old_handlers_back():
    def mine(signum, frame):
        pass

    old = {sig: signal.signal(sig, mine) for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)}
    try:
        stop = StopRequest().install("SIGUSR1,SIGUSR2")
        assert signal.getsignal(signal.SIGUSR1) == stop._handle and signal.getsignal(signal.SIGUSR2) == stop._handle
        assert signal.getsignal(signal.SIGHUP) is mine
        stop.install("SIGUSR2,SIGHUP")  # a second call changes the set: SIGUSR1 gets its handler back
        assert signal.getsignal(signal.SIGUSR1) is mine
        assert signal.getsignal(signal.SIGUSR2) == stop._handle and signal.getsignal(signal.SIGHUP) == stop._handle
        stop.uninstall()
        assert all(signal.getsignal(sig) is mine for sig in old)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def test_the_first_signal_is_the_request_and_rank_0_alone_says_so(monkeypatch, capfd):
    monkeypatch.setenv("RANK", "1")
    stop = StopRequest()
    assert not stop.requested and stop.signal_name is None
    stop.request(signal.SIGUSR1)
    assert stop.requested and stop.signal_name == "SIGUSR1"
    stop.request(signal.SIGTERM)  # within the repeat window: the same stop, neither exit nor a new name
    assert stop.signal_name == "SIGUSR1"
    assert "stopping at the next step boundary" not in capfd.readouterr().err
    monkeypatch.setenv("RANK", "0")
    StopRequest().request(signal.SIGTERM)
    assert capfd.readouterr().err.count("received SIGTERM: stopping at the next step boundary") == 1


_ORPHAN = """
import ctypes, os, sys, time
from zerotrain.lifecycle import die_with_parent
armed = die_with_parent(poll_seconds=0.1)
print("armed" if armed else "not armed", flush=True)
ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG 0: the kernel's hook off, the watcher thread alone
open(sys.argv[1], "w").close()
time.sleep(30)
print("not reached", flush=True)
"""

_PARENT = """
import subprocess, sys, time, os
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=open(sys.argv[3], "w"),
                         stderr=subprocess.STDOUT)
print(child.pid, flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
os._exit(0)  # the launcher dies; the rank must follow
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has ended
    except OSError:
        return True


def test_a_rank_whose_launcher_dies_exits_by_the_watcher_when_the_kernel_hook_is_off(tmp_path):
    import subprocess
    import sys
    import time

    ready, out = tmp_path / "ready", tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    parent = subprocess.run([sys.executable, "-c", _PARENT, _ORPHAN, str(ready), str(out)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert parent.returncode == 0, parent.stderr
    pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 20
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    text = out.read_text()
    assert _gone(pid), text
    assert text.startswith("armed\n"), text  # Linux: prctl(PR_SET_PDEATHSIG) was set
    assert "died; this rank exits without saving" in text and "not reached" not in text
