"""The ``zerotrain`` command.

It parses the command line and dispatches to each command's own module.
``zerotrain train --config examples/zero2.json --nproc 2`` trains a built-in preset (a small
Llama-architecture model over bytes) on the Python standard library's source code with the given
DeepSpeed-style config; ``--model DIR --data FILE ...`` trains a local Hugging Face model directory
on local data files (``zerotrain.train.command``).
With ``--nproc N > 1`` the command re-launches itself under PyTorch's own launcher
(``python -m torch.distributed.run``, ``zerotrain.command.run_torchrun``), one worker process per rank. It
saves a checkpoint in ``checkpoints/`` after the last step (``--save-every N`` also every N steps) and
continues from the latest one with ``--resume``. ``zerotrain ckpt inspect|verify|export``
are the offline checkpoint tools (``zerotrain.checkpoint.command``). ``zerotrain launch
--nproc N train.py ARGS`` runs the user's own script the same way (``zerotrain.launcher``); ``zerotrain
merge`` merges models tensor by tensor (``zerotrain.merge.command``); ``zerotrain estimate`` prints the
memory per rank of each ZeRO stage and offload choice (``zerotrain.estimate``). ``zerotrain plot RUN_DIR
[RUN_DIR ...]`` draws runs' metrics.jsonl as PNGs (``zerotrain.plots``).
``zerotrain generate`` runs a model directory forward-only (ZeRO-Inference, ``zerotrain.inference``).
``zerotrain train-embedding`` fine-tunes a sentence-embedding model contrastively
(``zerotrain.embedding.command``). ``zerotrain port PATH...`` rewrites a DeepSpeed program's imports
(``zerotrain.port.command``).
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from zerotrain.command import (PROG, CLIError, CommandParser, HelpFormatter, add_node_flags, inside_worker, max_world_size, multi_node,
                               node_rendezvous, report_error, run_torchrun, usage_error_status)

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from zerotrain.checkpoint.command import add_ckpt_parser
    from zerotrain.train.command import add_train_parser

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="ZeRO-sharded training with DeepSpeed-compatible configs.",
    )
    from zerotrain import __version__
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    # each command's parser refuses what it does not know with its own usage (CommandParser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    sub.required = True

    add_train_parser(sub)
    _add_launch_parser(sub)
    add_ckpt_parser(sub, PROG)
    from zerotrain.merge.command import add_merge_parser
    add_merge_parser(sub)
    _add_plot_parser(sub)
    from zerotrain.estimate import add_estimate_parser
    add_estimate_parser(sub)
    from zerotrain.embedding.command import add_train_embedding_parser
    add_train_embedding_parser(sub)
    from zerotrain.inference import add_generate_parser
    add_node_flags(add_generate_parser(sub))  # several nodes as torchrun takes them (docs/multinode.md)
    from zerotrain.port.command import add_port_parser
    add_port_parser(sub)
    return parser


def _add_plot_parser(sub) -> None:
    plot = sub.add_parser(
        "plot",
        help="draw runs' metrics.jsonl as PNGs (loss and eval loss, lr, tokens/s, memory per rank)",
        description=("Write loss.png (training and held-out loss), lr.png, tokens_per_s.png and memory.png "
                     "(every rank) from the metrics.jsonl of each RUN_DIR (a `train --log-dir`), the runs "
                     "overlaid. See docs/metrics.md."),
    )
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a --log-dir of a run, or a metrics.jsonl file")
    plot.add_argument("--out", default=None, metavar="DIR",
                      help="where the PNGs go (default: RUN_DIR/plots of the run; with several runs "
                           "RUN_DIR/plots/compare_NAME1_NAME2... of the first, its own plots kept)")
    plot.add_argument("--labels", nargs="+", default=(), metavar="NAME",
                      help="a legend name per run (default: the directory names)")


def _plot(args: argparse.Namespace) -> int:
    from zerotrain.plots import plot_pngs

    first = Path(args.runs[0])
    out = Path(args.out) if args.out else (first if first.is_dir() else first.parent) / "plots"
    if not args.out and len(args.runs) > 1:  # the runs together: their own name, the first run's own PNGs stay
        names = list(args.labels) or [Path(run).name if Path(run).is_dir() else Path(run).parent.name
                                      for run in args.runs]
        out = out / ("compare_" + "_".join("".join(c if c.isalnum() or c in "-." else "-" for c in name)
                                           for name in names))
    try:
        written = plot_pngs(args.runs, out, labels=args.labels)
    except (OSError, ValueError, RuntimeError) as exc:  # a missing or bad metrics file, no matplotlib
        raise CLIError(str(exc)) from None
    for path in written:
        print(path)
    return 0


def _add_launch_parser(sub) -> None:
    launch = sub.add_parser(
        "launch",
        help="run your own training script on N processes (as `deepspeed` / `torchrun` do)",
        description=(
            "Start SCRIPT with its ARGS on --nproc processes per node through PyTorch's launcher "
            "(python -m torch.distributed.run), with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and "
            "MASTER_PORT set, and --local_rank=N appended for scripts whose source declares "
            "'--local_rank' (see zerotrain.launcher). Multi-node (docs/multinode.md): run it on every node with "
            "the same --nnodes, --master-addr and --master-port and that node's --node-rank, or elastic: "
            "--rdzv-backend c10d --rdzv-endpoint HOST:PORT --nnodes MIN:MAX on every node."
        ),
        formatter_class=HelpFormatter,
    )
    launch.add_argument("--nproc", type=int, default=1, metavar="N", help="processes (ranks) on this node")
    add_node_flags(launch)  # --nnodes, --node-rank, --master-addr/--master-port, --rdzv-backend/--rdzv-endpoint ...
    _add_deepspeed_launcher_flags(launch)
    launch.add_argument("--no-local-rank", "--no_local_rank", dest="no_local_rank", action="store_true",
                        help="never append --local_rank=N to the script's arguments")
    launch.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="restart all workers up to K times when one fails (torchrun's --max-restarts)")
    launch.add_argument("--stop-timeout", type=int, default=300, metavar="S",
                        help="seconds the workers get to exit after a forwarded SIGTERM/SIGINT/SIGHUP/SIGUSR1 "
                             "(a script opts in to saving on it with engine.install_signal_handlers())")
    launch.add_argument("script", metavar="SCRIPT", help="the training script (a .py file)")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments for the script, passed as they are")


def _add_deepspeed_launcher_flags(launch: argparse.ArgumentParser) -> None:
    """DeepSpeed's launcher options, by its names and meaning (zerotrain.hostfile, docs/multinode.md)."""
    from zerotrain.hostfile import LAUNCHERS

    group = launch.add_argument_group("DeepSpeed's launcher options (docs/multinode.md)")
    group.add_argument("-H", "--hostfile", default=None, metavar="FILE",
                       help="MPI-style hostfile, a 'HOST slots=N' line per host: the hosts and slots the job may use")
    group.add_argument("-i", "--include", default="", metavar="SPEC",
                       help="only these hosts/slots: NAME[:SLOT[,SLOT...]][@NAME...], e.g. worker-0@worker-1:0,2 "
                            "(default: every slot)")
    group.add_argument("-e", "--exclude", default="", metavar="SPEC",
                       help="every host/slot but these (the --include syntax; default: none excluded)")
    group.add_argument("--num_nodes", "--num-nodes", dest="num_nodes", type=int, default=-1, metavar="N",
                       help="the first N hosts of the hostfile (default: all)")
    group.add_argument("--num_gpus", "--num-gpus", "--num_accelerators", dest="num_gpus", type=int, default=-1,
                       metavar="G", help="slots 0..G-1 on every host (default: the hostfile's)")
    group.add_argument("--launcher", default="pdsh", type=str.lower, choices=LAUNCHERS,
                       help="how ranks start on other hosts (DeepSpeed's names)")
    group.add_argument("--launcher_args", "--launcher-args", dest="launcher_args", default="", metavar="ARGS",
                       help="arguments for the multi-host launcher, one quoted string (default: none)")
    group.add_argument("--ssh_port", "--ssh-port", dest="ssh_port", type=int, default=None, metavar="P",
                       help="ssh port of the other hosts")
    group.add_argument("--force_multi", "--force-multi", dest="force_multi", action="store_true",
                       help="start through --launcher even when the hosts are this machine alone (DeepSpeed's)")


