"""DeepSpeed's launcher resources for `zerotrain launch`: the hostfile, `--include`/`--exclude`, the
`--num_nodes`/`--num_gpus` caps, `--launcher` names and `.deepspeed_env`, with DeepSpeed 0.19's meaning
(`deepspeed/launcher/runner.py`; tests/test_hostfile.py compares every result with its functions).

- Hostfile lines ``HOST slots=N`` (anything after the count is ignored, as DeepSpeed's pattern does); ``#``
  comments and blank lines skipped; a bad line, a host listed twice or no host at all is one error naming the
  file and line.
- ``--include``/``--exclude``: ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC = HOST[:SLOT[,SLOT ...]]``; the
  two exclude each other and the caps; the result keeps the hostfile's host order (ranks are numbered in it).
- ``--num_nodes N``: the first N hosts; ``--num_gpus G``: slots 0..G-1 on every host (as DeepSpeed, not capped
  by the hostfile's count).
- Without a hostfile the pool is this machine: ``localhost`` with a slot per GPU (per ``--nproc`` on CPU).
- ``.deepspeed_env`` (the name ``$DS_ENV_FILE`` overrides) in the home directory, then in the current one, a
  ``NAME=VALUE`` a line: forwarded to every host of a multi-host start (the later file wins a name).
- Several hosts (`--launcher pdsh`, the default): `ssh_commands` makes one ``zerotrain launch --nnodes N
  --node-rank R ...`` per host, `run_hosts` runs them through ssh and stops every host when the launcher stops,
  dies or one host fails (the host's ssh channel closes; its launch, started with `STOP_ON_EOF_ENV`, stops its
  ranks: `stop_on_stdin_eof`).
- `--launcher openmpi` over several hosts: `mpirun_command` is DeepSpeed's OpenMPIRunner's line (Open MPI starts
  the ranks over ssh; each reads its rank from Open MPI's variables, `zerotrain.cluster`).
- `--launcher slurm` (inside an allocation): `srun_command` is DeepSpeed's SlurmRunner's line (srun starts the
  ranks; each reads its rank and the master from Slurm's variables, `zerotrain.cluster`).
- `check_slots_fit_batch`: the selected slots fit the batch sizes of the script's config, checked before any
  rank starts (one line).
"""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Optional

from .command import CLIError, HOST_REPORT, STOP_ON_EOF_ENV

__all__ = ["LAUNCHERS", "parse_hostfile", "select_resources", "read_deepspeed_env", "is_this_host",
           "local_slots", "check_reachable", "first_address", "ssh_commands", "run_hosts", "host_failure",
           "stop_on_stdin_eof", "relay_output",
           "mpirun_command", "mpirun_kind", "check_slots_fit_batch", "srun_command", "check_slurm_slots"]

# DeepSpeed's --launcher names (case-insensitive there too); pdsh is its default
LAUNCHERS = ("pdsh", "openmpi", "mpich", "impi", "slurm", "mvapich")
HYDRA_LAUNCHERS = ("mpich", "impi", "mvapich")  # mpirun lines of hydra's options (MPICH's process manager)
_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")  # DeepSpeed's pattern (runner._parse_hostfile)


