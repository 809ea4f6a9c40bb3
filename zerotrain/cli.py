"""The ``zerotrain`` command.

``zerotrain train --config examples/zero2.json --nproc 2`` trains the built-in byte-level
GPT on the Python standard library's source code with the given DeepSpeed-style config.
With ``--nproc N > 1`` the command re-launches itself under PyTorch's own launcher
(``python -m torch.distributed.run``), one worker process per rank. It saves a checkpoint
in ``checkpoints/`` after the last step (``--save-every N`` also every N steps) and
continues from the latest one with ``--resume``. ``zerotrain ckpt inspect|verify|export``
are the offline checkpoint tools (``zerotrain.checkpoint.command``). ``zerotrain launch
--nproc N train.py ARGS`` runs the user's own script the same way (``zerotrain.launcher``); ``zerotrain
merge`` merges models tensor by tensor (``zerotrain.merge.command``). ``zerotrain plot RUN_DIR
[RUN_DIR ...]`` draws runs' metrics.jsonl as PNGs (``zerotrain.plots``).
``zerotrain train-embedding`` fine-tunes a sentence-embedding model contrastively
(``zerotrain.embedding.command``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["main", "build_parser"]

PROG = "zerotrain"
_WORKER_ENV_VARS = ("RANK", "LOCAL_RANK")


class CLIError(Exception):
    """A usage problem reported as one line on stderr, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    from zerotrain.checkpoint.command import add_ckpt_parser
    from zerotrain.data.corpus import DEFAULT_MAX_BYTES
    from zerotrain.models.gpt import PRESETS

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="ZeRO-sharded training with DeepSpeed-compatible configs.",
    )
    from zerotrain import __version__
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    train = sub.add_parser(
        "train",
        help="train the built-in byte-level GPT on the Python standard library's source",
        description=(
            "Train the built-in byte-level GPT on the Python standard library's own source "
            "files (no download). Batch sizes, optimizer, scheduler, precision and ZeRO stage "
            "come from the DeepSpeed-style JSON config."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    train.add_argument(
        "--config", required=True, metavar="PATH",
        help="DeepSpeed-style JSON config file (see examples/zero*.json)",
    )
    train.add_argument(
        "--nproc", type=int, default=1, metavar="N",
        help="number of processes (ranks) on this machine; N > 1 re-launches this command "
             "under `python -m torch.distributed.run`",
    )
    train.add_argument(
        "--model", choices=sorted(PRESETS), default="small",
        help="GPT preset: tiny (~0.1M params, tests), small (~6M, demo), 70m (~72M, benchmarks)",
    )
    train.add_argument("--steps", type=int, default=50, metavar="N",
                       help="optimizer steps to run")
    train.add_argument(
        "--seq-len", type=int, default=None, metavar="T",
        help="tokens per training sequence (default: 128, or the model's block size if smaller)",
    )
    train.add_argument(
        "--max-corpus-bytes", type=int, default=DEFAULT_MAX_BYTES, metavar="N",
        help="read at most this many bytes of standard-library source as the corpus",
    )
    train.add_argument(
        "--val-fraction", type=float, default=0.02, metavar="F",
        help="fraction of the corpus (its tail) held out for evaluation; 0 disables eval",
    )
    train.add_argument(
        "--eval-interval", type=int, default=0, metavar="N",
        help="evaluate every N steps (0: only after the last step)",
    )
    train.add_argument(
        "--eval-batches", type=int, default=8, metavar="N",
        help="micro-batches per rank in each evaluation",
    )
    train.add_argument(
        "--log-dir", default=None, metavar="DIR",
        help="directory for metrics.jsonl and summary.json (rank 0); nothing written if unset",
    )
    train.add_argument("--seed", type=int, default=1234,
                       help="seed for model init and data order (same on every rank)")
    train.add_argument(
        "--save-dir", default="checkpoints", metavar="DIR",
        help="save a checkpoint here (DIR/global_step<N>, DIR/latest) after the last step, relative "
             "to the current directory; the config's `checkpoint` block sets async_save, keep_last "
             "and verify_on_load",
    )
    train.add_argument("--save-every", type=int, default=0, metavar="N",
                       help="also save a checkpoint every N steps (0: only after the last step)")
    train.add_argument("--no-save", action="store_true", help="save no checkpoint at all")
    train.add_argument(
        "--resume", action="store_true",
        help="continue from the latest checkpoint in --save-dir: weights, optimizer, LR schedule, "
             "step, RNG and data position; starts from scratch if there is none. --steps is the "
             "total to reach, counting the steps already done",
    )
    train.add_argument(
        "--master-port", type=int, default=None, metavar="P",
        help="rendezvous port for --nproc > 1 (default: a free port picked by the launcher)",
    )
    train.add_argument(
        "--max-restarts", type=int, default=0, metavar="K",
        help="with --nproc > 1: restart all ranks up to K times when one fails; each restart resumes "
             "from the latest committed checkpoint in --save-dir (a stop by signal is never restarted)",
    )
    train.add_argument(
        "--stop-signals", default="SIGTERM,SIGINT,SIGHUP,SIGUSR1", metavar="LIST",
        help="signals that stop training at the next step boundary with a checkpoint saved (a second "
             "one exits at once); '' handles none",
    )
    train.add_argument(
        "--stop-timeout", type=int, default=300, metavar="S",
        help="with --nproc > 1: seconds the ranks get to save and exit after a stop signal before "
             "they are killed",
    )
    _add_launch_parser(sub)
    add_ckpt_parser(sub, PROG)
    from zerotrain.merge.command import add_merge_parser
    add_merge_parser(sub)
    _add_plot_parser(sub)
    from zerotrain.embedding.command import add_train_embedding_parser
    add_train_embedding_parser(sub)
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
                      help="where the PNGs go (default: RUN_DIR/plots of the first run)")
    plot.add_argument("--labels", nargs="+", default=(), metavar="NAME",
                      help="a legend name per run (default: the directory names)")


def _plot(args: argparse.Namespace) -> int:
    from zerotrain.plots import plot_pngs

    first = Path(args.runs[0])
    out = Path(args.out) if args.out else (first if first.is_dir() else first.parent) / "plots"
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
            "'--local_rank' (see zerotrain.launcher). Multi-node: run it on every node with the same "
            "--nnodes, --master-addr and --master-port and that node's --node-rank."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    launch.add_argument("--nproc", type=int, default=1, metavar="N", help="processes (ranks) on this node")
    launch.add_argument("--nnodes", type=int, default=1, metavar="N", help="number of nodes")
    launch.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node's index (0..nnodes-1)")
    launch.add_argument("--master-addr", default=None, metavar="HOST",
                        help="address of node 0 (required with --nnodes > 1; default 127.0.0.1)")
    launch.add_argument("--master-port", type=int, default=None, metavar="P",
                        help="rendezvous port on node 0 (default: a free port, single node only)")
    launch.add_argument("--no-local-rank", action="store_true",
                        help="never append --local_rank=N to the script's arguments")
    launch.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="restart all workers up to K times when one fails (torchrun's --max-restarts)")
    launch.add_argument("--stop-timeout", type=int, default=300, metavar="S",
                        help="seconds the workers get to exit after a forwarded SIGTERM/SIGINT/SIGHUP/SIGUSR1 "
                             "(a script opts in to saving on it with engine.install_signal_handlers())")
    launch.add_argument("script", metavar="SCRIPT", help="the training script (a .py file)")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments for the script, passed as they are")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``zerotrain`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except BrokenPipeError:  # `zerotrain ckpt inspect ... | head`: the reader left; no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail again
        return 128 + 13  # as a process ended by SIGPIPE


