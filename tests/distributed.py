"""Run a test function in N real processes over gloo on 127.0.0.1.

`run_distributed(fn, world_size, *args)` starts one process per rank (from a
forkserver that has torch imported already, so each rank starts in well under a
second), sets torchrun's environment variables, calls `fn(*args)` in each, and
returns the per-rank results. If any rank raises, the others are stopped and the
failing rank's traceback is raised in the test; if a rank dies or the whole run
exceeds `timeout` seconds, every rank is stopped and the test fails saying which
ranks never answered. It never hangs.

Tests of failure handling pass `expect_exit={rank, ...}`: those ranks may end their
process without reporting (e.g. `os._exit` to simulate a crash); their result is
None instead of an error.

`run_python(["-m", MODULE or "-c", CODE or SCRIPT.py, *ARGS], cwd=..., env=...)` (and `run_cli(ARGS)` for
`python -m zerotrain.cli ARGS`) runs a command as its own process forked from the same forkserver: its
own working directory, environment, file descriptors 1 and 2 and exit status, without importing torch,
zerotrain and transformers' modeling code again (seconds per command). `start_python(...)` starts one the
test signals or kills (a `subprocess.Popen` stand-in); `serve_commands(bin_dir, {...})` puts commands on a
shell's PATH that run that way (a shell script, e.g. the README's, calling `zerotrain` and `python`).
"""
from __future__ import annotations

import collections
import faulthandler
import fcntl
import importlib
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import random
import contextlib
import runpy
import secrets
import signal
import socket
import subprocess
import tempfile
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        # transformers.modeling_utils: ranks building a Hugging Face model would each import it (seconds per launch);
        # the forkserver skips a preload that fails to import.
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "zerotrain", "transformers.modeling_utils"])
    return _CONTEXT


_PORT_LOCKS: "collections.deque[int]" = collections.deque()  # lock-file fds of the ports this process handed out
_PORTS_HELD = 64  # locks kept: a port's launch has bound it (or ended) long before 64 more ports are handed out