def parse_hostfile(path: str) -> dict[str, int]:
    """Host -> slot count of an MPI-style hostfile, in file order."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise CLIError(f"--hostfile {path}: cannot read it ({exc.strerror or exc})") from None
    pool: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _HOST_LINE.search(line)
        if match is None:
            raise CLIError(f"{path}:{number}: bad hostfile line {line!r}: expected 'HOST slots=N'")
        host = match.group(1)
        if host in pool:
            raise CLIError(f"{path}:{number}: host {host!r} is listed twice (first at line {first_line[host]})")
        pool[host], first_line[host] = int(match.group(2)), number
    if not pool:
        raise CLIError(f"{path}: no hosts in the hostfile (expected lines 'HOST slots=N')")
    return pool


def _parse_spec(flag: str, text: str) -> dict[str, list[int]]:
    """``host1:0,1@host2`` -> {host1: [0, 1], host2: []} (slots sorted, duplicates dropped; [] = every slot)."""
    specs: dict[str, list[int]] = {}
    for item in text.split("@"):
        host, sep, slots = item.partition(":")
        if not host or ":" in slots or (sep and not slots):
            raise CLIError(f"{flag} {text!r}: bad node spec {item!r} (expected HOST or HOST:SLOT[,SLOT...])")
        try:
            numbers = [int(s) for s in slots.split(",")] if sep else []
        except ValueError:
            raise CLIError(f"{flag} {text!r}: slots of {host!r} must be integers, got {slots!r}") from None
        specs[host] = sorted(set(specs.get(host, []) + numbers))
    return specs


def select_resources(pool: dict[str, int], include: str = "", exclude: str = "", num_nodes: int = -1,
                     num_gpus: int = -1) -> dict[str, list[int]]:
    """The slots the job runs on, host -> slot ids, as DeepSpeed's `parse_inclusion_exclusion` then
    `apply_num_nodes_and_gpus` make them; every refusal is one line naming the flag."""
    if (num_nodes >= 0 or num_gpus >= 0) and (include or exclude):
        raise CLIError("--num_nodes/--num_gpus cannot be combined with --include/--exclude")
    if include and exclude:
        raise CLIError("--include and --exclude are mutually exclusive")
    active = {host: list(range(slots)) for host, slots in pool.items()}
    if include or exclude:
        flag, text = ("--include", include) if include else ("--exclude", exclude)
        chosen: dict[str, list[int]] = {} if include else {h: list(s) for h, s in active.items()}
        for host, slots in _parse_spec(flag, text).items():
            if host not in active:
                raise CLIError(f"{flag}: host {host!r} is not in the hostfile (hosts: {', '.join(active)})")
            for slot in slots:
                if slot not in active[host]:
                    raise CLIError(f"{flag}: host {host!r} has no slot {slot} (slots 0..{len(active[host]) - 1})")
            if include:
                chosen[host] = slots or active[host]
            else:
                chosen[host] = [s for s in chosen[host] if s not in slots] if slots else []
        active = {host: chosen[host] for host in active if chosen.get(host)}
    if num_nodes > 0:
        active = dict(list(active.items())[:num_nodes])
    if num_gpus > 0:
        active = {host: list(range(num_gpus)) for host in active}
    if not active:
        raise CLIError("no slots left to run on after --include/--exclude")
    return active


def local_slots(nproc: int) -> int:
    """The slot count of this machine when no hostfile is given: its GPUs, else --nproc (CPU ranks)."""
    import torch  # here, not at the top: the launcher's own start stays light

    return (torch.cuda.device_count() if torch.cuda.is_available() else 0) or nproc


def is_this_host(host: str) -> bool:
    """Whether `host` names this machine (localhost, a loopback address, its hostname or fully qualified name)."""
    if host in ("localhost", "127.0.0.1", "::1") or host.startswith("127."):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    names |= {name.split(".")[0] for name in names}
    return host in names


def read_deepspeed_env(home: Optional[str] = None, cwd: Optional[str] = None) -> dict[str, str]:
    """NAME -> VALUE of the `.deepspeed_env` files where DeepSpeed reads them (the home directory, then the
    current one; ``$DS_ENV_FILE`` names the file). Blank lines and ``#`` comments are skipped; a line without
    ``=`` is one error naming the file and line."""
    name = os.getenv("DS_ENV_FILE", ".deepspeed_env")
    found: dict[str, str] = {}
    for directory in (os.path.expanduser("~") if home is None else home, "." if cwd is None else cwd):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip() or line.strip().startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.strip():
                raise CLIError(f"{path}:{number}: bad line {line.strip()!r}: expected NAME=VALUE")
            found[key.strip()] = value.strip()
    return found


# The variables forwarded to every host besides .deepspeed_env: DeepSpeed's EXPORT_ENVS, its CUDA accelerator's
# (NCCL), and gloo's (GLOO_SOCKET_IFNAME: the interface that reaches the other hosts)
FORWARDED_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL", "GLOO")


def _ssh(host: str, ssh_port: Optional[int], launcher_args: str) -> list[str]:
    import shlex

    return ["ssh", "-o", "BatchMode=yes", *(["-p", str(ssh_port)] if ssh_port is not None else []),
            *shlex.split(launcher_args), host]


def check_reachable(hosts: list[str], ssh_port: Optional[int], launcher_args: str, timeout: float = 30.0) -> None:
    """Every host answers `ssh HOST true` without a password, or one line naming the first that does not."""
    import subprocess

    for host in hosts:
        try:
            probe = subprocess.run([*_ssh(host, ssh_port, launcher_args), "true"], capture_output=True, text=True,
                                   timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise CLIError(f"host {host!r} did not answer ssh within {timeout:.0f} s") from None
        if probe.returncode != 0:
            said = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
            raise CLIError(f"host {host!r} is not reachable by passwordless ssh"
                           f"{f' on port {ssh_port}' if ssh_port is not None else ''}: {said}")


def first_address(host: str, ssh_port: Optional[int], launcher_args: str) -> str:
    """The first address of `hostname -I` on `host`, as DeepSpeed picks the master address."""
    import subprocess

    probe = subprocess.run([*_ssh(host, ssh_port, launcher_args), "hostname -I"], capture_output=True, text=True,
                           timeout=30, stdin=subprocess.DEVNULL)
    addresses = probe.stdout.split()
    if probe.returncode != 0 or not addresses:
        raise CLIError(f"could not read the address of {host!r} by `hostname -I`; give --master_addr")
    return addresses[0]


def ssh_commands(active: dict[str, list[int]], master_addr: str, master_port: int, target: list[str],
                 ssh_port: Optional[int] = None, launcher_args: str = "",
                 environ: Optional[dict[str, str]] = None, cwd: Optional[str] = None) -> list[list[str]]:
    """One `ssh HOST 'cd CWD && exec env ... python -m zerotrain.cli launch --nnodes N --node-rank R ...'` per
    host (node rank = its place in the hostfile), with the forwarded variables and .deepspeed_env's lines."""
    import shlex
    import sys

    environ = dict(os.environ if environ is None else environ)
    cwd = os.path.abspath(cwd or os.getcwd())
    exports = {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES)}
    exports["PYTHONPATH"] = os.pathsep.join([cwd, *([exports["PYTHONPATH"]] if exports.get("PYTHONPATH") else [])])
    exports.update(read_deepspeed_env(cwd=cwd))
    exports[STOP_ON_EOF_ENV] = "1"
    commands = []
    for rank, (host, slots) in enumerate(active.items()):
        env = {**exports, "CUDA_VISIBLE_DEVICES": ",".join(str(s) for s in slots)}
        remote = ["env", *(f"{k}={v}" for k, v in env.items()), sys.executable, "-u", "-m", "zerotrain.cli",
                  "launch", "--nproc", str(len(slots)), "--nnodes", str(len(active)), "--node-rank", str(rank),
                  "--master-addr", master_addr, "--master-port", str(master_port), *target]
        line = f"cd {shlex.quote(cwd)} && exec " + " ".join(shlex.quote(a) for a in remote)
        commands.append([*_ssh(host, ssh_port, launcher_args), line])
    return commands