def _run(args: argparse.Namespace) -> int:
    try:
        if args.command == "ckpt":
            from zerotrain.checkpoint.command import run_ckpt
            return run_ckpt(args)
        if args.command == "launch":
            return _launch_script(args)
        if args.command == "merge":
            from zerotrain.merge.command import run_merge
            return run_merge(args)
        if args.command == "plot":
            return _plot(args)
        if args.command == "train-embedding":
            from zerotrain.embedding.command import run_train_embedding, worker_argv
            if args.nproc > 1 and not _inside_worker():
                return _run_torchrun(_rendezvous(args.nproc), ["-m", "zerotrain.cli", *worker_argv(args)])
            return run_train_embedding(args)
        if args.command == "train":
            _check_train_args(args)
            if args.nproc > 1 and not _inside_worker():
                return _launch(args)
            return _train(args)
    except CLIError as exc:
        _error(str(exc))
        return 2
    except Exception as exc:  # config errors: one clean line, no traceback
        if _is_config_error(exc):
            _error(str(exc))
            return 2
        from zerotrain.checkpoint import CheckpointError
        if isinstance(exc, CheckpointError):  # a bad checkpoint to resume from, or a failed save
            _error(str(exc))
            return 1
        raise
    return 0


def _error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)


def _config_error_type():
    try:
        from zerotrain.config import ConfigError
    except Exception:  # the config package may not be importable (yet)
        return None
    return ConfigError


