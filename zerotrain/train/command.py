"""`zerotrain train`: train a Hugging Face model directory on local data, or a built-in preset on the stdlib.

``zerotrain train --config examples/zero2.json --nproc 2`` trains a built-in preset (a small Llama-architecture
model over bytes) on the Python standard library's source code with the given DeepSpeed-style config;
``--model DIR --data FILE ...`` trains a local Hugging Face model directory on local data files
(``zerotrain.models.hf``, ``zerotrain.data``). The model is built under ``zero.Init`` at ZeRO-3, its directory's
weights are read shard by shard (``load_weights``, with the vocabulary-growth overlay), the loop is
``zerotrain.trainer.Trainer``. `zerotrain.cli` adds the subcommand with `add_train_parser`, checks it with
`check_train_args`, starts ``--nproc`` workers with `worker_argv` and runs each with `run_train`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from zerotrain.command import PROG, CLIError, HelpFormatter, inside_worker
from zerotrain.train.flags import HF_FLAGS

if TYPE_CHECKING:
    from zerotrain.run.config import RunConfig

DEFAULT_STEPS = 50  # optimizer steps when neither --max-steps nor --num-train-epochs is given

__all__ = ["add_train_parser", "check_train_args", "effective_train_config", "already_trained", "worker_argv",
           "run_train"]


def add_train_parser(sub: Any) -> None:
    """Add the `train` subcommand to `sub`."""
    from zerotrain.data.corpus import DEFAULT_MAX_BYTES
    from zerotrain.models.hf import PRESETS

    train = sub.add_parser(
        "train",
        help="train a Hugging Face model directory on local data, or a built-in preset on the stdlib's source",
        description=(
            "Train a local Hugging Face causal-LM directory (--model DIR) or config (--model-config) on "
            "local data files (--data), or, without --data, a built-in preset (a byte-level Llama) on the "
            "Python standard library's own source files (no download). Batch sizes, optimizer, scheduler, "
            "precision and ZeRO stage come from the Hugging Face Trainer's flags (ZeRO-3 by default), over a "
            "DeepSpeed-style JSON config when --deepspeed/--config gives one."
        ),
        formatter_class=HelpFormatter,
    )
    from zerotrain.train.flags import add_max_steps_flag, add_training_flags
    from zerotrain.run.config import TRAIN_DEFAULTS
    add_training_flags(train, defaults=TRAIN_DEFAULTS)  # --config/--deepspeed, --learning-rate, --per-device-train-batch-size, ... (HF's names)
    from zerotrain.train.flags import add_fp8_flag
    add_fp8_flag(train)  # --fp8 [RECIPE]: the fp8 block (docs/fp8.md)
    train.add_argument(
        "--nproc", type=int, default=1, metavar="N",
        help="number of processes (ranks) on this machine; N > 1 re-launches this command "
             "under `python -m torch.distributed.run`",
    )
    train.add_argument(
        "--model", default=None, metavar="DIR|PRESET",
        help="an existing directory: a local Hugging Face model directory (config.json, model.safetensors or "
             "sharded model-*.safetensors + index, tokenizer files); anything else a preset (a directory named "
             "like a preset without config.json, e.g. a run directory tiny/, does not hide it: the preset is used "
             "and said so; Llama "
             f"architecture over bytes: {', '.join(PRESETS)}; tiny ~0.1M params, small ~6M, 70m ~71M). "
             "Default: small",
    )
    train.add_argument("--model-config", default=None, metavar="PATH",
                       help="a Hugging Face config.json (or its directory): random init, for pre-training; needs "
                            "--tokenizer")
    train.add_argument("--tokenizer", default=None, metavar="DIR",
                       help="tokenizer directory (AutoTokenizer; default: the model directory)")
    train.add_argument("--add-tokens", nargs="+", default=None, metavar="TOKEN",
                       help="add these special tokens to the tokenizer; the input embedding and output head grow "
                            "to its length (new rows from the old rows' mean and covariance, as transformers' "
                            "resize_token_embeddings does), at every ZeRO stage")
    train.add_argument("--data", nargs="+", default=None, metavar="PATH",
                       help="training data: .txt, .jsonl/.json (text or chat messages), .parquet, .csv files or "
                            "save_to_disk directories (docs/data.md); default: the stdlib corpus")
    train.add_argument("--eval-data", nargs="+", default=None, metavar="PATH",
                       help="evaluation data, same formats as --data")
    train.add_argument("--text-field", default="text", metavar="NAME",
                       help="the text field of json/jsonl/parquet/csv records")
    train.add_argument("--no-packing", action="store_true",
                       help="one document per sample, padded per batch (default: pack documents into "
                            "--seq-len blocks, never attending across documents)")
    train.add_argument("--num-proc", type=int, default=None, metavar="N",
                       help="tokenize with N processes (datasets.map)")
    train.add_argument("--skip-bad-records", action="store_true",
                       help="skip records that are not valid (counted and reported) instead of stopping")
    train.add_argument("--lora-r", type=int, default=None, metavar="R",
                       help="train a LoRA adapter of rank R (peft) instead of the whole model: the base stays frozen "
                            "(partitioned at ZeRO-3, no gradients or optimizer state); every checkpoint also holds "
                            "the adapter in PEFT's layout (adapter_model.safetensors + adapter_config.json)")
    train.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                       help="LoRA alpha (the update is scaled by A/R); default 2R")
    train.add_argument("--lora-dropout", type=float, default=0.0, metavar="P", help="dropout on the LoRA input")
    train.add_argument("--lora-target-modules", default=None, metavar="A,B,...",
                       help="module names to adapt (e.g. q_proj,k_proj,v_proj,o_proj, or all-linear); default: "
                            "peft's list for the architecture (q_proj,v_proj for Llama)")
    train.add_argument("--pipeline-parallel-size", "--pipeline-model-parallel-size", dest="pipeline_parallel_size",
                       type=int, default=None, metavar="N",
                       help="split the model's decoder layers over N pipeline stages (pipeline_parallel_size; "
                            "docs/pipeline.md): Llama, Qwen2 and Qwen3 architectures, ZeRO-0/1 per stage (the "
                            "default stage becomes 1); evaluation through its eval_batch, in whole batches of "
                            "--gradient-accumulation-steps micro-batches")
    add_max_steps_flag(train, f"optimizer steps to reach (wins over --num-train-epochs); default {DEFAULT_STEPS} "
                              "when neither is given")
    train.add_argument("--num-train-epochs", type=float, default=None, metavar="E",
                       help="passes over the training data (fractions allowed), when --max-steps is not given")
    train.add_argument(
        "--seq-len", type=int, default=None, metavar="T",
        help="tokens per training sequence (default with --data: 1024, without: 128; at most the model's "
             "max_position_embeddings)",
    )
    train.add_argument(
        "--max-corpus-bytes", type=int, default=DEFAULT_MAX_BYTES, metavar="N",
        help="read at most this many bytes of standard-library source as the corpus",
    )
    train.add_argument(
        "--val-fraction", type=float, default=None, metavar="F",
        help="fraction of the training data (its last samples) held out for evaluation; 0 disables it. Default: "
             "0.02 of the built-in corpus; with --data, none unless --eval-interval asks for evaluation (then "
             "0.02); not with --eval-data, which is the evaluation set",
    )
    train.add_argument(
        "--eval-steps", "--eval-interval", dest="eval_interval", type=int, default=0, metavar="N",
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
    train.add_argument(
        "--memory-timeline", type=float, nargs="?", const=0.05, default=None, metavar="SECONDS",
        help="write each rank's memory over time with the engine's phases (forward, backward, gather, reduce, "
             "optimizer step, save) to LOG_DIR/memory_timeline.rank{R}.jsonl, sampled every SECONDS "
             "(default 0.05) and at every phase boundary; `zerotrain plot LOG_DIR` draws them (needs --log-dir)",
    )
    train.add_argument("--seed", type=int, default=1234,
                       help="seed for model init and data order (same on every rank)")
    train.add_argument(
        "--output-dir", "--save-dir", dest="save_dir", default="checkpoints", metavar="DIR",
        help="save a checkpoint here (DIR/global_step<N>, DIR/latest) after the last step, relative "
             "to the current directory; the config's `checkpoint` block sets async_save, keep_last "
             "and verify_on_load",
    )
    train.add_argument("--save-steps", "--save-every", dest="save_every", type=int, default=0, metavar="N",
                       help="also save a checkpoint every N steps (0: only after the last step)")
    train.add_argument("--no-save", action="store_true", help="save no checkpoint at all")
    train.add_argument(
        "--resume", action="store_true",
        help="continue from the latest checkpoint in --save-dir: weights, optimizer, LR schedule, "
             "step, RNG and data position; starts from scratch if there is none. --steps is the "
             "total to reach, counting the steps already done",
    )
    from zerotrain.train.resume import add_resume_flag
    add_resume_flag(train)  # --resume-from-checkpoint PATH|TAG (HF's name)
    from zerotrain.command import add_node_flags
    add_node_flags(train)  # several nodes as torchrun takes them (docs/multinode.md)
    train.add_argument(
        "--max-restarts", type=int, default=0, metavar="K",
        help="with --nproc > 1 or several nodes: restart this node's ranks up to K times when one fails (the "
             "other nodes re-join); each restart resumes from the latest committed checkpoint in --save-dir (a "
             "stop by signal is never restarted)",
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


def check_train_args(args: argparse.Namespace) -> Optional["RunConfig"]:
    """Reject what can be rejected before any process starts. Outside a worker the run's config is built (and
    checked) here for the world size the job will have: returned, for `run_train` to take when this process is
    the run's only rank (None in a worker, which builds its own)."""
    if args.nproc < 1:
        raise CLIError(f"--nproc must be >= 1, got {args.nproc}")
    from zerotrain.command import node_rendezvous
    node_rendezvous(args)  # the node options (--nnodes, --node-rank, --rdzv-*) are checked before any process starts
    if args.num_train_epochs is not None and args.num_train_epochs <= 0:
        raise CLIError(f"--num-train-epochs must be > 0, got {args.num_train_epochs:g}")
    if args.steps is None and args.num_train_epochs is None:
        args.steps = DEFAULT_STEPS
    if args.seq_len is not None and args.seq_len < 1:
        raise CLIError(f"--seq-len must be >= 1, got {args.seq_len}")
    if args.per_device_eval_batch_size is not None and args.per_device_eval_batch_size < 1:
        raise CLIError(f"--per-device-eval-batch-size must be >= 1, got {args.per_device_eval_batch_size}")
    if args.num_proc is not None and args.num_proc < 1:
        raise CLIError(f"--num-proc must be >= 1, got {args.num_proc}")
    if args.memory_timeline is not None and (args.memory_timeline <= 0 or args.log_dir is None):
        raise CLIError("--memory-timeline needs --log-dir (the files go next to metrics.jsonl) and a sampling "
                       f"interval > 0 seconds, got {args.memory_timeline}")
    if args.lora_r is None and (args.lora_alpha is not None or args.lora_target_modules is not None):
        raise CLIError("--lora-alpha and --lora-target-modules need --lora-r")
    if args.lora_r is not None and args.lora_r < 1:
        raise CLIError(f"--lora-r must be >= 1, got {args.lora_r}")
    if not 0.0 <= args.lora_dropout < 1.0:
        raise CLIError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    if args.eval_data and not args.data:
        raise CLIError("--eval-data needs --data")
    if args.pipeline_parallel_size is not None and args.pipeline_parallel_size < 1:
        raise CLIError(f"--pipeline-parallel-size must be >= 1, got {args.pipeline_parallel_size}")
    for flag, paths in (("--data", args.data), ("--eval-data", args.eval_data)):
        for data_path in paths or ():
            if not os.path.exists(data_path):
                raise CLIError(f"{flag} {data_path}: no such file or directory")
    from zerotrain.models.hf import PRESETS, ModelError, load_tokenizer, preset_over_directory, resolve_model
    note = preset_over_directory(args.model)  # a `tiny/` that is no model does not hide the preset: said once
    if note is not None and not inside_worker():
        print(f"{PROG}: {note}", file=sys.stderr, flush=True)
    try:  # every file it names, before any process (a preset alone needs no transformers import here)
        if args.model_config is not None or args.tokenizer is not None or (
                args.model is not None and (args.model not in PRESETS or os.path.isdir(args.model))):
            source = resolve_model(args.model, args.model_config, args.tokenizer)
            if not inside_worker():
                load_tokenizer(source)  # one that cannot load (e.g. no tokenizer.json) fails here, not in every rank
    except ModelError as exc:
        raise CLIError(str(exc)) from None
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
    if args.resume and args.resume_from_checkpoint:
        raise CLIError("--resume continues from the latest checkpoint, --resume-from-checkpoint from the one it "
                       "names: give one")
    if args.val_fraction is not None and not 0.0 <= args.val_fraction < 1.0:
        raise CLIError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if args.val_fraction and args.eval_data:
        raise CLIError("--val-fraction holds part of --data out for evaluation, --eval-data names the evaluation "
                       "data: give one")
    if args.config is not None:
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
    if not inside_worker():
        # Validate the whole config once, for the world size the job will have, so a bad
        # key fails here instead of in every worker.
        from zerotrain.monitor import check_monitor_libraries
        from zerotrain.run.config import train_run_config
        from zerotrain.command import max_world_size, multi_node
        world = max_world_size(args)
        pipeline = args.pipeline_parallel_size or 1
        if world % pipeline:
            raise CLIError(f"--pipeline-parallel-size {pipeline} does not divide the {world} ranks of this job "
                           "(--nproc x --nnodes)")
        from zerotrain.config.base import quiet_warnings
        # launching ranks: their rank 0 shows the config's warnings, once for the job (this check only errors)
        with quiet_warnings() if args.nproc > 1 or multi_node(args) else contextlib.nullcontext():
            # the steps: once the data is read (--num-train-epochs alone), the schedule's counts open until then
            config = train_run_config(args, world_size=world)
            check_monitor_libraries(config.parsed)
        return config
    return None