def run_hosts(commands: list[list[str]], active: dict[str, list[int]]) -> int:
    """Run one ssh per host (`commands[i]` for the i-th host of `active`, host -> slots); the job's status is the
    first non-zero one. A host that fails, or a stop signal to this process, closes every other host's ssh channel:
    each host's launch then stops its ranks (its stdin ends, `STOP_ON_EOF_ENV`); the launcher dying takes its ssh
    clients with it, which ends the channels too. What the hosts' launches report for the launcher
    (`command.HOST_REPORT`) is taken out of their output (the rest is copied as it comes): a usage error (a bad
    argument to the script, a bad config key; every host's ranks usually hit the same one) is printed once, the
    first host's line, and its status is the job's; else a host that failed is named in one line on stderr (its
    node rank, its ranks and status); either is printed once when every host has ended. A host's "stopped" line
    is dropped when this process stopped it after another host failed, and printed otherwise."""
    import signal
    import subprocess
    import threading
    import time

    from .command import print_error
    from .lifecycle import kill_me_with_parent

    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                              preexec_fn=kill_me_with_parent) for cmd in commands]
    received: list[int] = []
    failed: Optional[int] = None  # the first host seen failing
    usage: list[tuple[int, str]] = []  # (status, line) of the hosts' usage errors, as they came
    relays = [threading.Thread(target=_relay_host_stderr, args=(proc.stderr, usage, lambda: failed is not None),
                               name=f"zerotrain-host-{index}", daemon=True) for index, proc in enumerate(procs)]
    for relay in relays:
        relay.start()

    def stop_all() -> None:
        for proc in procs:
            if proc.poll() is None and proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except OSError:
                    pass

    def on_signal(signum, frame) -> None:
        received.append(signum)
        stop_all()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    status = 0
    try:
        while any(proc.poll() is None for proc in procs):
            for index, proc in enumerate(procs):
                code = proc.poll()
                if code not in (None, 0) and status == 0:
                    status, failed = code, index
                    stop_all()
            time.sleep(0.2)
        for index, proc in enumerate(procs):
            if proc.returncode and status == 0:
                status, failed = proc.returncode, index
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_all()
        for relay in relays:  # a host's stderr ends with its ssh client; what is still in the pipe comes first
            relay.join(timeout=5)
    if received:
        return 128 + received[0]
    if usage:
        print_error(usage[0][1])
        return usage[0][0]
    if failed is not None:
        print_error(host_failure(active, failed, status))
    return status


