"""How a rank's life ends: stop requests by signal, and the death of the process that started it.

Clusters end jobs with signals: SIGTERM (Kubernetes, SLURM at the time limit, `kill`), SIGINT
(Ctrl-C), SIGHUP (a closed terminal), and SIGUSR1 from schedulers that warn before preempting
(SLURM's ``--signal=USR1@60``). A :class:`StopRequest` turns the first of them into a request to
stop at the next step boundary, where every rank agrees on it (the Trainer folds the flag into its
per-step loss all-reduce; a hand-written loop asks ``engine.should_stop()``), saves a committed
checkpoint and exits. A second signal, later than :data:`REPEAT_WINDOW_S` after the first, exits
at once (a signal delivered twice within the window, by a process group kill and by the launcher
forwarding it, counts once).

Exit status: a rank stopped by a signal exits 0 under torchrun, because the elastic agent restarts
workers that exit non-zero and a stop request must never be restarted; the launcher (``zerotrain
train`` / ``zerotrain launch``) learns of the stop through the file named by
``$ZEROTRAIN_STOP_FILE`` and itself exits ``128 + signal number``, as a shell reports a process a
signal ended, so a stop is told apart from a crash (exit 1). A single process outside torchrun
exits ``128 + signal number`` directly.

Parent death: a rank whose launcher dies (even by SIGKILL) must not train on and write into the
directory the restarted job resumes from. :func:`die_with_parent` asks Linux for SIGKILL on parent
death (``prctl(PR_SET_PDEATHSIG)``) and runs a watcher thread that polls the parent pid as a
fallback (other systems, or a parent that died before the prctl).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time
from typing import Iterable, Optional, Union

__all__ = ["DEFAULT_STOP_SIGNALS", "STOP_FILE_ENV", "REPEAT_WINDOW_S", "StopRequest", "parse_signals",
           "die_with_parent", "kill_me_with_parent", "under_torchrun", "read_stop_file"]

logger = logging.getLogger("zerotrain")

DEFAULT_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")
STOP_FILE_ENV = "ZEROTRAIN_STOP_FILE"
REPEAT_WINDOW_S = 2.0
_PR_SET_PDEATHSIG = 1


def parse_signals(spec: Union[str, Iterable[Union[str, int, signal.Signals]], None]) -> tuple[signal.Signals, ...]:
    """Signals from names (``"SIGTERM,USR1"``, a list of names, numbers or Signals); an error names a bad one."""
    if spec is None:
        spec = DEFAULT_STOP_SIGNALS
    items = [s.strip() for s in spec.split(",") if s.strip()] if isinstance(spec, str) else list(spec)
    found = []
    for item in items:
        if isinstance(item, signal.Signals):
            found.append(item)
            continue
        if isinstance(item, int):
            found.append(signal.Signals(item))
            continue
        name = item.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        sig = getattr(signal.Signals, name, None)
        if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"stop signal {item!r} is not a signal a process can handle "
                             f"(use names such as SIGTERM, SIGINT, SIGHUP, SIGUSR1)")
        found.append(sig)
    return tuple(dict.fromkeys(found))


def under_torchrun() -> bool:
    """Whether this process is a worker started by torchrun's elastic agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ


class StopRequest:
    """Signals turned into a request to stop at the next step boundary (see the module docstring)."""

    def __init__(self) -> None:
        self.signal: Optional[signal.Signals] = None
        self._first_at = 0.0
        self._previous: dict[signal.Signals, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def signal_name(self) -> Optional[str]:
        return None if self.signal is None else self.signal.name

    def install(self, signals: Union[str, Iterable, None] = None) -> "StopRequest":
        """Handle `signals` (default: SIGTERM, SIGINT, SIGHUP, SIGUSR1) in this process; main thread only.

        A second call changes the set. Returns self.
        """
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be installed from the main thread")
        wanted = parse_signals(signals)
        for sig in [s for s in self._previous if s not in wanted]:
            signal.signal(sig, self._previous.pop(sig))
        for sig in wanted:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)
        return self

    def uninstall(self) -> None:
        """Put the handlers back as they were before `install`."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def request(self, sig: Union[int, signal.Signals]) -> None:
        """Record a stop request as if `sig` had arrived (what the handler does)."""
        self._handle(int(sig), None)

    def _handle(self, signum: int, frame) -> None:
        sig = signal.Signals(signum)
        now = time.monotonic()
        if self.signal is None:
            self.signal, self._first_at = sig, now
            if os.environ.get("RANK", "0") == "0":  # every rank got it; one says so
                _say(f"zerotrain: received {sig.name}: stopping at the next step boundary "
                     f"(a checkpoint is saved where a save directory is set); send it again to exit at once\n")
            return
        if now - self._first_at < REPEAT_WINDOW_S:
            return  # the same stop delivered twice (process-group kill + launcher forwarding)
        _say(f"zerotrain: received {sig.name} again: exiting now, without saving\n")
        os._exit(128 + signum)

    @staticmethod
    def exit_status(signal_name: Optional[str]) -> int:
        """The status a process exits with after a stop: 0 under torchrun (no restart), else 128+signal."""
        sig = getattr(signal.Signals, signal_name or "", None)
        if sig is None or under_torchrun():
            return 0
        return 128 + int(sig)

    def tell_launcher(self, signal_name: str, message: str) -> bool:
        """Write the stop (signal name and `message`) where the launcher looks for it ($ZEROTRAIN_STOP_FILE);
        True when it is written: the launcher then says the stop line (once, for every rank), the rank need not."""
        path = os.environ.get(STOP_FILE_ENV)
        if not path:
            return False
        try:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(f"{signal_name}\n{message}\n")
        except OSError as error:  # the launcher then reports its own view of the stop
            logger.warning("cannot write the stop file %s: %s", path, error)
            return False
        return True


def read_stop_file(path: str) -> Optional[tuple[signal.Signals, str]]:
    """(signal, message) a worker wrote with `StopRequest.tell_launcher`; None if none."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    if not lines:
        return None
    sig = getattr(signal.Signals, lines[0].strip(), None)
    return (sig, "\n".join(lines[1:])) if sig is not None else None


def _say(text: str) -> None:
    try:
        os.write(sys.stderr.fileno(), text.encode())
    except (OSError, ValueError, AttributeError):
        pass


def kill_me_with_parent() -> None:
    """For `subprocess.Popen(preexec_fn=...)`: the child gets SIGKILL when the launcher dies (Linux)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass


_watcher: Optional[threading.Thread] = None


def die_with_parent(poll_seconds: float = 1.0) -> bool:
    """End this process (SIGKILL) when its parent dies; returns whether the kernel hook was set.

    Idempotent. A process whose parent already died (re-parented before this call) ends at once.
    """
    global _watcher
    parent = os.getppid()
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if parent == 1:  # already orphaned (the parent died before we could ask): nothing to watch for
        _say("zerotrain: the process that started this rank is gone; exiting\n")
        os._exit(1)
    if _watcher is None:
        def watch() -> None:
            while True:
                time.sleep(poll_seconds)
                if os.getppid() != parent:
                    _say(f"zerotrain: the launcher (pid {parent}) died; this rank exits without saving\n")
                    os._exit(1)

        _watcher = threading.Thread(target=watch, name="zerotrain-parent-watch", daemon=True)
        _watcher.start()
    return armed
