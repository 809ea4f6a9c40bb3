"""What the `zerotrain` commands share: the usage error, whether this process is a worker, and starting a
command's ranks under PyTorch's launcher with the stop signals forwarded.

``zerotrain train --nproc N``, ``train-embedding``, ``generate`` and ``launch`` all start their workers here
(`run_torchrun`): ``python -m torch.distributed.run`` in its own session, the stop signals forwarded to it once,
the job's exit status (128 + the signal's number after a stop) returned.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

__all__ = ["HelpFormatter", "CommandParser", "CLIError", "PROG", "inside_worker", "print_error", "report_error", "usage_error_status",
           "STOP_ON_EOF_ENV", "HOST_REPORT", "rendezvous", "run_torchrun",
           "add_node_flags", "node_rendezvous", "multi_node", "max_world_size"]

PROG = "zerotrain"
WORKER_ENV_VARS = ("RANK", "LOCAL_RANK")
# Set by `hostfile.ssh_commands` for one host's launch of a multi-host start: its ssh channel closing stops it
# (`hostfile.stop_on_stdin_eof`), and its usage error and stop lines go to the launcher marked (`HOST_REPORT`).
STOP_ON_EOF_ENV = "ZEROTRAIN_STOP_ON_STDIN_EOF"
# A host's launch writes `HOST_REPORT + "usage STATUS LINE"` or `HOST_REPORT + "stopped LINE"` on stderr;
# `hostfile.run_hosts` takes these lines out of the host's output and says once, for every host, what they say.
HOST_REPORT = "zerotrain-host-report: "


class CLIError(Exception):
    """A usage problem reported as one line on stderr, exit status 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each option's default said once: "(default: X)" is added only where the help text does not
    already say its default, and never for an unset (None) or off (False) one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """The parser of one `zerotrain` command (the class `cli` gives its subcommands).

    An argument it does not know is refused here, with this command's usage (argparse would hand it up to the
    top-level parser, which shows `zerotrain`'s usage instead). With `underscore_spellings` set (the training
    commands, `train.flags.add_training_flags`), every option also takes its underscore spelling: `--learning_rate`
    is `--learning-rate`, as the HF Trainer's TrainingArguments fields are spelled; the hyphenated option table is
    the one source, so no alias can drift from it."""

    underscore_spellings = False

    def parse_known_args(self, args=None, namespace=None):  # noqa: D102 - argparse's own
        args = list(sys.argv[1:] if args is None else args)
        if self.underscore_spellings:
            args = self._hyphenated(args)
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def _hyphenated(self, args: list[str]) -> list[str]:
        """`--a_b[=V]` as `--a-b[=V]` where `--a-b` is one of this parser's options (and `--a_b` is not); the
        values, and everything after a bare `--`, are left as they are."""
        known = {option for action in self._actions for option in action.option_strings}
        out = []
        for index, arg in enumerate(args):
            if arg == "--":
                return out + args[index:]
            name, sep, value = arg.partition("=")
            if name.startswith("--") and "_" in name and name not in known:
                spelled = "--" + name[2:].replace("_", "-")
                if spelled in known:
                    arg = spelled + sep + value
            out.append(arg)
        return out


def print_error(message: str) -> None:
    """``zerotrain: error: MESSAGE`` on stderr."""
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)


def _to_the_launcher(report: str) -> bool:
    """In one host's launch of a multi-host start (`STOP_ON_EOF_ENV`, not a rank): `report` marked on stderr for
    the launcher (`hostfile.run_hosts`), which says it once for all hosts; False elsewhere."""
    if os.environ.get(STOP_ON_EOF_ENV) != "1" or inside_worker():
        return False
    print(HOST_REPORT + report, file=sys.stderr, flush=True)
    return True


def report_error(message: str, status: int) -> int:
    """A usage error's one line: printed here, or, in a worker of `run_torchrun`, handed to the launcher through
    this rank's error file (`zerotrain.elastic`), which prints it once for all ranks, or, in one host's launch of a
    multi-host start, handed to that start's launcher (`HOST_REPORT`), which prints it once for all hosts;
    returns `status`."""
    from zerotrain.elastic import AGENT_ENV, record_usage_error

    if inside_worker() and os.environ.get(AGENT_ENV) == "1" and record_usage_error(message, status):
        return status
    if not _to_the_launcher(f"usage {int(status)} {message}"):
        print_error(message)
    return status


def usage_error_status(exc: BaseException) -> Optional[int]:
    """The exit status of `exc` when it is one of zerotrain's usage errors, reported as one line without a
    traceback: a `CLIError`, a config error or a cluster launcher's bad rank variables (2), a checkpoint error (1:
    a bad checkpoint to resume from, a failed save); None for anything else, whose traceback is kept. `zerotrain
    train` and the scripts `zerotrain launch` runs (`launcher`) both decide here."""
    from zerotrain.cluster import ClusterEnvError
    from zerotrain.config import ConfigError

    if isinstance(exc, (CLIError, ConfigError, ClusterEnvError)):
        return 2
    from zerotrain.checkpoint import CheckpointError  # here: a CLIError needs no torch import

    return 1 if isinstance(exc, CheckpointError) else None