def _relay_host_stderr(source, usage: list[tuple[int, str]], stopped_for_a_failure) -> None:
    """Copy one host's stderr (its ssh client's) to this process's, as it comes, except its `HOST_REPORT` lines:
    a usage error is added to `usage`; a stop line is printed (unmarked) unless `stopped_for_a_failure()`."""
    import sys

    mark = HOST_REPORT.encode()
    pending = b""

    def write(data: bytes) -> None:
        try:
            sys.stderr.flush()
            os.write(sys.stderr.fileno(), data)
        except (OSError, ValueError):
            pass

    def report(line: bytes) -> None:
        kind, _, said = line[len(mark):].decode("utf-8", "replace").rstrip("\r\n").partition(" ")
        if kind == "usage":
            code, _, message = said.partition(" ")
            usage.append((int(code) if code.isdigit() else 1, message))
        elif not (kind == "stopped" and stopped_for_a_failure()):
            write((said + "\n").encode())

    def line_out(line: bytes) -> None:  # a report may follow a rank's partial line (a progress bar's "\r")
        at = line.find(mark)
        if at < 0:
            write(line)
            return
        if at:
            write(line[:at])
        report(line[at:])

    while True:
        try:
            data = os.read(source.fileno(), 65536)
        except OSError:
            data = b""
        pending += data
        while b"\n" in pending:
            line, _, pending = pending.partition(b"\n")
            line_out(line + b"\n")
        # a partial line goes out now (progress bars, prompts), but for a report or what may be the start of one
        if pending and mark not in pending:
            keep = next((n for n in range(min(len(mark), len(pending)), 0, -1) if mark.startswith(pending[-n:])), 0)
            write(pending[:len(pending) - keep])
            pending = pending[len(pending) - keep:]
        if not data:
            break
    if pending:
        line_out(pending)
    source.close()


def host_failure(active: dict[str, list[int]], index: int, status: int) -> str:
    """The line naming the `index`-th host of `active` whose launch (its ssh) ended with `status` first."""
    host = list(active)[index]
    first = sum(len(slots) for slots in list(active.values())[:index])
    last = first + len(active[host]) - 1
    ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
    why = "ssh's own failure (status 255: the connection lost, or the host down)" if status == 255 else \
        f"exit status {status}"
    return (f"host {host!r} (node rank {index}, {ranks} of {sum(len(s) for s in active.values())}) failed: {why}; "
            f"the job was stopped on every other host")


def stop_on_stdin_eof() -> None:
    """In a host's launch started by `run_hosts`: SIGTERM to this process when stdin ends (its ssh channel closed:
    the launcher stopped, died or gave up on the job); `run_torchrun` forwards it to the ranks."""
    import signal
    import threading

    def watch() -> None:
        try:  # the raw descriptor: a buffered sys.stdin's lock held by this thread aborts the interpreter's exit
            while os.read(0, 65536):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="zerotrain-stdin-eof", daemon=True).start()