def _is_config_error(exc: BaseException) -> bool:
    config_error = _config_error_type()
    return config_error is not None and isinstance(exc, config_error)


def _inside_worker() -> bool:
    return any(var in os.environ for var in _WORKER_ENV_VARS)


def _check_train_args(args: argparse.Namespace) -> None:
    """Reject what can be rejected before any process starts."""
    if args.nproc < 1:
        raise CLIError(f"--nproc must be >= 1, got {args.nproc}")
    if args.steps < 0:
        raise CLIError(f"--steps must be >= 0, got {args.steps}")
    if args.seq_len is not None and args.seq_len < 1:
        raise CLIError(f"--seq-len must be >= 1, got {args.seq_len}")
    if args.max_corpus_bytes < 1:
        raise CLIError(f"--max-corpus-bytes must be >= 1, got {args.max_corpus_bytes}")
    if args.save_every < 0:
        raise CLIError(f"--save-every must be >= 0, got {args.save_every}")
    if args.max_restarts < 0:
        raise CLIError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.stop_timeout < 0:
        raise CLIError(f"--stop-timeout must be >= 0, got {args.stop_timeout}")
    from zerotrain.lifecycle import parse_signals
    try:
        parse_signals(args.stop_signals)
    except ValueError as exc:
        raise CLIError(f"--stop-signals: {exc}") from None
    if not args.save_dir and not args.no_save:
        raise CLIError("--save-dir is empty (use --no-save to save no checkpoint)")
    if args.resume and args.no_save:
        raise CLIError("--resume reads --save-dir, which --no-save turns off")
    if not 0.0 <= args.val_fraction < 1.0:
        raise CLIError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    path = Path(args.config)
    if not path.is_file():
        raise CLIError(f"config file {args.config!r} not found")
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"cannot read config file {args.config!r}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise CLIError(
            f"config file {args.config!r} is not valid JSON: {exc.msg} "
            f"(line {exc.lineno}, column {exc.colno})"
        ) from None
    if not _inside_worker():
        # Validate the whole config once, for the world size the job will have, so a bad
        # key fails here instead of in every worker.
        try:
            from zerotrain.config import load_config
        except ImportError:
            return
        from zerotrain.monitor import check_monitor_libraries
        check_monitor_libraries(load_config(args.config, dp_world_size=args.nproc))  # e.g. tensorboard not installed


# Options a worker receives, in that order. `--nproc` is not among them: a worker knows it is
# one from the launcher's environment, and the launcher's own parser would stop at `--nproc`
# as an ambiguous abbreviation of its `--nproc-per-node` (argparse checks every argument,
# even those meant for the script). `--master-port` concerns only the launcher.
_WORKER_OPTIONS = ("config", "model", "steps", "seq_len", "max_corpus_bytes", "val_fraction",
                   "eval_interval", "eval_batches", "log_dir", "seed", "save_dir", "save_every",
                   "stop_signals")
_WORKER_FLAGS = ("no_save", "resume")


def _worker_argv(args: argparse.Namespace) -> list[str]:
    """The `train` arguments for each worker, spelled out in full as ``--option=value``."""
    argv = ["train"]
    for dest in _WORKER_OPTIONS:
        value = getattr(args, dest)
        if value is not None:
            argv.append(f"--{dest.replace('_', '-')}={value}")
    argv += [f"--{dest.replace('_', '-')}" for dest in _WORKER_FLAGS if getattr(args, dest)]
    return argv