def free_port() -> int:
    """A port for a launch's rendezvous that nothing takes before the launch binds it.

    Not from the kernel's ephemeral range, where every outgoing connection (gloo's pairs, store clients, of all the
    tests running at once) takes its port: a port picked by binding port 0 and closing was taken that way before
    rank 0 listened on it (EADDRINUSE; loop round h5, tests/offload/test_offload_checkpoint.py). Below that range
    (and above Ray's default worker ports, 10002-19999), free now, and locked (a lock file, `flock`) so that no
    other test process hands out the same one: no race is left between test processes, nor with the kernel."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    directory = os.path.join(tempfile.gettempdir(), "zerotrain-test-ports")
    os.makedirs(directory, exist_ok=True)
    chooser = random.Random()
    for _ in range(10000):
        port = chooser.randrange(20000, ephemeral_low)
        fd = os.open(os.path.join(directory, str(port)), os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", port))
        except OSError:  # locked by another test process, or in use
            os.close(fd)
            continue
        _PORT_LOCKS.append(fd)
        while len(_PORT_LOCKS) > _PORTS_HELD:
            os.close(_PORT_LOCKS.popleft())
        return port
    raise RuntimeError(f"tests/distributed.free_port: no free port in 20000-{ephemeral_low - 1}")


def _freeze_inherited_objects() -> None:
    """Moves the objects a forked process inherits (the forkserver's torch, zerotrain and transformers: ~400,000)
    out of the garbage collector's view (`gc.freeze`): they live as long as the process, and every full collection
    (the HF Trainer's `free_memory` and DeepSpeed's ZeRO-3 set-up call `gc.collect()` each time, Python's own run
    as objects pile up) would walk them all again, writing into each one's header: the first walk copies every
    inherited page (copy-on-write) in every rank. Garbage made from here on is collected as before. (A/B on
    tests/zero/test_stage3.py + tests/parallel/test_moe_engine.py, loaded machine: 72 s -> 36 s, 57 s -> 43 s.)"""
    import gc

    gc.freeze()


def freeze_imports(*modules: str) -> None:
    """In a rank: import `modules` (e.g. "trl", "deepspeed") and move every object alive now out of the garbage
    collector's walks (`gc.collect()` first: what earlier runs left is freed, not frozen). For a rank whose runs
    call `gc.collect()` many times (each HF Trainer run, DeepSpeed's ZeRO-3 set-up) after importing libraries
    the forkserver does not hold: in tests/hf's TRL launch 29 full collections walked ~280,000 objects each,
    11 s of a rank's 65 s (loaded machine); 2.4 s once frozen after the imports."""
    import gc

    for module in modules:
        importlib.import_module(module)
    gc.collect()
    gc.freeze()


def _child(rank: int, world_size: int, port: int, sys_path: list, module: str, name: str,
           args: tuple, kwargs: dict, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    sys.path[:] = sys_path
    _freeze_inherited_objects()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_distributed's timeout asks for every stack
    try:
        import torch
        torch.set_num_threads(1)
        fn = getattr(importlib.import_module(module), name)
        # Plain pickle copies tensor data; the queue would otherwise share it through fds that die with the child.
        results.put((rank, "ok", pickle.dumps(fn(*args, **kwargs))))
    except BaseException:  # report everything, including SystemExit, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
                    expect_exit: Iterable[int] = (), **kwargs: Any) -> list:
    """Call module-level `fn(*args, **kwargs)` on `world_size` gloo ranks; return results by rank.

    Ranks in `expect_exit` may die without reporting; their result is then None.
    """
    expected_exits = set(expect_exit)
    # `python -m tools.mutate` caps every launch at its per-mutant limit: a mutant that hangs fails fast
    cap = os.environ.get("ZEROTRAIN_TEST_RUN_TIMEOUT")
    timeout = min(timeout, float(cap)) if cap else timeout
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    processes = [ctx.Process(target=_child, daemon=True,
                             args=(rank, world_size, port, list(sys.path), fn.__module__, fn.__name__,
                                   args, kwargs, results))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    outcomes: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            try:
                rank, status, value = results.get(timeout=0.1)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(processes) if not p.is_alive() and r not in outcomes]
                if dead and results.empty():
                    time.sleep(0.1)  # let a final message through
                    if results.empty():
                        for r in dead:
                            if r in expected_exits:
                                outcomes[r] = None
                        dead = [r for r in dead if r not in expected_exits]
                    if dead and results.empty():
                        raise AssertionError(f"rank(s) {dead} died without reporting "
                                             f"(exit codes {[processes[r].exitcode for r in dead]})")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(outcomes))
                    for r in missing:  # each hung rank writes every thread's stack to stderr (the report's capture)
                        if processes[r].is_alive():
                            os.kill(processes[r].pid, signal.SIGUSR1)
                            time.sleep(0.5)  # one rank's stacks at a time
                    raise AssertionError(f"timed out after {timeout:.0f}s; rank(s) {missing} never finished "
                                         f"(their threads' stacks are in the captured stderr)")
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} of {world_size} failed:\n{value}")
            outcomes[rank] = pickle.loads(value)
    finally:
        for process in processes:
            if process.is_alive():
                process.join(timeout=5 if len(outcomes) == world_size else 0)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
    return [outcomes[rank] for rank in range(world_size)]


def _python_child(argv: list, cwd: str, env: dict, sys_path: list, out_path: str, err_path: str,
                  served: str | None = None) -> None:
    for fd, path in ((1, out_path), (2, err_path)):
        handle = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    _run_argv(argv, cwd, env, sys_path, served)


def _run_argv(argv: list, cwd: str, env: dict, sys_path: list, served: str | None) -> None:
    """`python ARGV` in this forked process (its fds 0-2 already in place); ends it with its exit status."""
    _freeze_inherited_objects()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = [cwd, *sys_path]  # `python -m` and `python -c` put the working directory first
    if served is not None and env.get("PYTHON_EXEC") == served:
        sys.executable = served  # a launcher starts its torchrun agent with it: the agent is forked too (served_python)
    unbuffered = False
    while argv and argv[0].startswith("-") and argv[0] not in ("-m", "-c"):  # interpreter options (torchrun's -u)
        unbuffered = unbuffered or argv[0] == "-u"
        argv = argv[1:]
    if unbuffered or env.get("PYTHONUNBUFFERED"):
        import io
        for name, fd in (("stdout", 1), ("stderr", 2)):
            stream = getattr(sys, name)
            setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=stream.encoding,
                                                errors=stream.errors, write_through=True))
    import torch
    if env.get("OMP_NUM_THREADS"):  # a fresh interpreter reads it when torch starts its thread pool
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:  # a script: its own directory first on sys.path, as the interpreter puts it
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:  # as the interpreter turns `sys.exit(x)` into a status
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        import atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code & 0xFF)