def relay_output() -> None:
    """In a host's launch started by `run_hosts`: its ranks' stdout and stderr go through pipes this process copies
    to its own (the ssh channel), dropping what the channel no longer takes. When the launcher stops or dies, the
    channel's stdin ends and its stdout breaks at once; a rank writing there directly (the engine's
    `steps_per_print` line, the script's own prints) would die of the broken pipe before the stop (SIGTERM, from
    `stop_on_stdin_eof`) reaches it and it saves. At exit the pipes are closed and the copies drained."""
    import atexit
    import sys
    import threading

    relays = []
    for fd in (1, 2):
        try:
            channel = os.dup(fd)
        except OSError:  # no such descriptor: nothing to relay
            continue
        read_end, write_end = os.pipe()
        os.dup2(write_end, fd)  # this process's, its agent's and its ranks' fd (inherited)
        os.close(write_end)

        def copy(source: int = read_end, sink: int = channel) -> None:
            open_sink = True
            while True:
                try:
                    data = os.read(source, 65536)
                except OSError:
                    break
                if not data:  # every writer is gone
                    break
                while open_sink and data:
                    try:
                        data = data[os.write(sink, data):]
                    except OSError:  # the channel is gone: keep draining, drop the rest
                        open_sink = False
            os.close(source)

        thread = threading.Thread(target=copy, name=f"zerotrain-relay-{fd}", daemon=True)
        thread.start()
        relays.append((fd, channel, thread))

    def finish() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for fd, channel, _ in relays:
            os.dup2(channel, fd)  # this process's write ends closed: a relay ends once the ranks' are too
        for _, _, thread in relays:
            thread.join(timeout=5)

    atexit.register(finish)


def mpirun_kind(path: str) -> str:
    """Whose `mpirun` `path` is, from what its ``--version`` says: ``"openmpi"`` (Open MPI's, which takes
    `mpirun_command`'s line), ``"hydra"`` (MPICH's process manager, Intel MPI's and MVAPICH's too: `hydra_command`'s
    line) or ``"unknown"`` (another MPI, or one that does not run). Debian's `mpirun` is an alternative that points
    to Open MPI's or MPICH's, whichever is installed with the higher priority."""
    import subprocess

    try:
        probe = subprocess.run([path, "--version"], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                               timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    said = probe.stdout + probe.stderr
    if any(mark in said for mark in ("Open MPI", "OpenRTE", "open-mpi.org")):
        return "openmpi"
    if "HYDRA" in said or "Intel(R) MPI" in said:
        return "hydra"
    return "unknown"


def _has_mca(args: list[str], name: str) -> bool:
    """Whether mpirun arguments already set the MCA parameter `name` (``--mca NAME V`` / ``-mca NAME V``)."""
    return any(flag in ("-mca", "--mca") and value == name for flag, value in zip(args, args[1:]))


def mpirun_command(hostfile: str, pool: dict[str, int], master_addr: str, master_port: int, target: list[str],
                   launcher_args: str = "", ssh_port: Optional[int] = None,
                   environ: Optional[dict[str, str]] = None, cwd: Optional[str] = None) -> list[str]:
    """`--launcher openmpi`: the `mpirun` line DeepSpeed's OpenMPIRunner builds (``-n`` = every slot of the
    hostfile, ``-hostfile``, ``--mca btl ^openib``, ``--mca btl_tcp_if_include eth0`` unless the launcher args
    set it, the launcher args, ``-x`` exports: UCX_TLS=tcp, the forwarded variables, PYTHONPATH led by the
    current directory, .deepspeed_env's lines), then ``python -u`` and `target` (the worker module and the
    script). It adds MASTER_ADDR / MASTER_PORT (DeepSpeed broadcasts them with mpi4py; each rank here reads
    them with Open MPI's rank variables: `zerotrain.cluster`) and turns ``--ssh_port`` into ssh's ``-p`` for
    Open MPI's remote start (``--mca plm_rsh_args``, put before the launcher args' own value of it)."""
    import shlex
    import sys

    environ = dict(os.environ if environ is None else environ)
    cwd = os.path.abspath(cwd or os.getcwd())
    extra = shlex.split(launcher_args)
    cmd = ["mpirun", "-n", str(sum(pool.values())), "-hostfile", hostfile, "--mca", "btl", "^openib"]
    if not _has_mca(extra, "btl_tcp_if_include"):
        cmd += ["--mca", "btl_tcp_if_include", "eth0"]
    if ssh_port is not None:  # ssh's port for Open MPI's remote start, before the launcher args' own ssh options
        given = [i + 1 for i, (flag, value) in enumerate(zip(extra, extra[1:]))
                 if flag in ("-mca", "--mca") and value == "plm_rsh_args" and i + 2 < len(extra)]
        for i in given:
            extra[i + 1] = f"-p {ssh_port} {extra[i + 1]}"
        if not given:
            cmd += ["--mca", "plm_rsh_args", f"-p {ssh_port}"]
    exports = {"UCX_TLS": "tcp", **{k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES)}}
    exports["PYTHONPATH"] = os.pathsep.join([cwd, *([exports["PYTHONPATH"]] if exports.get("PYTHONPATH") else [])])
    exports.update(read_deepspeed_env(cwd=cwd))
    exports.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    cmd += extra
    for key, value in exports.items():
        cmd += ["-x", f"{key}={value}"]
    return [*cmd, sys.executable, "-u", *target]