def _uses_resources(args: argparse.Namespace) -> bool:
    return bool(args.hostfile or args.include or args.exclude or args.num_nodes >= 0 or args.num_gpus >= 0
                or args.force_multi)


def _resource_launch(args: argparse.Namespace):
    """DeepSpeed's resource options -> (the selected host -> slots, this node's torchrun options or None, the
    workers' extra environment): the selected slots of one host that is this machine run here, one rank per slot
    (CUDA_VISIBLE_DEVICES = the slots, as DeepSpeed's launch sets it); several hosts, or another one: None, for
    the multi-host start of `--launcher` (pdsh: ssh; openmpi, mpich, impi, mvapich: mpirun; slurm: srun)."""
    from zerotrain.command import rendezvous
    from zerotrain.hostfile import HYDRA_LAUNCHERS, is_this_host, local_slots, parse_hostfile, select_resources

    for flag, value, default in (("--nproc", args.nproc, 1), ("--nnodes", args.nnodes, "1"),
                                 ("--node-rank", args.node_rank, None), ("--rdzv-backend", args.rdzv_backend,
                                                                         "static")):
        if value != default:
            raise CLIError(f"{flag} cannot be combined with --hostfile/--include/--exclude/--num_nodes/--num_gpus "
                           "(the hostfile's slots set the ranks)")
    if args.hostfile is not None:
        pool = parse_hostfile(args.hostfile)
    else:
        if args.num_nodes > 1:
            raise CLIError("--num_nodes > 1 needs a --hostfile naming the other hosts")
        pool = {"localhost": local_slots(args.nproc)}
    active = select_resources(pool, args.include, args.exclude, args.num_nodes, args.num_gpus)
    remote = [host for host in active if not is_this_host(host)]
    if len(active) > 1 or remote or args.force_multi:
        if args.launcher in ("openmpi", *HYDRA_LAUNCHERS) and (args.include or args.exclude or args.num_nodes >= 0
                                                             or args.num_gpus >= 0):
            raise CLIError(f"--launcher {args.launcher} runs every slot of the hostfile (as DeepSpeed's): it does "
                           "not take --include/--exclude/--num_nodes/--num_gpus; write the hostfile you want")
        if args.launcher == "slurm":
            from zerotrain.hostfile import check_slurm_slots
            check_slurm_slots(active)
        return active, None, {}
    (slots,) = active.values()
    master = args.master_addr or ("127.0.0.1" if args.master_port is not None else None)
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible and max(slots) >= len(visible):
        raise CLIError(f"slot {max(slots)} is not among CUDA_VISIBLE_DEVICES={','.join(visible)}")
    devices = [visible[s] if visible else str(s) for s in slots]  # slot i = the i-th device this process sees
    return active, rendezvous(len(slots), master_addr=master, master_port=args.master_port), {
        "CUDA_VISIBLE_DEVICES": ",".join(devices)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``zerotrain`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if not faulthandler.is_enabled():  # a rank that dies by a signal (SIGABRT, SIGSEGV) prints every thread's stack
        faulthandler.enable()
    try:
        return _run(args)
    except BrokenPipeError:  # `zerotrain ckpt inspect ... | head`: the reader left; no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail again
        return 128 + 13  # as a process ended by SIGPIPE
    finally:
        # A command's finished engine can be garbage in a reference cycle that still holds its process groups:
        # collected here, their gloo worker threads end while the interpreter runs; left to the interpreter's
        # exit, a worker dropping a finished collective's tensors aborts the rank (`dist.destroy_process_group`).
        gc.collect()


def _run(args: argparse.Namespace) -> int:
    try:
        if args.command == "ckpt":
            from zerotrain.checkpoint.command import run_ckpt
            return run_ckpt(args)
        if args.command == "launch":
            return _launch_script(args)
        if args.command == "port":
            from zerotrain.port.command import run_port
            return run_port(args)
        if args.command == "merge":
            from zerotrain.merge.command import run_merge
            return run_merge(args)
        if args.command == "plot":
            return _plot(args)
        if args.command == "estimate":
            from zerotrain.budget import estimate_sizes
            from zerotrain.estimate import run_estimate
            return run_estimate(args, sizes=estimate_sizes)  # the unset size keys as the memory budget sizes them
        if args.command == "generate":
            from zerotrain.inference import run_generate, worker_argv as generate_argv
            if (args.nproc > 1 or multi_node(args)) and not inside_worker():
                return run_torchrun(node_rendezvous(args), ["-m", "zerotrain.cli", *generate_argv(args)])
            return run_generate(args)
        if args.command == "train-embedding":
            from zerotrain.embedding.command import effective_embedding_config, run_train_embedding, worker_argv
            if args.print_config:
                return _print_config(effective_embedding_config(args))
            if args.max_restarts < 0 or args.stop_timeout < 0:
                raise CLIError(f"--max-restarts and --stop-timeout must be >= 0, got {args.max_restarts} and "
                               f"{args.stop_timeout}")
            if (args.nproc > 1 or multi_node(args)) and not inside_worker():
                return run_torchrun(node_rendezvous(args), ["-m", "zerotrain.cli", *worker_argv(args)],
                                    max_restarts=args.max_restarts, stop_timeout=args.stop_timeout)
            return run_train_embedding(args)
        if args.command == "train":
            from zerotrain.train.command import already_trained, check_train_args, run_train
            config = check_train_args(args)  # the run's config, built once here outside a worker
            if args.print_config:
                from zerotrain.train.command import effective_train_config
                return _print_config(effective_train_config(args))
            done = None if inside_worker() else already_trained(args)
            if done is not None:  # --resume at or past --steps: nothing to launch (rc 0, as the HF Trainer)
                print(done, flush=True)
                return 0
            if (args.nproc > 1 or multi_node(args)) and not inside_worker():
                return _launch(args)
            return run_train(args, config)
    except Exception as exc:  # usage errors (CLIError, config and checkpoint errors): one clean line, no traceback
        status = usage_error_status(exc)
        if status is None:  # anything else keeps its traceback; in a rank: in the agent's report (@record's)
            from zerotrain.elastic import record_failure
            if inside_worker() and record_failure(exc):
                return 1
            raise
        return report_error(str(exc), status)
    return 0


def _print_config(config: dict) -> int:
    """`--print-config`: the effective config as JSON on stdout; nothing is trained."""
    import json
    print(json.dumps(config, indent=2), flush=True)
    return 0


def _launch(args: argparse.Namespace) -> int:
    """Re-run `train` under torch.distributed.run with ``args.nproc`` workers on this node (of --nnodes)."""
    from zerotrain.train.command import worker_argv

    return run_torchrun(node_rendezvous(args),
                        ["-m", "zerotrain.cli", *worker_argv(args)], stop_signals=args.stop_signals,
                        max_restarts=args.max_restarts, stop_timeout=args.stop_timeout)


def _launch_script(args: argparse.Namespace) -> int:
    """`zerotrain launch`: the user's script on every worker (zerotrain.launcher runs it there)."""
    from zerotrain.hostfile import HYDRA_LAUNCHERS
    from zerotrain.launcher import worker_target

    if args.nproc < 1:
        raise CLIError(f"--nproc must be >= 1, got {args.nproc}")
    extra_env: dict[str, str] = {}
    active = None
    if _uses_resources(args):
        active, workers, extra_env = _resource_launch(args)
    else:
        workers = node_rendezvous(args)
    if not Path(args.script).is_file():
        raise CLIError(f"script {args.script!r} not found")
    if args.max_restarts < 0 or args.stop_timeout < 0:
        raise CLIError("--max-restarts and --stop-timeout must be >= 0")
    if active is not None:  # the slots fit the script's config's batch sizes, before any rank starts
        from zerotrain.hostfile import check_slots_fit_batch
        check_slots_fit_batch(active, args.script_args)
    if workers is None and args.launcher == "openmpi":  # several hosts: mpirun starts every rank
        return _launch_mpirun(args, active)
    if workers is None and args.launcher in HYDRA_LAUNCHERS:  # MPICH's / Intel MPI's / MVAPICH's mpirun (hydra)
        return _launch_hydra(args, active)
    if workers is None and args.launcher == "slurm":  # inside an allocation: srun starts every rank
        return _launch_srun(args, active)
    if workers is None:  # several hosts: one `zerotrain launch` per host over ssh
        return _launch_hosts(args, active)
    from zerotrain.hostfile import STOP_ON_EOF_ENV, relay_output, stop_on_stdin_eof
    if os.environ.get(STOP_ON_EOF_ENV) == "1":  # started over ssh by a launcher: its channel closing stops us
        relay_output()  # and the ranks' output survives the channel until the stop reaches them
        stop_on_stdin_eof()
    return run_torchrun(workers, worker_target(args.script, args.script_args, not args.no_local_rank),
                        max_restarts=args.max_restarts, stop_timeout=args.stop_timeout, extra_env=extra_env)


def _launch_hosts(args: argparse.Namespace, active: dict) -> int:
    """The ssh start (DeepSpeed's pdsh launcher's job): every host reachable, the master address (`hostname -I`
    of the first host unless --master_addr), then one `zerotrain launch` per host (zerotrain.hostfile.run_hosts)."""
    from zerotrain.hostfile import check_reachable, first_address, run_hosts, ssh_commands

    check_reachable(list(active), args.ssh_port, args.launcher_args)
    first = next(iter(active))
    master = args.master_addr or first_address(first, args.ssh_port, args.launcher_args)
    target = [*(["--no-local-rank"] if args.no_local_rank else []), "--max-restarts", str(args.max_restarts),
              "--stop-timeout", str(args.stop_timeout), os.path.abspath(args.script), *args.script_args]
    return run_hosts(ssh_commands(active, master, args.master_port or 29500, target, args.ssh_port,
                                  args.launcher_args), active)


def _launch_mpirun(args: argparse.Namespace, active: dict) -> int:
    """`--launcher openmpi` (DeepSpeed's OpenMPIRunner): `mpirun` starts every slot of the hostfile over ssh and
    runs the script in each rank (through zerotrain.launcher, without --local_rank, as DeepSpeed runs it); this
    process becomes mpirun (exec), so a stop signal reaches mpirun, which stops every rank on every host. The
    master is --master_addr or the first host's name."""
    import shutil

    from zerotrain.hostfile import mpirun_command, mpirun_kind
    from zerotrain.launcher import worker_target

    found = shutil.which("mpirun")
    if found is None:
        raise CLIError("--launcher openmpi: mpirun is not on PATH (install Open MPI: apt-get install openmpi-bin)")
    if mpirun_kind(found) == "hydra":
        raise CLIError(f"--launcher openmpi: mpirun on PATH ({found}) is MPICH's (hydra), which does not take Open "
                       "MPI's line: put Open MPI's mpirun first on PATH (Debian: a directory with mpirun -> "
                       "mpirun.openmpi), or use --launcher mpich")
    import socket

    from zerotrain.hostfile import is_this_host

    first = next(iter(active))
    master = args.master_addr or (socket.gethostname() if is_this_host(first) else first)  # as the others reach it
    cmd = mpirun_command(args.hostfile, {host: len(slots) for host, slots in active.items()}, master,
                         args.master_port or 29500, worker_target(args.script, args.script_args, False),
                         args.launcher_args, args.ssh_port)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(cmd[0], cmd)
    return 127  # not reached


def _launch_hydra(args: argparse.Namespace, active: dict) -> int:
    """`--launcher mpich|impi|mvapich` (DeepSpeed's MPICHRunner / IMPIRunner / MVAPICHRunner): `mpirun` (the
    hydra process manager these MPIs share) starts every slot of the hostfile, the same count per host, and runs
    the script in each rank (through zerotrain.launcher, without --local_rank); this process becomes mpirun
    (exec): a stop signal reaches it, and one rank's death ends the job everywhere. The master is --master_addr
    or the first host's name, as with --launcher openmpi."""
    import shutil
    import socket

    from zerotrain.hostfile import hydra_command, is_this_host, mpirun_kind, write_mvapich_hostfile
    from zerotrain.launcher import worker_target

    found = shutil.which("mpirun")
    if found is None:
        raise CLIError(f"--launcher {args.launcher}: mpirun is not on PATH (install {args.launcher.upper()}, or put a "
                       "directory with mpirun -> mpiexec.hydra first on PATH)")
    if mpirun_kind(found) == "openmpi":
        raise CLIError(f"--launcher {args.launcher}: mpirun on PATH ({found}) is Open MPI's, which does not take "
                       "this launcher's line: put your MPI's mpirun first on PATH (MPICH: mpirun -> mpiexec.hydra), "
                       "or use --launcher openmpi")
    if args.ssh_port is not None:
        raise CLIError(f"--launcher {args.launcher} does not take --ssh_port (DeepSpeed's line has no ssh "
                       "option): set the port in ~/.ssh/config, or give hydra an ssh wrapper "
                       "(--launcher_args \"-launcher-exec /path/to/ssh-wrapper\")")
    first = next(iter(active))
    master = args.master_addr or (socket.gethostname() if is_this_host(first) else first)  # as the others reach it
    pool = {host: len(slots) for host, slots in active.items()}
    cmd = hydra_command(args.launcher, pool, master, args.master_port or 29500,
                        worker_target(args.script, args.script_args, False), args.launcher_args,
                        cuda=args.launcher == "mvapich" and _has_cuda())
    if args.launcher == "mvapich":
        write_mvapich_hostfile(pool)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(found, cmd)
    return 127  # not reached


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _launch_srun(args: argparse.Namespace, active: dict) -> int:
    """`--launcher slurm` (DeepSpeed's SlurmRunner), inside a Slurm allocation: `srun` starts the slots' ranks on
    the allocation's nodes and runs the script in each (through zerotrain.launcher, without --local_rank, as
    DeepSpeed runs it); this process becomes srun (exec): srun forwards a stop signal to every rank."""
    import shutil

    from zerotrain.hostfile import srun_command
    from zerotrain.launcher import worker_target

    if shutil.which("srun") is None:
        raise CLIError("--launcher slurm: srun is not on PATH (run inside a Slurm allocation: sbatch or salloc)")
    cmd, exports = srun_command(active, worker_target(args.script, args.script_args, False), args.launcher_args,
                                args.include, args.exclude, args.num_nodes, args.num_gpus, args.master_port)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, {**os.environ, **exports})
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