def inside_worker() -> bool:
    """True in a worker started by torch.distributed.run (its environment names the rank)."""
    return any(var in os.environ for var in WORKER_ENV_VARS)


def rendezvous(nproc: int, nnodes: int = 1, node_rank: int = 0, master_addr: Optional[str] = None,
                master_port: Optional[int] = None) -> list[str]:
    """torch.distributed.run's options for `nproc` workers per node: `--standalone` (a free port) for one
    node without a port, else a static rendezvous at master_addr:master_port."""
    if nnodes == 1 and master_port is None and master_addr is None:
        cmd = ["--standalone"]
    else:
        cmd = ["--nnodes", str(nnodes), "--node_rank", str(node_rank),
               "--master_addr", master_addr or "127.0.0.1", "--master_port", str(master_port or 29500)]
    return cmd + ["--nproc_per_node", str(nproc)]


def add_node_flags(parser: argparse.ArgumentParser) -> None:
    """torchrun's multi-node options, by its names (hyphens or underscores): a static rendezvous (`--nnodes N
    --node-rank R --master-addr HOST --master-port P`) or an elastic one (`--rdzv-backend c10d --rdzv-endpoint
    HOST:PORT --nnodes MIN:MAX`); `node_rendezvous` checks them and turns them into the agent's options."""
    parser.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                        help="number of nodes; MIN:MAX with --rdzv-backend c10d (elastic: the job runs with any "
                             "number of nodes in that range and re-forms when one leaves or joins)")
    parser.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=None, metavar="R",
                        help="this node's index, 0..nnodes-1 (static rendezvous; default 0)")
    parser.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None, metavar="HOST",
                        help="address of node 0, reachable from every node (static rendezvous; required with "
                             "--nnodes > 1)")
    parser.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None, metavar="P",
                        help="rendezvous port on node 0 (static; required with --nnodes > 1; default on one "
                             "node: a free port picked by the launcher)")
    parser.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default="static",
                        choices=("static", "c10d"),
                        help="static: fixed nodes and ranks (--node-rank, --master-addr); c10d: elastic, node "
                             "ranks assigned at the rendezvous at --rdzv-endpoint")
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default=None,
                        metavar="HOST:PORT",
                        help="the c10d rendezvous store: one node's address and a free port (that node hosts it)")
    parser.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", default="none", metavar="ID",
                        help="the job's id, the same on every node (c10d)")
    parser.add_argument("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf", default=None, metavar="K=V,...",
                        help="torchrun's rendezvous settings, e.g. join_timeout=60,last_call_timeout=1,"
                             "close_timeout=10 (c10d)")


def _node_range(nnodes: str) -> tuple[int, int]:
    low, sep, high = str(nnodes).partition(":")
    try:
        bounds = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise CLIError(f"--nnodes must be N or MIN:MAX, got {nnodes!r}") from None
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise CLIError(f"--nnodes must be >= 1 (and MIN <= MAX), got {nnodes!r}")
    return bounds


def max_world_size(args: argparse.Namespace) -> int:
    """The most ranks the job can have: --nproc per node times the most nodes (--nnodes N or MIN:MAX)."""
    return args.nproc * _node_range(args.nnodes)[1]


def multi_node(args: argparse.Namespace) -> bool:
    """Whether the options ask for more than this node (several nodes, or an elastic rendezvous)."""
    return _node_range(args.nnodes)[1] > 1 or args.rdzv_backend != "static"


def node_rendezvous(args: argparse.Namespace) -> list[str]:
    """The agent's rendezvous options for `add_node_flags`' options (and --nproc); a clear error for a bad mix."""
    low, high = _node_range(args.nnodes)
    if args.rdzv_backend == "static":
        if low != high:
            raise CLIError(f"--nnodes {args.nnodes}: a range needs the elastic rendezvous (--rdzv-backend c10d "
                           "--rdzv-endpoint HOST:PORT)")
        if args.rdzv_endpoint is not None:
            raise CLIError("--rdzv-endpoint is for --rdzv-backend c10d; the static rendezvous takes --master-addr "
                           "and --master-port")
        node_rank = 0 if args.node_rank is None else args.node_rank
        if not 0 <= node_rank < high:
            raise CLIError(f"--node-rank must be in [0, {high}), got {node_rank}")
        if high > 1 and (args.master_addr is None or args.master_port is None):
            raise CLIError("--nnodes > 1 needs --master-addr and --master-port (node 0's address and a free port)")
        return rendezvous(args.nproc, high, node_rank, args.master_addr, args.master_port)
    if args.rdzv_endpoint is None:
        raise CLIError("--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT (one node's address and a free port)")
    for flag, value in (("--node-rank", args.node_rank), ("--master-addr", args.master_addr),
                        ("--master-port", args.master_port)):
        if value is not None:
            raise CLIError(f"{flag} is for the static rendezvous; with --rdzv-backend c10d the node ranks and the "
                           "master are assigned at --rdzv-endpoint")
    cmd = ["--nnodes", f"{low}:{high}", "--rdzv_backend", "c10d", "--rdzv_endpoint", args.rdzv_endpoint,
           "--rdzv_id", args.rdzv_id]
    if args.rdzv_conf:
        cmd += ["--rdzv_conf", args.rdzv_conf]
    return cmd + ["--nproc_per_node", str(args.nproc)]