def _check_argv(argv: Iterable[str]) -> list[str]:
    argv = [str(a) for a in argv]
    assert (argv[0] in ("-m", "-c") and len(argv) >= 2) or (argv[0].endswith(".py") and not argv[0].startswith("-")), \
        argv
    return argv


class ForkedProcess:
    """`python -m MODULE ARGS`, `python -c CODE ARGS` or `python SCRIPT.py ARGS` (argv without the interpreter) as a
    process forked from the forkserver, for a test that signals or kills it while it runs: what
    `subprocess.Popen(cmd, stdout=PIPE, stderr=PIPE, text=True)` offers a test (`pid`, `poll`, `wait`,
    `send_signal`, `terminate`, `kill`, `communicate`, `returncode`: -N when killed by signal N). Its parent is the
    forkserver, not the test; its own children (a launcher's torchrun agent) are its own, as with Popen."""

    def __init__(self, argv: Iterable[str], *, cwd: str | os.PathLike | None = None, env: dict | None = None):
        argv = _check_argv(argv)
        self.args = [sys.executable, *argv]
        self.returncode: int | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="zerotrain-python-")
        self._out, self._err = os.path.join(self._tmp.name, "stdout"), os.path.join(self._tmp.name, "stderr")
        for path in (self._out, self._err):
            open(path, "w").close()
        env = dict(os.environ if env is None else env)
        self._process = _context().Process(target=_python_child, args=(argv, os.fspath(cwd or os.getcwd()), env,
                                                                       list(sys.path), self._out, self._err,
                                                                       _SERVED and _SERVED.path))
        self._process.start()
        self.pid = self._process.pid

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _streams(self) -> tuple[str, str]:
        with open(self._out, errors="replace") as out, open(self._err, errors="replace") as err:
            return out.read(), err.read()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """(stdout, stderr) once it ended; past `timeout` subprocess.TimeoutExpired with the output so far (it runs
        on: kill it and call again, as with Popen)."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            out, err = self._streams()
            raise subprocess.TimeoutExpired(self.args, timeout, output=out, stderr=err) from None
        streams = self._streams()
        self._tmp.cleanup()
        return streams


def start_python(argv: Iterable[str], *, cwd: str | os.PathLike | None = None,
                 env: dict | None = None) -> ForkedProcess:
    """Start `python ARGV` (see ForkedProcess) and return at once."""
    return ForkedProcess(argv, cwd=cwd, env=env)


def run_python(argv: Iterable[str], *, cwd: str | os.PathLike | None = None, env: dict | None = None,
               timeout: float = 240.0) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS`, `python -c CODE ARGS` or `python SCRIPT.py ARGS` (argv without the interpreter) in
    `cwd` (default: this one) with environment `env` (default: this one), as a process forked from the
    forkserver; returns what `subprocess.run(..., capture_output=True, text=True)` would, and raises
    subprocess.TimeoutExpired past `timeout`. For processes that need no process tree of their own above them (a
    `--nproc N` launcher still starts torchrun's agent and its ranks as fresh interpreters).
    """
    cap = os.environ.get("ZEROTRAIN_TEST_RUN_TIMEOUT")  # `python -m tools.mutate`'s limit, as for run_distributed
    timeout = min(timeout, float(cap)) if cap else timeout
    process = ForkedProcess(argv, cwd=cwd, env=env)
    try:
        stdout, stderr = process.communicate(timeout)
    except subprocess.TimeoutExpired:  # it must not outlive the call (as subprocess.run)
        process.kill()
        process.wait(5)
        stdout, stderr = process.communicate()
        raise subprocess.TimeoutExpired(process.args, timeout, output=stdout, stderr=stderr) from None
    except BaseException:  # the test interrupted
        process.kill()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def run_cli(args: Iterable[str], *, cwd: str | os.PathLike | None = None, env: dict | None = None,
            timeout: float = 240.0) -> subprocess.CompletedProcess:
    """`python -m zerotrain.cli ARGS`, as `run_python` runs it."""
    return run_python(["-m", "zerotrain.cli", *args], cwd=cwd, env=env, timeout=timeout)