def _exports(environ: Optional[dict[str, str]], cwd: Optional[str]) -> dict[str, str]:
    """What DeepSpeed's runner exports to every rank of a multi-host start: the variables named by the forwarded
    prefixes, PYTHONPATH led by the current directory, then .deepspeed_env's lines."""
    environ = dict(os.environ if environ is None else environ)
    cwd = os.path.abspath(cwd or os.getcwd())
    exports = {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES)}
    exports["PYTHONPATH"] = os.pathsep.join([cwd, *([exports["PYTHONPATH"]] if exports.get("PYTHONPATH") else [])])
    exports.update(read_deepspeed_env(cwd=cwd))
    return exports


def _per_host(launcher: str, pool: dict[str, int]) -> int:
    """The ranks per host of a hydra line (`-ppn`): the same on every host, or one line (DeepSpeed's refusal)."""
    counts = set(pool.values())
    if len(counts) != 1:
        raise CLIError(f"--launcher {launcher} needs the same slot count on every host (its -ppn), got {pool}")
    return counts.pop()


# DeepSpeed's MVAPICHRunner writes the hosts, one a line, here (deepspeed.launcher.constants.MVAPICH_TMP_HOSTFILE)
MVAPICH_HOSTFILE = "/tmp/deepspeed_mvapich_hostfile"
# ...and exports these before the forwarded variables (MV2_USE_CUDA=1 too on a CUDA machine)
MVAPICH_EXPORTS = {"MV2_SMP_USE_CMA": "0", "MV2_DEBUG_SHOW_BACKTRACE": "1", "MV2_SUPPORT_DL": "1",
                   "MV2_ENABLE_AFFINITY": "0", "MV2_INTER_ALLGATHER_TUNING": "5", "MV2_CUDA_USE_NAIVE": "0"}