def agent_signals(stop_signals: str) -> str:
    """The signals torchrun's agent forwards to its workers: its own default set plus the stop signals."""
    from zerotrain.lifecycle import parse_signals
    names = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *(s.name for s in parse_signals(stop_signals))]
    return ",".join(dict.fromkeys(names))


def run_torchrun(rendezvous: list[str], target: list[str], stop_signals: str = "SIGTERM,SIGINT,SIGHUP,SIGUSR1",
                  max_restarts: int = 0, stop_timeout: int = 300, extra_env: Optional[dict[str, str]] = None) -> int:
    """Run `python -m torch.distributed.run RENDEZVOUS TARGET`; return the job's exit status.

    The one place both `train --nproc` and `launch` start workers. The agent runs in its own session
    (a terminal's Ctrl-C reaches this process only, which forwards it once), forwards the stop signals to
    the workers and gives them `stop_timeout` seconds to save; it dies with this process (SIGKILL on parent
    death: its workers then die with it and commit nothing). A stop is reported by exit status 128 + the
    signal number, a crash by the agent's own non-zero status. `extra_env` is added to the agent's (and so the
    workers') environment.
    """
    import signal
    import tempfile

    from zerotrain.lifecycle import STOP_FILE_ENV, kill_me_with_parent, parse_signals, read_stop_file

    from zerotrain.elastic import AGENT_ENV, ERROR_FILE_ENV, read_usage_error

    # torchrun's agent through zerotrain.elastic: a usage error in the ranks comes back in its error file
    cmd = [sys.executable, "-m", "zerotrain.elastic", *rendezvous, "--max_restarts", str(max_restarts),
           "--shutdown_timeout", str(stop_timeout), "--signals_to_handle", agent_signals(stop_signals), *target]
    env = {**os.environ, **(extra_env or {})}
    env.setdefault("OMP_NUM_THREADS", "1")
    # A fresh store for every rendezvous round (torch's opt-out of the one TCPStore the c10d agents share for the
    # whole job; rank 0 of each round's workers hosts it). With the shared store the workers' key space is told
    # apart only by TORCHELASTIC_RESTART_COUNT, which an agent raises when its own workers failed but not when it
    # restarts them for a peer node's new round: after one node's restart the nodes' attempts disagree, and the
    # other node's ranks read the dead generation's addresses (gloo "Connection refused", the restart fails).
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # Workers must import this same zerotrain, wherever the launching interpreter found it.
    package_root = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if package_root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([package_root, *paths])
    handle, stop_file = tempfile.mkstemp(prefix="zerotrain-stop-")
    os.close(handle)
    env[STOP_FILE_ENV] = stop_file
    handle, error_file = tempfile.mkstemp(prefix="zerotrain-error-")
    os.close(handle)
    os.unlink(error_file)  # torchelastic writes it only when a rank failed
    env[ERROR_FILE_ENV] = error_file
    env[AGENT_ENV] = "1"
    received: list[int] = []
    forwarded = {int(s) for s in parse_signals(stop_signals)} | {int(signal.SIGTERM), int(signal.SIGINT),
                                                                  int(signal.SIGHUP)}
    agent = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=kill_me_with_parent)

    def forward(signum, frame) -> None:
        received.append(signum)
        try:
            agent.send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in forwarded}
    try:
        while True:
            try:
                status = agent.wait()
                break
            except KeyboardInterrupt:  # only if SIGINT is not among the forwarded ones
                agent.send_signal(signal.SIGINT)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop = read_stop_file(stop_file)
        os.unlink(stop_file)
        usage = read_usage_error(error_file) if status != 0 else None
        if os.path.exists(error_file):
            os.unlink(error_file)
    if stop is not None or received:  # a stop, not an error: no "error:", no trace (the agent ends quietly)
        sig = stop[0] if stop is not None else signal.Signals(received[0])
        said = (f"{PROG}: stopped by {sig.name}" + (f" at {stop[1]}" if stop is not None and stop[1] else "")
                + ("" if status == 0 or stop is not None else f"; the ranks exited with status {status}"))
        if not _to_the_launcher(f"stopped {said}"):
            print(said, file=sys.stderr, flush=True)
        return 128 + int(sig)
    if usage is not None:  # a rank's one-line usage error, printed once (once for all hosts: `report_error`)
        return report_error(*usage)
    return status
