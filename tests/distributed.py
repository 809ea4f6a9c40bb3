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

`run_python(["-m", MODULE or "-c", CODE, *ARGS], cwd=..., env=...)` (and `run_cli(ARGS)` for
`python -m zerotrain.cli ARGS`) runs a command as its own process forked from the same forkserver: its
own working directory, environment, file descriptors 1 and 2 and exit status, without importing torch and
zerotrain again (seconds per command).
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import runpy
import socket
import subprocess
import tempfile
import sys
import time
import traceback
from typing import Any, Callable, Iterable

_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        # transformers.modeling_utils: ranks building a Hugging Face model would each import it (seconds per launch);
        # the forkserver skips a preload that fails to import.
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "zerotrain", "transformers.modeling_utils"])
    return _CONTEXT


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(rank: int, world_size: int, port: int, sys_path: list, module: str, name: str,
           args: tuple, kwargs: dict, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    sys.path[:] = sys_path
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
                    raise AssertionError(f"timed out after {timeout:.0f}s; rank(s) {missing} never finished")
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


def _python_child(argv: list, cwd: str, env: dict, sys_path: list, out_path: str, err_path: str) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = [cwd, *sys_path]  # `python -m` and `python -c` put the working directory first
    for fd, path in ((1, out_path), (2, err_path)):
        handle = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    import torch
    if env.get("OMP_NUM_THREADS"):  # a fresh interpreter reads it when torch starts its thread pool
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
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


def run_python(argv: Iterable[str], *, cwd: str | os.PathLike | None = None, env: dict | None = None,
               timeout: float = 240.0) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` or `python -c CODE ARGS` (argv without the interpreter) in `cwd` (default: this
    one) with environment `env` (default: this one), as a process forked from the forkserver; returns what
    `subprocess.run(..., capture_output=True, text=True)` would, and raises subprocess.TimeoutExpired past
    `timeout`. For processes that need no process tree of their own above them (a `--nproc N` launcher still
    starts torchrun's agent and its ranks as fresh interpreters).
    """
    argv = [str(a) for a in argv]
    assert argv[0] in ("-m", "-c") and len(argv) >= 2, argv
    cap = os.environ.get("ZEROTRAIN_TEST_RUN_TIMEOUT")  # `python -m tools.mutate`'s limit, as for run_distributed
    timeout = min(timeout, float(cap)) if cap else timeout
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="zerotrain-python-") as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out_path, err_path):
            open(path, "w").close()
        process = _context().Process(target=_python_child, args=(argv, os.fspath(cwd or os.getcwd()), env,
                                                                 list(sys.path), out_path, err_path))
        process.start()
        try:
            process.join(timeout)
        finally:  # past the timeout, or the test interrupted: it must not outlive the call (as subprocess.run)
            timed_out = process.is_alive()
            if timed_out:
                process.kill()
                process.join(5)
        with open(out_path, errors="replace") as out, open(err_path, errors="replace") as err:
            stdout, stderr = out.read(), err.read()
    cmd = [sys.executable, *argv]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, process.exitcode, stdout, stderr)  # -N: killed by signal N


def run_cli(args: Iterable[str], *, cwd: str | os.PathLike | None = None, env: dict | None = None,
            timeout: float = 240.0) -> subprocess.CompletedProcess:
    """`python -m zerotrain.cli ARGS`, as `run_python` runs it."""
    return run_python(["-m", "zerotrain.cli", *args], cwd=cwd, env=env, timeout=timeout)