_CLIENT = """import os, sys
from multiprocessing.connection import Client
with Client({address!r}, family="AF_UNIX", authkey=bytes.fromhex({key!r})) as conn:
    conn.send(({prefix!r} + sys.argv[1:], os.getcwd(), dict(os.environ)))
    code, out, err = conn.recv()
sys.stdout.write(out)
sys.stdout.flush()
sys.stderr.write(err)
sys.exit(code if code >= 0 else 128 - code)
"""


@contextlib.contextmanager
def serve_commands(bin_dir: str | os.PathLike, commands: dict[str, list[str]], *,
                   timeout: float = 600.0) -> Iterator[None]:
    """Within the block, `bin_dir/NAME ARGS` (an executable for a shell's PATH) runs `python *commands[NAME] ARGS`
    as `run_python` does, in the caller's working directory and environment: e.g. {"zerotrain": ["-m",
    "zerotrain.cli"], "python": []}. Each one is a small stdlib-only client that hands its arguments to this test
    process and writes back the command's stdout, stderr and exit status (the output once the command ended), so
    a shell script runs as written without starting torch and transformers afresh for every command; one command
    at a time."""
    bin_dir = Path(bin_dir)
    key = secrets.token_hex(16)
    address = os.path.join(tempfile.mkdtemp(prefix="zerotrain-serve-"), "socket")
    from multiprocessing.connection import Client, Listener

    listener = Listener(address, family="AF_UNIX", authkey=bytes.fromhex(key))
    for name, prefix in commands.items():
        path = bin_dir / name
        path.write_text(f"#!{sys.executable} -IS\n" + _CLIENT.format(address=address, key=key, prefix=list(prefix)))
        path.chmod(0o755)

    def serve() -> None:
        while True:
            with listener.accept() as conn:
                request = conn.recv()
                if request is None:
                    return
                argv, cwd, env = request
                try:
                    done = run_python(argv, cwd=cwd, env=env, timeout=timeout)
                    conn.send((done.returncode, done.stdout, done.stderr))
                except subprocess.TimeoutExpired as error:
                    conn.send((124, error.output or "", (error.stderr or "") + f"\ntimed out after {timeout:.0f}s\n"))
                except BaseException:  # noqa: BLE001 - the shell gets the reason, the server stays up
                    conn.send((2, "", traceback.format_exc()))

    thread = threading.Thread(target=serve, daemon=True, name="serve_commands")
    thread.start()
    try:
        yield
    finally:
        with Client(address, family="AF_UNIX", authkey=bytes.fromhex(key)) as conn:
            conn.send(None)
        thread.join(10)
        listener.close()
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(address))