def hydra_command(launcher: str, pool: dict[str, int], master_addr: str, master_port: int, target: list[str],
                  launcher_args: str = "", environ: Optional[dict[str, str]] = None, cwd: Optional[str] = None,
                  cuda: bool = False) -> list[str]:
    """`--launcher mpich|impi|mvapich`: the `mpirun` line DeepSpeed 0.19's MPICHRunner / IMPIRunner /
    MVAPICHRunner builds for every slot of `pool` (the same count on every host), word for word up to the
    program each rank runs, which is ``python -u`` and `target` (zerotrain's worker module and the script) in
    place of DeepSpeed's launcher_helper.py (mpich) or the bare script (impi, mvapich).

    - mpich: ``mpirun -n N -ppn P ARGS -genv K=V... -genv MASTER_ADDR A -genv MASTER_PORT P -genv WORLD_SIZE N
      -genv LOCAL_SIZE P -hosts h1,h2 PROGRAM``; each rank reads PMI_RANK / MPI_LOCALRANKID (`zerotrain.cluster`).
    - impi: ``mpirun -ppn P ARGS -genv K V... (the same four) -genv I_MPI_PIN 0 -hosts h1,h2 -n 1 -env RANK 0
      -env LOCAL_RANK 0 PROGRAM : -n 1 -env RANK 1 ...``: every rank's RANK and LOCAL_RANK on the line.
    - mvapich: ``mpirun -np N -ppn P --hostfile /tmp/deepspeed_mvapich_hostfile ARGS -env K=V... PROGRAM``
      (the hosts written there, one a line, by the caller: `write_mvapich_hostfile`), MVAPICH's MV2_* tuning
      exports first; DeepSpeed's ranks find the master with mpi4py, so zerotrain exports MASTER_ADDR and
      MASTER_PORT there too.
    """
    import shlex
    import sys

    total, per_host = sum(pool.values()), _per_host(launcher, pool)
    extra = shlex.split(launcher_args)
    exports = _exports(environ, cwd)
    python = [sys.executable, "-u"]
    hosts = ",".join(pool)
    rendezvous = [("MASTER_ADDR", master_addr), ("MASTER_PORT", str(master_port)), ("WORLD_SIZE", str(total)),
                  ("LOCAL_SIZE", str(per_host))]
    if launcher == "mpich":
        cmd = ["mpirun", "-n", str(total), "-ppn", str(per_host), *extra]
        for key, value in exports.items():
            cmd += ["-genv", f"{key}={value}"]
        for key, value in rendezvous:
            cmd += ["-genv", key, value]
        return [*cmd, "-hosts", hosts, *python, *target]
    if launcher == "impi":
        cmd = ["mpirun", "-ppn", str(per_host), *extra]
        for key, value in [*exports.items(), *rendezvous, ("I_MPI_PIN", "0")]:
            cmd += ["-genv", key, value]
        cmd += ["-hosts", hosts]
        for rank in range(total):
            cmd += [*([":"] if rank else []), "-n", "1", "-env", "RANK", str(rank), "-env", "LOCAL_RANK",
                    str(rank % per_host), *python, *target]
        return cmd
    if launcher == "mvapich":
        mv2 = dict(MVAPICH_EXPORTS)
        if cuda:
            mv2 = {**dict(list(mv2.items())[:2]), "MV2_USE_CUDA": "1", **dict(list(mv2.items())[2:])}
        exports = {**mv2, **exports, "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
        cmd = ["mpirun", "-np", str(total), "-ppn", str(per_host), "--hostfile", MVAPICH_HOSTFILE, *extra]
        for key, value in exports.items():
            cmd += ["-env", f"{key}={value}"]
        return [*cmd, *python, *target]
    raise CLIError(f"--launcher {launcher} has no mpirun line here (mpich, impi, mvapich)")


def write_mvapich_hostfile(pool: dict[str, int]) -> None:
    """The hosts of `pool`, one a line, where DeepSpeed's MVAPICHRunner writes them (its line's --hostfile)."""
    with open(MVAPICH_HOSTFILE, "w") as f:
        f.writelines(f"{host}\n" for host in pool)


def _script_config(script_args: list[str]) -> Optional[str]:
    """The JSON config a DeepSpeed script is given: ``--deepspeed_config`` (``--zerotrain_config``,
    ``--deepscale_config``), or the HF Trainer's ``--deepspeed FILE``; None when there is none."""
    for i, arg in enumerate(script_args):
        flag, sep, value = arg.partition("=")
        if flag in ("--deepspeed_config", "--zerotrain_config", "--deepscale_config", "--deepspeed"):
            if not sep:
                value = script_args[i + 1] if i + 1 < len(script_args) else ""
            if value.startswith("-") or (flag == "--deepspeed" and not value.endswith(".json")):
                continue  # DeepSpeed's --deepspeed is a switch; the HF Trainer's takes the file
            return value or None
    return None


def check_slots_fit_batch(active: dict[str, list[int]], script_args: list[str]) -> None:
    """Before any rank starts: the selected slots (the world size) fit the batch sizes of the config the script
    is given (train_batch_size = micro batch x accumulation x data-parallel ranks, the data-parallel ranks being
    the world over tensor x sequence x pipeline parallel sizes), or one line naming the slots and the file. A
    config whose batch sizes are all unset or "auto" (filled by the HF Trainer) fits any world."""
    import warnings

    from .config import ConfigError, load_config

    path = _script_config(script_args)
    if path is None or not os.path.isfile(path):
        return
    world = sum(len(slots) for slots in active.values())
    slots = ", ".join(f"{host}: {len(ids)}" for host, ids in active.items())
    with warnings.catch_warnings():  # the ranks warn about the config's keys, once for the job
        warnings.simplefilter("ignore")
        config = load_config(path)
    if config.train_batch_size is None and config.train_micro_batch_size_per_gpu is None:
        return
    model_parallel = (config.tensor_parallel.autotp_size * config.sequence_parallel_size
                      * config.pipeline_parallel_size)
    if world % model_parallel:
        raise CLIError(f"{world} slots ({slots}) do not fit {path}: the world must be a multiple of tensor x "
                       f"sequence x pipeline parallel sizes = {model_parallel}")
    try:
        config.resolve_batch(world // model_parallel)
    except ConfigError as exc:
        raise CLIError(f"{world} slots ({slots}) do not fit {path}'s batch sizes: {exc}") from None


def check_slurm_slots(active: dict[str, list[int]]) -> None:
    """What `srun` can place (DeepSpeed's SlurmRunner.validate_active_resources): the first N slots of every host
    and the same N everywhere; else one line."""
    for host, slots in active.items():
        if slots != list(range(len(slots))):
            raise CLIError(f"--launcher slurm cannot select specific slots, got {slots} on {host!r}: filter whole "
                           "hosts, or keep the first N slots on every host")
    counts = {host: len(slots) for host, slots in active.items()}
    if len(set(counts.values())) > 1:
        raise CLIError(f"--launcher slurm needs the same slot count on every host, got {counts}")


def srun_command(active: dict[str, list[int]], target: list[str], launcher_args: str = "", include: str = "",
                 exclude: str = "", num_nodes: int = -1, num_gpus: int = -1, master_port: Optional[int] = None,
                 environ: Optional[dict[str, str]] = None, cwd: Optional[str] = None) -> tuple[list[str], dict]:
    """`--launcher slurm`: (the `srun` line DeepSpeed's SlurmRunner builds, the variables it exports). ``srun -n
    <slots>``, the launcher args, ``--nodelist``/``--nodes`` for a filtered selection, ``--nodes`` for
    --num_nodes, ``--gpus-per-node`` for --num_gpus, ``--export=ALL,K=V,...`` (the forwarded variables,
    PYTHONPATH led by the current directory, .deepspeed_env's lines; MASTER_PORT when --master_port is given),
    then ``python -u`` and `target`. Each rank takes its rank and the master (the step's first node) from Slurm's
    variables (`zerotrain.cluster`). A value with a comma cannot be written in --export: it travels in srun's
    own environment (``ALL``), which the caller sets to the returned variables."""
    import shlex
    import sys

    check_slurm_slots(active)
    environ = dict(os.environ if environ is None else environ)
    cwd = os.path.abspath(cwd or os.getcwd())
    cmd = ["srun", "-n", str(sum(len(slots) for slots in active.values())), *shlex.split(launcher_args)]
    if include or exclude:
        cmd += ["--nodelist", ",".join(active), "--nodes", str(len(active))]
    if num_nodes > 0:
        cmd += ["--nodes", str(num_nodes)]
    if num_gpus > 0:
        cmd += ["--gpus-per-node", str(num_gpus)]
    exports = {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES)}
    exports["PYTHONPATH"] = os.pathsep.join([cwd, *([exports["PYTHONPATH"]] if exports.get("PYTHONPATH") else [])])
    exports.update(read_deepspeed_env(cwd=cwd))
    if master_port is not None:
        exports["MASTER_PORT"] = str(master_port)
    listed = "".join(f",{k}={v}" for k, v in exports.items() if "," not in v)
    return [*cmd, f"--export=ALL{listed}", sys.executable, "-u", *target], exports
