"""The ``zerotrain`` command.

``zerotrain train --config examples/zero2.json --nproc 2`` trains the built-in byte-level
GPT on the Python standard library's source code with the given DeepSpeed-style config.
With ``--nproc N > 1`` the command re-launches itself under PyTorch's own launcher
(``python -m torch.distributed.run``), one worker process per rank. It saves a checkpoint
in ``checkpoints/`` after the last step (``--save-every N`` also every N steps) and
continues from the latest one with ``--resume``. ``zerotrain ckpt inspect|verify|export``
are the offline checkpoint tools (``zerotrain.checkpoint.command``). ``zerotrain merge`` merges
models tensor by tensor (``zerotrain.merge.command``).
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
    add_ckpt_parser(sub, PROG)
    from zerotrain.merge.command import add_merge_parser
    add_merge_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``zerotrain`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "ckpt":
            from zerotrain.checkpoint.command import run_ckpt
            return run_ckpt(args)
        if args.command == "merge":
            from zerotrain.merge.command import run_merge
            return run_merge(args)
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
        load_config(args.config, dp_world_size=args.nproc)


# Options a worker receives, in that order. `--nproc` is not among them: a worker knows it is
# one from the launcher's environment, and the launcher's own parser would stop at `--nproc`
# as an ambiguous abbreviation of its `--nproc-per-node` (argparse checks every argument,
# even those meant for the script). `--master-port` concerns only the launcher.
_WORKER_OPTIONS = ("config", "model", "steps", "seq_len", "max_corpus_bytes", "val_fraction",
                   "eval_interval", "eval_batches", "log_dir", "seed", "save_dir", "save_every")
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
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if args.master_port is not None:
        cmd += ["--nnodes", "1", "--node_rank", "0",
                "--master_addr", "127.0.0.1", "--master_port", str(args.master_port)]
    else:
        cmd += ["--standalone"]
    cmd += ["--nproc_per_node", str(args.nproc), "-m", "zerotrain.cli", *_worker_argv(args)]

    env = os.environ.copy()
    env.setdefault("OMP_NUM_THREADS", "1")
    # Workers must import this same zerotrain, wherever the launching interpreter found it.
    package_root = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if package_root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([package_root, *paths])
    try:
        return subprocess.run(cmd, env=env).returncode
    except KeyboardInterrupt:  # the launcher forwards the signal to its workers
        return 130


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
        )
        trainer.train()
        engine.close()  # pending saves committed, offload threads and files released
        dist.barrier()  # no rank tears its groups down while a peer still talks to it
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