def _launch(args: argparse.Namespace) -> int:
    """Re-run this command under torch.distributed.run with ``args.nproc`` workers."""
    return _run_torchrun(_rendezvous(args.nproc, master_port=args.master_port),
                         ["-m", "zerotrain.cli", *_worker_argv(args)], stop_signals=args.stop_signals,
                         max_restarts=args.max_restarts, stop_timeout=args.stop_timeout)


def _rendezvous(nproc: int, nnodes: int = 1, node_rank: int = 0, master_addr: Optional[str] = None,
                master_port: Optional[int] = None) -> list[str]:
    """torch.distributed.run's options for `nproc` workers per node: `--standalone` (a free port) for one
    node without a port, else a static rendezvous at master_addr:master_port."""
    if nnodes == 1 and master_port is None and master_addr is None:
        cmd = ["--standalone"]
    else:
        cmd = ["--nnodes", str(nnodes), "--node_rank", str(node_rank),
               "--master_addr", master_addr or "127.0.0.1", "--master_port", str(master_port or 29500)]
    return cmd + ["--nproc_per_node", str(nproc)]


def _agent_signals(stop_signals: str) -> str:
    """The signals torchrun's agent forwards to its workers: its own default set plus the stop signals."""
    from zerotrain.lifecycle import parse_signals
    names = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *(s.name for s in parse_signals(stop_signals))]
    return ",".join(dict.fromkeys(names))


def _run_torchrun(rendezvous: list[str], target: list[str], stop_signals: str = "SIGTERM,SIGINT,SIGHUP,SIGUSR1",
                  max_restarts: int = 0, stop_timeout: int = 300) -> int:
    """Run `python -m torch.distributed.run RENDEZVOUS TARGET`; return the job's exit status.

    The one place both `train --nproc` and `launch` start workers. The agent runs in its own session
    (a terminal's Ctrl-C reaches this process only, which forwards it once), forwards the stop signals to
    the workers and gives them `stop_timeout` seconds to save; it dies with this process (SIGKILL on parent
    death: its workers then die with it and commit nothing). A stop is reported by exit status 128 + the
    signal number, a crash by the agent's own non-zero status.
    """
    import signal
    import tempfile

    from zerotrain.lifecycle import STOP_FILE_ENV, kill_me_with_parent, parse_signals, read_stop_file

    cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--max_restarts", str(max_restarts),
           "--shutdown_timeout", str(stop_timeout), "--signals_to_handle", _agent_signals(stop_signals), *target]
    env = os.environ.copy()
    env.setdefault("OMP_NUM_THREADS", "1")
    # Workers must import this same zerotrain, wherever the launching interpreter found it.
    package_root = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if package_root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([package_root, *paths])
    handle, stop_file = tempfile.mkstemp(prefix="zerotrain-stop-")
    os.close(handle)
    env[STOP_FILE_ENV] = stop_file
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
    if stop is not None or received:
        sig = stop[0] if stop is not None else signal.Signals(received[0])
        _error(f"stopped by {sig.name}" + (f" ({stop[1]})" if stop is not None and stop[1] else "")
               + ("" if status == 0 or stop is not None else f"; the ranks exited with status {status}"))
        return 128 + int(sig)
    return status


def _launch_script(args: argparse.Namespace) -> int:
    """`zerotrain launch`: the user's script on every worker (zerotrain.launcher runs it there)."""
    from zerotrain.launcher import worker_target

    if args.nproc < 1:
        raise CLIError(f"--nproc must be >= 1, got {args.nproc}")
    if args.nnodes < 1:
        raise CLIError(f"--nnodes must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise CLIError(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}")
    if args.nnodes > 1 and (args.master_addr is None or args.master_port is None):
        raise CLIError("--nnodes > 1 needs --master-addr and --master-port (node 0's address and a free port)")
    if not Path(args.script).is_file():
        raise CLIError(f"script {args.script!r} not found")
    rendezvous = _rendezvous(args.nproc, args.nnodes, args.node_rank, args.master_addr, args.master_port)
    if args.max_restarts < 0 or args.stop_timeout < 0:
        raise CLIError("--max-restarts and --stop-timeout must be >= 0")
    return _run_torchrun(rendezvous, worker_target(args.script, args.script_args, not args.no_local_rank),
                         max_restarts=args.max_restarts, stop_timeout=args.stop_timeout)