_SERVED_CLIENT = """import os, signal, sys
from multiprocessing.connection import Client
from multiprocessing.reduction import send_handle
try:  # die with the parent, as zerotrain's ranks and agent do (the server then kills the forked process)
    import ctypes
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)
except Exception:
    pass
# the signals held back until their forwarding is in place: a SIGTERM sent as soon as the forked process printed
# (it may, before this stub got past its request) was SIGTERM's default action on the stub (-15 for the handler's
# status) under load
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
conn = Client({address!r}, family="AF_UNIX", authkey=bytes.fromhex({key!r}))
fds = []
for fd in (0, 1, 2):
    try:
        os.fstat(fd)
        fds.append(fd)
    except OSError:
        pass
conn.send((sys.argv[1:], os.getcwd(), dict(os.environ), fds))
for fd in fds:
    send_handle(conn, fd, 0)
def forward(signum, frame):
    try:  # the process may have ended and the server closed the connection (its status is already on the way)
        conn.send(signum)
    except OSError:
        pass
for sig in SIGNALS:
    signal.signal(sig, forward)
signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # any held back now goes to forward
code = conn.recv()
if code < 0:  # killed by a signal: so is this process, as its parent would have seen it
    if -code not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


class _Fd:
    """A file descriptor handed to a forkserver child (pickled as multiprocessing's DupFd while the child starts)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction
        return _inherited_fd, (reduction.DupFd(self.fd),)


def _inherited_fd(dup) -> int:
    return dup.detach()


def _served_child(argv: list, cwd: str, env: dict, sys_path: list, fds: dict, served: str) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(fds.get(target, null), target)
    for fd in {*fds.values(), null}:
        if fd > 2:
            os.close(fd)
    sys.stdin = open(0, closefd=False)  # multiprocessing gave the child a /dev/null of its own
    _run_argv(argv, cwd, env, sys_path, served)


class _Server:
    """The server behind `served_python()`: each connection is one `python ARGS` of a client stub, run as a process
    forked from the forkserver with the stub's own fds 0-2, cwd and environment, its signals forwarded, killed when
    the stub dies, its exit status sent back."""

    def __init__(self) -> None:
        from multiprocessing.connection import Listener

        key = secrets.token_hex(16)
        self._dir = tempfile.mkdtemp(prefix="zerotrain-served-")
        address = os.path.join(self._dir, "socket")
        self._listener = Listener(address, family="AF_UNIX", authkey=bytes.fromhex(key))
        self.path = os.path.join(self._dir, "python")
        with open(self.path, "w") as handle:
            handle.write(f"#!{sys.executable} -IS\n" + _SERVED_CLIENT.format(address=address, key=key))
        os.chmod(self.path, 0o755)
        import shutil
        from multiprocessing import util
        # the client and the directory when the test process ends, after the listener's own finalizer (priority 0)
        # took its socket away
        util.Finalize(self, shutil.rmtree, args=(self._dir, True), exitpriority=-1)
        self._start_lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="served_python").start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except Exception:  # noqa: BLE001 - a client that failed the handshake
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="served_python run").start()

    def _serve(self, conn) -> None:
        from multiprocessing.reduction import recv_handle

        process = None
        try:
            argv, cwd, env, numbers = conn.recv()
            fds = {number: recv_handle(conn) for number in numbers}
            with self._start_lock:
                process = _context().Process(target=_served_child, args=(argv, cwd, env, list(sys.path),
                                                                        {n: _Fd(fd) for n, fd in fds.items()},
                                                                        self.path))
                process.start()
            for fd in fds.values():
                os.close(fd)
            while True:
                if conn.poll(0.05):
                    signum = conn.recv()
                    # (it may end and be reaped between the two calls: another served process's start reaps
                    # every finished child (multiprocessing's `_cleanup`); its status is then sent below, as
                    # for any end. A ProcessLookupError here closed the connection without it: the stub
                    # printed an EOFError traceback into the test's stderr, seen once at nproc 2)
                    if process.is_alive():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(process.pid, signum)
                elif not process.is_alive():
                    process.join()
                    conn.send(process.exitcode)
                    return
        except (EOFError, OSError):  # the client died (its parent did, or a SIGKILL): so does the process
            if process is not None and process.is_alive():
                process.kill()
                process.join(5)
        finally:
            conn.close()


_SERVED: _Server | None = None


def served_python() -> str:
    """An executable that runs `python ARGS` (interpreter options such as -u, then `-m MODULE`, `-c CODE` or
    `SCRIPT.py`) as a process forked from the forkserver, with the caller's fds 0-2, cwd and environment: torch,
    zerotrain and transformers are not imported afresh (seconds per process). Its signals (SIGTERM, SIGINT, SIGHUP,
    SIGQUIT, SIGUSR1, SIGUSR2) reach the forked process, it dies with its parent (and the process with it), and it
    ends with the process's exit status (by the same signal when a signal ended it).

    As `PYTHON_EXEC` in a launch's environment it is what torchrun starts its workers with (torch's own knob), and
    `run_python`/`start_python`/`serve_commands` give a process whose environment names it this `sys.executable`, so
    `zerotrain train --nproc N`'s agent is forked as well. The process tree is not the real one (the forked processes
    are the forkserver's children): tests of who dies with whom launch without it."""
    global _SERVED
    if _SERVED is None:
        _SERVED = _Server()
    return _SERVED.path
