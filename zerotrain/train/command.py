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
from typing import Any, Optional

from zerotrain.command import PROG, CLIError, HelpFormatter, inside_worker
from zerotrain.train.flags import HF_FLAGS, optimizer_from_flags

# The share of the data held out for evaluation when nothing else says: the built-in corpus' tail; with --data, when
# --eval-interval asks for evaluation without --eval-data or --val-fraction.
DEFAULT_VAL_FRACTION = 0.02
# where this command's defaults differ from TrainingArguments' (HF names): a progress line every 10 steps
TRAIN_DEFAULTS = {"logging_steps": 10}
DEFAULT_STEPS = 50  # optimizer steps when neither --max-steps nor --num-train-epochs is given

__all__ = ["add_train_parser", "check_train_args", "already_trained", "worker_argv", "run_train", "lora_options", "model_engine",
           "train_model", "train_engine", "load_weights"]


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
    from zerotrain.train.flags import add_training_flags
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
    train.add_argument("--max-steps", "--steps", dest="steps", type=int, default=None, metavar="N",
                       help=f"optimizer steps to reach (wins over --num-train-epochs); default {DEFAULT_STEPS} when "
                            "neither is given")
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


def check_train_args(args: argparse.Namespace) -> None:
    """Reject what can be rejected before any process starts."""
    if args.nproc < 1:
        raise CLIError(f"--nproc must be >= 1, got {args.nproc}")
    from zerotrain.command import node_rendezvous
    node_rendezvous(args)  # the node options (--nnodes, --node-rank, --rdzv-*) are checked before any process starts
    if args.steps is not None and args.steps < 0:
        raise CLIError(f"--max-steps must be >= 0, got {args.steps}")
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
        from zerotrain.config import load_config
        from zerotrain.monitor import check_monitor_libraries
        from zerotrain.command import max_world_size, multi_node
        world = max_world_size(args)
        pipeline = args.pipeline_parallel_size or 1
        if world % pipeline:
            raise CLIError(f"--pipeline-parallel-size {pipeline} does not divide the {world} ranks of this job "
                           "(--nproc x --nnodes)")
        from zerotrain.config.base import quiet_warnings
        # launching ranks: their rank 0 shows the config's warnings, once for the job (this check only errors)
        with quiet_warnings() if args.nproc > 1 or multi_node(args) else contextlib.nullcontext():
            config = train_config(args, world_size=world, steps=args.steps or 1)  # the steps: once the data is read
            check_monitor_libraries(load_config(config, dp_world_size=world // pipeline))


def train_config(args: argparse.Namespace, *, world_size: int, hidden_size: Optional[int] = None,
                 steps: Optional[int] = None) -> dict:
    """The run's effective config (a dict): the --config file with the HF flags over it and its "auto" values filled,
    or the flags alone (ZeRO-3); `zerotrain.train.flags.effective_config` for `steps` optimizer steps (default
    --max-steps). With --num-train-epochs alone the steps are known only once the data is read (`run_train` reads it
    before building the engine); before that a schedule that decays over the run is laid out over `steps` (the
    check before launching, the model's build), or refused when it is None too (`--print-config`: one clear
    error)."""
    from zerotrain.config import ConfigError
    from zerotrain.train.flags import effective_config

    if hidden_size is None and args.config is not None:  # the model's hidden size fills "auto" bucket sizes
        from zerotrain.models.hf import ModelError, resolve_model
        try:
            hidden = getattr(resolve_model(args.model, args.model_config, args.tokenizer).config, "hidden_size", None)
        except ModelError as exc:
            raise CLIError(str(exc)) from None
        hidden_size = hidden if isinstance(hidden, int) else None
    pipeline = getattr(args, "pipeline_parallel_size", None) or 1
    try:
        config = effective_config(args, world_size=world_size // pipeline,
                                  num_training_steps=args.steps if steps is None else steps,
                                  hidden_size=hidden_size, defaults=TRAIN_DEFAULTS)
        if pipeline > 1:  # the stages split the world; ZeRO-2/3 are refused with a pipeline: stage 1 by default
            config["pipeline_parallel_size"] = pipeline
            if args.config is None and args.zero_stage is None:
                config["zero_optimization"]["stage"] = 1
        return config
    except ConfigError as exc:
        if args.steps is None and steps is None and "needs its number of steps" in str(exc):
            raise CLIError("--print-config with --num-train-epochs and no --max-steps: the run's steps (and the "
                           "learning-rate decay's total_num_steps) are known only once the data is read; give "
                           "--max-steps to see them") from None
        raise


def already_trained(args: argparse.Namespace) -> Optional[str]:
    """With --resume: the line to print instead of training when the latest checkpoint in --save-dir is already at
    or past --steps (the total to reach, as the HF Trainer's max_steps), before any process starts; else None."""
    if not args.resume or args.no_save:
        return None
    from zerotrain.checkpoint import latest_step

    latest = latest_step(os.path.abspath(args.save_dir))
    if latest is None or args.steps is None or latest[1] < args.steps:
        return None
    return nothing_to_train(*latest, args.steps)


def nothing_to_train(path: str, step: int, steps: int) -> str:
    """What a resumed run says when its checkpoint already holds the steps asked for."""
    return (f"{PROG}: nothing to train: --steps {steps} is the total to reach, counting the steps done, and the "
            f"checkpoint {path} is at step {step}; give --steps above {step} to train on")


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


def run_train(args: argparse.Namespace) -> int:
    """One rank of `zerotrain train`: build the model, read the data (the steps --num-train-epochs makes), build the
    engine with the schedule over those steps, load weights or resume, wire the data, run the `Trainer`; the exit
    status (128 + the signal's number after a stop)."""
    from zerotrain import dist

    from zerotrain.models.hf import (ModelError, count_parameters, grow_vocab, load_tokenizer, resolve_model,
                                     tokenizer_files)
    from zerotrain.run import resume_after_restart, stop_status
    from zerotrain.trainer import Trainer

    try:
        source = resolve_model(args.model, args.model_config, args.tokenizer)
        tokenizer = load_tokenizer(source)
        added = list(args.add_tokens or ()) + _chat_tokens(args, tokenizer)
        known = set(tokenizer.get_vocab())
        old_vocab = grow_vocab(source, tokenizer, added)  # the model is built at the new size
        new_ids = sorted({tokenizer.convert_tokens_to_ids(token) for token in added if token not in known})
    except ModelError as exc:
        raise CLIError(str(exc)) from None
    max_positions = int(getattr(source.config, "max_position_embeddings", 0) or 0) or None
    default_len = 1024 if args.data else 128
    seq_len = args.seq_len if args.seq_len is not None else min(default_len, max_positions or default_len)
    if max_positions is not None and seq_len > max_positions:
        raise CLIError(f"--seq-len {seq_len} exceeds the max_position_embeddings ({max_positions}) of model "
                       f"{source.name!r}")

    lora = lora_options(args)
    if lora is not None and new_ids:
        # the new tokens' rows of the embedding (and an untied head) train beside the adapter, or they would
        # keep their initial values (peft's trainable_token_indices)
        lora = dataclasses.replace(lora, trainable_tokens=tuple(new_ids))
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{PROG}: LoRA: the rows of the {len(new_ids)} added tokens train too", flush=True)
    hidden = getattr(source.config, "hidden_size", None)
    hidden = hidden if isinstance(hidden, int) else None
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # The model and the data come before the engine, as in the HF Trainer: the steps --num-train-epochs makes are
    # known once the data is read, and the learning-rate schedule is laid out over them. The config before that
    # (`layout`) fixes all the model needs (dtype, stage); only the schedule's step counts wait for the data.
    layout = train_config(args, world_size=world_size, hidden_size=hidden, steps=args.steps or 1)
    from zerotrain.config import load_config
    from zerotrain.precision import training_dtype
    run_config = load_config(layout)
    dist.init_distributed(timeout=run_config.comm_timeout_seconds)
    dtype = training_dtype(run_config.precision)
    try:
        model = train_model(source, layout, seed=args.seed, lora=lora)
    except ModelError as exc:
        raise CLIError(str(exc)) from None
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        if args.data:
            data = _local_sets(args, model, tokenizer, seq_len, dtype)
        else:
            data = _stdlib_sets(args, seq_len)
        # the global batch the engine will have (micro x accumulation x data-parallel ranks)
        dp_world = world // (int(run_config.tensor_parallel.autotp_size) * int(run_config.sequence_parallel_size)
                             * int(run_config.pipeline_parallel_size))
        global_batch = load_config(layout, dp_world_size=dp_world).train_batch_size
        steps_per_epoch = max(1, data.samples // global_batch)  # full global batches in one pass
        if args.steps is None:  # --num-train-epochs alone: the steps those passes make (the HF Trainer's max_steps)
            args.steps = math.ceil(args.num_train_epochs * steps_per_epoch)
        config = train_config(args, world_size=world_size, hidden_size=hidden)  # the schedule over those steps
        engine = train_engine(model, config, lora, decay_groups=optimizer_from_flags(args))
        if engine.train_batch_size() != global_batch:
            raise CLIError(f"the engine's global batch is {engine.train_batch_size()}, not the {global_batch} the "
                           "config gives: set train_micro_batch_size_per_gpu (the memory budget chose it)")
        micro = engine.train_micro_batch_size_per_gpu()
        # ranks that see different samples: tensor- and sequence-parallel peers share theirs
        dp_rank, dp_size = engine.topology.data_parallel_rank, engine.dp_world_size
        engine.add_checkpoint_files(tokenizer_files(tokenizer))  # from_pretrained(checkpoint) finds the tokenizer
        data_text, make_loader, eval_loader, eval_batches = data.loaders(
            args, micro=micro, global_batch=global_batch, dp_rank=dp_rank, dp_size=dp_size)

        save_dir = None if args.no_save else os.path.abspath(args.save_dir)
        args.resume = resume_after_restart(args.resume, save_dir, rank)  # an elastic restart resumes
        if rank == 0:  # the run's record of what it trained with (file, flags, filled "auto" values)
            from zerotrain.train.flags import write_effective_config
            for directory in {d for d in (save_dir, args.log_dir) if d is not None}:
                write_effective_config(config, directory)
        if save_dir is not None:
            engine.claim_save_dir(save_dir)  # one job per save directory: refused before training, not at the first save
        path = None
        base_loaded = False
        from zerotrain.train.resume import load_for_resume, wants_resume
        if wants_resume(args) and lora is not None and source.weights_dir is not None:
            # The base first: a checkpoint saved with checkpoint.adapters_only holds only the adapter (a full
            # one overwrites it all again).
            load_weights(engine, source, model, old_vocab, save_dir, args.seed)
            base_loaded = True
        if wants_resume(args):
            path, _ = load_for_resume(engine, args, save_dir, config)
            if path is not None and args.steps is not None and engine.global_steps >= args.steps:  # e.g. an elastic restart after the end
                if rank == 0:
                    print(nothing_to_train(path, engine.global_steps, args.steps), flush=True)
                engine.close()
                dist.barrier()
                return 0
            if rank == 0:
                print(f"{PROG}: resumed from {path} at step {engine.global_steps}" if path is not None else
                      f"{PROG}: nothing to resume in {save_dir}; starting from scratch", flush=True)
        if path is None and source.weights_dir is not None and not base_loaded:
            # Each rank reads only its own shard ranges of the safetensors files, in the file's dtype into the
            # fp32 masters (a ZeRO-3 rank never holds the whole model).
            load_weights(engine, source, model, old_vocab, save_dir, args.seed)
            if rank == 0 and old_vocab is not None:
                print(f"{PROG}: vocabulary grown from {old_vocab} to {source.config.vocab_size} tokens", flush=True)
        loader = make_loader(engine.global_samples)  # a resumed run continues at the exact next sample
        if rank == 0:
            stage = engine.config.zero_optimization.stage
            weights = (f"weights from {path}" if path is not None else  # resumed: the checkpoint's
                       f"weights from {source.weights_dir}" if source.weights_dir else "random init")
            print(
                f"{PROG}: model {source.name} ({type(model).__name__}, {count_parameters(model):,} params, "
                f"{weights}), world size {world}, ZeRO stage {stage}, batch {engine.train_batch_size()} = "
                f"{micro} micro x {engine.gradient_accumulation_steps()} accumulation x "
                f"{dp_size} ranks, seq {seq_len}, {data_text}; {args.steps} steps = "
                f"{args.steps / steps_per_epoch:.2f} epochs of {steps_per_epoch} steps",
                flush=True,
            )
            for line in _start_notes(args, model, lora):
                print(line, flush=True)
        step, evaluator = None, None
        if int(run_config.pipeline_parallel_size) > 1:  # whole batches through train_batch (train.pipeline)
            step, evaluator = _pipeline_step(args, engine, loader, eval_loader, eval_batches, seq_len)
            loader, eval_loader = None, None
        trainer = Trainer(
            engine,
            loader,
            step=step,
            total_steps=args.steps,
            eval_data=eval_loader,
            log_dir=args.log_dir,
            memory_timeline=args.memory_timeline or 0.0,
            steps_per_print=engine.config.steps_per_print,
            eval_interval=args.eval_interval,
            eval_batches=eval_batches,
            save_dir=save_dir,
            save_every=args.save_every,
            stop_signals=args.stop_signals or (),
            steps_per_epoch=steps_per_epoch,
            evaluator=evaluator,
        )
        summary = trainer.train()
        engine.close()  # pending saves committed, offload threads and files released
        dist.barrier()  # no rank tears its groups down while a peer still talks to it
    finally:
        dist.destroy_process_group()
    status = stop_status(summary, trainer.stop_request, engine.global_steps, rank)
    return 0 if status is None else status


def _pipeline_step(args: argparse.Namespace, engine, loader, eval_loader, eval_batches: int, seq_len: int):
    """`(step, evaluator)` of a pipeline run (`train.pipeline`): whole batches through `train_batch`, the
    evaluation (when there is eval data) through `eval_batch`, micro-batches of the training size."""
    from zerotrain import dist
    from zerotrain.train.pipeline import PipelineEvaluator, PipelineLMStep

    reads = engine.is_first_stage() or engine.is_last_stage()
    step = PipelineLMStep(engine, loader if reads else None, seq_len)
    evaluator = None
    if eval_loader is not None:
        micro = engine.train_micro_batch_size_per_gpu()
        if args.per_device_eval_batch_size not in (None, micro):  # a PipelineStage exchanges fixed shapes
            raise CLIError(f"--per-device-eval-batch-size {args.per_device_eval_batch_size} with "
                           f"--pipeline-parallel-size: a pipeline evaluates micro-batches of the training size "
                           f"({micro})")
        if engine.config.pipeline.schedule == "zbv_zero_bubble":
            raise CLIError("evaluation with pipeline.schedule 'zbv_zero_bubble' is not available (torch's ZBV "
                           "schedule has no forward-only run): choose another schedule or give no eval data")
        try:
            evaluator = PipelineEvaluator(engine, eval_loader, eval_batches, seq_len)
        except ValueError as exc:
            raise CLIError(f"--eval-batches: {exc}") from None
    if dist.get_rank() == 0:
        what = (f"evaluation {evaluator.batches} micro-batches per rank through eval_batch" if evaluator is not None
                else "no evaluation data")
        schedule = engine.schedule_name
        if schedule != engine.config.pipeline.schedule:
            schedule += (f" in place of {engine.config.pipeline.schedule}: {engine.gradient_accumulation_steps()} "
                         f"micro-batch(es) per step, fewer than the stages")
        print(f"{PROG}: pipeline: {engine.num_stages} stages ({schedule}), "
              f"micro-batches padded to --seq-len; {what}", flush=True)
    return step, evaluator


def _start_notes(args: argparse.Namespace, model, lora) -> list[str]:
    """Rank 0's lines after the start line: LoRA's trainable share (as peft's print_trainable_parameters says it,
    from its own count, partitioned parameters included) and where metrics go when --log-dir is not given."""
    notes = []
    if lora is not None:
        trainable, total = model.get_nb_trainable_parameters()
        notes.append(f"{PROG}: LoRA: trainable params: {trainable:,} || all params: {total:,} || "
                     f"trainable%: {100 * trainable / total:.4f}")
    if args.log_dir is None:
        notes.append(f"{PROG}: metrics go to this output only; --log-dir DIR also writes them to DIR/metrics.jsonl "
                     "and DIR/summary.json")
    return notes


def lora_options(args: argparse.Namespace):
    """--lora-* as ``zerotrain.models.hf.LoraOptions`` (None without --lora-r)."""
    if getattr(args, "lora_r", None) is None:
        return None
    from zerotrain.models.hf import LoraOptions

    targets = None
    if args.lora_target_modules:
        targets = tuple(name.strip() for name in args.lora_target_modules.split(",") if name.strip())
    return LoraOptions(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout, target_modules=targets)


def _chat_tokens(args: argparse.Namespace, tokenizer) -> list[str]:
    """With chat ``messages`` in --data/--eval-data: the chat template's special tokens the tokenizer lacks (a
    tokenizer without a template gets ChatML first), to be added as --add-tokens are (zerotrain.data.chat)."""
    from zerotrain.data.chat import has_chat_records, prepare_chat_tokenizer
    from zerotrain.data.records import BadRecordError

    paths = [*(args.data or ()), *(args.eval_data or ())]
    try:
        if not paths or not has_chat_records(paths, text_field=args.text_field):
            return []
    except (BadRecordError, OSError) as exc:
        raise CLIError(str(exc)) from None
    had_template = bool(getattr(tokenizer, "chat_template", None))
    tokens = [t for t in prepare_chat_tokenizer(tokenizer) if t not in (args.add_tokens or ())]
    if int(os.environ.get("RANK", "0")) == 0 and (tokens or not had_template):
        print(f"{PROG}: chat data: " + ("" if had_template else "the tokenizer has no chat template, using ChatML; ")
              + (f"adding the template's special tokens {', '.join(tokens)}" if tokens else "no tokens to add"),
              flush=True)
    return tokens


def model_engine(source, config, seed: int = 0, lora=None):
    """``(engine, model)``: `train_model` under `train_engine` (the model of a resolved ``--model``,
    ``zerotrain.models.hf.ModelSource``); its directory's weights are not read yet (``engine.load_checkpoint(
    source.weights_dir, load_module_only=True)`` reads each rank's own shard ranges)."""
    model = train_model(source, config, seed=seed, lora=lora)
    return train_engine(model, config, lora), model


def train_model(source, config: dict, seed: int = 0, lora=None):
    """The model of a resolved ``--model`` for `config`, before any engine (weights not read yet).

    At ZeRO-3 the model is built inside ``zero.Init`` in the config's dtype: every module is partitioned as
    soon as it is built, so the whole model never exists on one rank. Elsewhere a model with weights to load
    is built in the config's dtype; a random init in fp32 (the engine casts; its fp32 masters keep the init).
    With ``lora`` (``zerotrain.models.hf.LoraOptions``) peft wraps the model with LoRA adapters: only the
    adapters train; at ZeRO-3 the frozen base stays partitioned. A config with an ``activation_checkpointing``
    block (``--gradient-checkpointing``) turns on the model's gradient checkpointing with zerotrain's function.
    """
    import torch

    from zerotrain.config import load_config
    from zerotrain.models.hf import apply_lora, build_model
    from zerotrain.precision import training_dtype
    from zerotrain.zero import GatheredParameters, Init

    run_config = load_config(config)
    dtype = training_dtype(run_config.precision)
    stage3 = run_config.zero_optimization.stage == 3
    init = Init(config=config, dtype=dtype, timeout_seconds=run_config.comm_timeout_seconds) if stage3 else None
    build_dtype = dtype if (stage3 or source.weights_dir is not None) else torch.float32
    model = build_model(source, build_dtype, init=init, seed=seed)
    if lora is not None:
        # peft reads the trainable-token rows of the embedding (and head) when it wraps them: gathered whole for
        # it at ZeRO-3 (their values do not matter: load_weights sets the rows from the weights it loads)
        embeddings = [m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
        with GatheredParameters(embeddings, enabled=stage3 and bool(lora.trainable_tokens)):
            model = apply_lora(model, lora, base_dir=source.weights_dir, seed=seed)
    if "activation_checkpointing" in config:  # --gradient-checkpointing, or a file's block: the model's own layers
        from zerotrain.checkpointing import enable_hf_gradient_checkpointing
        enable_hf_gradient_checkpointing(model.get_base_model() if lora is not None else model)
    return model


def weight_decay_groups(model, weight_decay: float) -> list[dict]:
    """The HF Trainer's parameter groups for the optimizer it builds itself (`Trainer.create_optimizer`): weight decay
    on the trainable parameters transformers' `Trainer.get_decay_parameter_names` names, none on the others (biases,
    LayerNorm / RMSNorm weights); empty groups left out."""
    import transformers

    # an instance method that reads only the model: transformers' own rule, whatever its version
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for name, p in named if name in decay], "weight_decay": weight_decay},
              {"params": [p for name, p in named if name not in decay], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def train_engine(model, config: dict, lora=None, decay_groups: bool = False):
    """``zerotrain.initialize`` of a `train_model` model; with ``lora`` every checkpoint also holds the adapter in
    PEFT's layout (gathered at each save: collective). ``decay_groups`` (the AdamW built from the flags,
    `zerotrain.train.flags.optimizer_from_flags`): the HF Trainer's groups (`weight_decay_groups`), no decay on
    biases and norm weights, where the weight decay is not 0 (with 0 one group, the same steps)."""
    import zerotrain

    weight_decay = ((config.get("optimizer") or {}).get("params") or {}).get("weight_decay", 0.0)
    groups = weight_decay_groups(model, weight_decay) if decay_groups and weight_decay else None
    engine, _, _, _ = zerotrain.initialize(model=model, config=config, model_parameters=groups)
    if lora is not None:
        from zerotrain.models.hf import adapter_files
        engine.add_checkpoint_files(lambda: adapter_files(engine.full_state_dict(trainable_only=True), model))
    return engine


def load_weights(engine, source, model, old_vocab: Optional[int] = None, save_dir: Optional[str] = None,
                 seed: int = 0) -> None:
    """Load the model directory's weights into ``engine``, each rank reading its own shard ranges.

    With ``old_vocab`` (``zerotrain.models.hf.grow_vocab`` grew the vocabulary, --add-tokens) the embedding and
    head grow to config.vocab_size: rank 0 writes the resized tensors as an overlay of the directory
    (``zerotrain.models.hf.write_resized``) where every rank reads it (``save_dir``; without one the temp
    directory, which must then be shared by the ranks), every rank loads from it, rank 0 removes it."""
    from zerotrain.models.hf import trained_token_rows, write_resized

    if old_vocab is None and not trained_token_rows(model):
        engine.load_checkpoint(source.weights_dir, load_module_only=True)
        return
    # the overlay also holds the rows LoRA's trainable tokens start from (the base rows, resized or not)
    old_vocab = old_vocab if old_vocab is not None else int(source.config.vocab_size)
    import shutil
    import tempfile
    import uuid

    from zerotrain.comm import Comm

    comm = Comm(None, engine.global_rank, engine.world_size)
    token = comm.all_gather_object(uuid.uuid4().hex[:12])[0]  # one name for the whole job
    overlay = os.path.join(save_dir or tempfile.gettempdir(), f".zerotrain-resized-{token}")
    error = None
    if engine.global_rank == 0:
        try:
            write_resized(source, model, old_vocab, overlay, seed=seed)
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            error = f"{type(exc).__name__}: {exc}"
    failed = [e for e in comm.all_gather_object(error) if e]
    if failed:
        raise CLIError(f"cannot resize the vocabulary of {source.weights_dir} (rank 0): {failed[0]}")
    try:
        engine.load_checkpoint(overlay, load_module_only=True)
    finally:
        comm.all_gather_object(None)  # every rank has read it
        if engine.global_rank == 0:
            shutil.rmtree(overlay, ignore_errors=True)


class _Data:
    """The run's data, read before the engine exists (`samples`: training samples in one pass, for the steps an
    epoch makes); `loaders` wires it to the engine's batch sizes and data-parallel position:
    ``(text, make_loader(consumed samples), eval loader, eval batches)``."""

    def __init__(self, samples: int, loaders) -> None:
        self.samples = samples
        self.loaders = loaders


def _stdlib_sets(args: argparse.Namespace, seq_len: int) -> _Data:
    """The demo's data: the standard library's source as bytes, in (input_ids, labels) blocks."""
    from zerotrain.data import TokenBlockDataset, load_stdlib_corpus, split

    tokens = load_stdlib_corpus(max_bytes=args.max_corpus_bytes)
    train_tokens, val_tokens = split(tokens, DEFAULT_VAL_FRACTION if args.val_fraction is None else args.val_fraction)
    train_set = TokenBlockDataset(train_tokens, seq_len)
    val_set = TokenBlockDataset(val_tokens, seq_len) if val_tokens.numel() > 1 else None

    def loaders(args: argparse.Namespace, *, micro: int, global_batch: int, dp_rank: int, dp_size: int):
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        if len(train_set) < dp_size * micro:
            raise CLIError(
                f"the corpus gives {len(train_set)} training blocks of {seq_len} tokens, fewer "
                f"than one micro-batch per rank ({dp_size} x {micro}); raise --max-corpus-bytes"
            )
        sampler = DistributedSampler(train_set, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=args.seed,
                                     drop_last=True)
        loader = DataLoader(train_set, batch_size=micro, sampler=sampler, drop_last=True, collate_fn=_causal_blocks)
        eval_loader = None
        if val_set is not None and len(val_set) > 0 and args.eval_batches > 0:
            val_sampler = DistributedSampler(val_set, num_replicas=dp_size, rank=dp_rank, shuffle=False)
            eval_loader = DataLoader(val_set, batch_size=args.per_device_eval_batch_size or micro,
                                     sampler=val_sampler, collate_fn=_causal_blocks)
        # The Trainer skips the batches a resumed run consumed (this sampler does not know its position).
        return f"corpus {tokens.numel():,} bytes", (lambda consumed: loader), eval_loader, args.eval_batches

    return _Data(len(train_set), loaders)


def _causal_blocks(items: list) -> dict:
    """A batch of (x, y) byte blocks as a causal LM's input: the model shifts the labels itself."""
    import torch

    ids = torch.stack([x for x, _ in items])
    return {"input_ids": ids, "labels": ids}


def _local_sets(args: argparse.Namespace, model, tokenizer, seq_len: int, dtype) -> _Data:
    """--data / --eval-data through zerotrain.data: tokenized once per node (cached), packed or padded."""
    from zerotrain import dist
    from zerotrain.comm import Comm
    from zerotrain.data import BadRecordError, DataConfig, build_data

    rank = dist.get_rank()
    world_comm = Comm(None, rank, dist.get_world_size())  # every rank: one tokenizer per node
    # a PEFT-wrapped model (--lora-r) passes position_ids and masks on to its base model: ask the base
    base_model = model.get_base_model() if hasattr(model, "get_base_model") else model

    def build(paths):
        config = DataConfig(paths=list(paths), seq_len=seq_len, packing=not args.no_packing,
                            text_field=args.text_field, skip_bad_records=args.skip_bad_records,
                            num_proc=args.num_proc, seed=args.seed)
        try:
            return build_data(config, tokenizer, comm=world_comm, model=base_model, mask_dtype=dtype)
        except (BadRecordError, ValueError) as exc:
            raise CLIError(str(exc)) from None

    train = build(args.data)
    evals, held = _eval_set(args, train, build)
    if held:
        train = held[0]
    if rank == 0 and train.skipped:
        print(f"{PROG}: skipped {len(train.skipped)} bad record(s) (--skip-bad-records), first: {train.skipped[0]}",
              flush=True)

    def loaders(args: argparse.Namespace, *, micro: int, global_batch: int, dp_rank: int, dp_size: int):
        def make_loader(consumed: int):
            try:
                return train.loader(micro_batch_size=micro, global_batch_size=global_batch,
                                    dp_rank=dp_rank, dp_size=dp_size, consumed_samples=consumed)
            except ValueError as exc:
                raise CLIError(f"--data: {exc}") from None

        eval_loader, eval_batches = None, args.eval_batches
        if evals is not None and args.eval_batches > 0:
            # Every rank must run the same number of forward passes (ZeRO-3 gathers weights in each one).
            eval_micro = args.per_device_eval_batch_size or micro
            eval_batches = min(args.eval_batches, evals.eval_batches(micro_batch_size=eval_micro, dp_size=dp_size))
            eval_loader = evals.eval_loader(micro_batch_size=eval_micro, dp_rank=dp_rank, dp_size=dp_size)
        what = "packed" if not args.no_packing else "padded"
        text = f"data {len(train.dataset):,} {what} samples"
        if held:
            text += f", the last {len(evals.dataset):,} held out for evaluation (--val-fraction {held[1]:g})"
        elif evals is not None:
            text += f", eval {len(evals.dataset):,} samples"
        else:
            text += ", no evaluation (give --eval-data or --val-fraction)"
        return text, make_loader, eval_loader, eval_batches

    return _Data(len(train.dataset), loaders)


def _eval_set(args: argparse.Namespace, train, build):
    """The evaluation samples of a --data run and, when they are held out of --data, ``(train, fraction)``:
    --eval-data; else the tail --val-fraction of --data's samples when --val-fraction, or --eval-interval, asks
    for evaluation (0.02 by default then, as for the built-in corpus); else none."""
    if args.eval_data:
        return build(args.eval_data), None
    fraction = args.val_fraction
    if fraction is None and args.eval_interval > 0:
        fraction = DEFAULT_VAL_FRACTION
    if not fraction:
        return None, None
    try:
        rest, evals = train.hold_out(fraction)
    except ValueError as exc:
        raise CLIError(f"--val-fraction: {exc}") from None
    return evals, (rest, fraction)