def _train(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    import zerotrain
    from zerotrain.data import TokenBlockDataset, load_stdlib_corpus, split
    from zerotrain.models import GPT, GPTConfig
    from zerotrain.trainer import Trainer

    model_config = GPTConfig.preset(args.model)
    seq_len = args.seq_len if args.seq_len is not None else min(128, model_config.block_size)
    if seq_len > model_config.block_size:
        raise CLIError(
            f"--seq-len {seq_len} exceeds the block size ({model_config.block_size}) "
            f"of model {args.model!r}"
        )

    torch.manual_seed(args.seed)
    model = GPT(model_config)
    engine, _, _, _ = zerotrain.initialize(model=model, config=args.config)
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        micro = engine.train_micro_batch_size_per_gpu()

        tokens = load_stdlib_corpus(max_bytes=args.max_corpus_bytes)
        train_tokens, val_tokens = split(tokens, args.val_fraction)
        train_set = TokenBlockDataset(train_tokens, seq_len)
        if len(train_set) < world * micro:
            raise CLIError(
                f"the corpus gives {len(train_set)} training blocks of {seq_len} tokens, fewer "
                f"than one micro-batch per rank ({world} x {micro}); raise --max-corpus-bytes"
            )
        sampler = DistributedSampler(train_set, num_replicas=world, rank=rank,
                                     shuffle=True, seed=args.seed, drop_last=True)
        loader = DataLoader(train_set, batch_size=micro, sampler=sampler, drop_last=True)

        eval_loader = None
        val_set = TokenBlockDataset(val_tokens, seq_len) if val_tokens.numel() > 1 else None
        if val_set is not None and len(val_set) > 0 and args.eval_batches > 0:
            val_sampler = DistributedSampler(val_set, num_replicas=world, rank=rank, shuffle=False)
            eval_loader = DataLoader(val_set, batch_size=micro, sampler=val_sampler)

        save_dir = None if args.no_save else os.path.abspath(args.save_dir)
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if restarts > 0 and save_dir is not None and not args.resume:
            args.resume = True  # an elastic restart continues from the latest committed checkpoint
            if rank == 0:
                print(f"{PROG}: restart {restarts} of this job: resuming from the latest checkpoint", flush=True)
        if save_dir is not None:
            engine.claim_save_dir(save_dir)  # one job per save directory: refused before training, not at the first save
        if args.resume:
            path, _ = engine.load_checkpoint(save_dir)
            if rank == 0:
                print(f"{PROG}: resumed from {path} at step {engine.global_steps}" if path is not None else
                      f"{PROG}: nothing to resume in {save_dir}; starting from scratch", flush=True)
        if rank == 0:
            stage = engine.config.zero_optimization.stage
            print(
                f"{PROG}: model {args.model} ({model.num_parameters():,} params), "
                f"world size {world}, ZeRO stage {stage}, batch {engine.train_batch_size()} = "
                f"{micro} micro x {engine.gradient_accumulation_steps()} accumulation x "
                f"{world} ranks, seq {seq_len}, corpus {tokens.numel():,} bytes",
                flush=True,
            )
        trainer = Trainer(
            engine,
            loader,
            total_steps=args.steps,
            eval_data=eval_loader,
            log_dir=args.log_dir,
            steps_per_print=engine.config.steps_per_print,
            eval_interval=args.eval_interval,
            eval_batches=args.eval_batches,
            save_dir=save_dir,
            save_every=args.save_every,
            stop_signals=args.stop_signals or (),
        )
        summary = trainer.train()
        engine.close()  # pending saves committed, offload threads and files released
        dist.barrier()  # no rank tears its groups down while a peer still talks to it
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if summary.stopped_by is not None:
        where = (f"checkpoint {summary.checkpoint}; continue with --resume" if summary.checkpoint
                 else "no checkpoint saved (--no-save)")
        if rank == 0:
            print(f"{PROG}: stopped by {summary.stopped_by} at step {engine.global_steps}: {where}", flush=True)
            trainer.stop_request.tell_launcher(summary.stopped_by, f"step {engine.global_steps}, {where}")
        return trainer.stop_request.exit_status(summary.stopped_by)
    return 0


if __name__ == "__main__":
    sys.exit(main())