def effective_train_config(args: argparse.Namespace) -> dict:
    """The config `--print-config` prints: file, flags and filled "auto" values for the job's world size."""
    from zerotrain.command import max_world_size
    from zerotrain.run.config import train_config

    return train_config(args, world_size=max_world_size(args))


def already_trained(args: argparse.Namespace) -> Optional[str]:
    """With --resume: the line to print instead of training when the latest checkpoint in --save-dir is already at
    or past --steps (the total to reach, as the HF Trainer's max_steps), before any process starts; else None."""
    if not args.resume or args.no_save:
        return None
    from zerotrain.checkpoint import latest_step

    latest = latest_step(os.path.abspath(args.save_dir))
    if latest is None or args.steps is None or latest[1] < args.steps:
        return None
    from zerotrain.run.lm import nothing_to_train
    return nothing_to_train(*latest, args.steps)


# Options a worker receives, in that order. `--nproc` is not among them: a worker knows it is
# one from the launcher's environment, and the launcher's own parser would stop at `--nproc`
# as an ambiguous abbreviation of its `--nproc-per-node` (argparse checks every argument,
# even those meant for the script). `--master-port` concerns only the launcher.
_WORKER_OPTIONS = ("config", "zero_stage", *HF_FLAGS, "num_train_epochs", "per_device_eval_batch_size",
                   "model", "model_config", "tokenizer", "text_field", "num_proc", "steps", "seq_len",
                   "pipeline_parallel_size", "fp8",
                   "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
                   "max_corpus_bytes", "val_fraction", "eval_interval", "eval_batches", "log_dir", "seed",
                   "save_dir", "save_every", "stop_signals", "memory_timeline", "resume_from_checkpoint")
_WORKER_LISTS = ("data", "eval_data")
_WORKER_FLAGS = ("no_save", "resume", "no_packing", "skip_bad_records", "bf16", "fp16", "gradient_checkpointing")


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The `train` arguments for each worker, spelled out in full as ``--option=value``."""
    argv = ["train"]
    for dest in _WORKER_OPTIONS:
        value = getattr(args, dest)
        if value is not None:
            argv.append(f"--{dest.replace('_', '-')}={value}")
    for dest in _WORKER_LISTS:
        if getattr(args, dest):
            argv += [f"--{dest.replace('_', '-')}", *(os.path.abspath(p) for p in getattr(args, dest))]
    if args.add_tokens:
        argv += ["--add-tokens", *args.add_tokens]
    argv += [f"--{dest.replace('_', '-')}" for dest in _WORKER_FLAGS if getattr(args, dest)]
    return argv


def run_train(args: argparse.Namespace, config: Optional["RunConfig"] = None) -> int:
    """One rank of `zerotrain train` (`zerotrain.run.lm.run_lm`), with the `RunConfig` `check_train_args` built
    when this process is the run's only rank; the exit status."""
    from zerotrain.run.lm import run_lm

    return run_lm(args, config)
