"""`zerotrain train-embedding`: contrastive fine-tuning of a sentence-embedding model on pair files.

    zerotrain train-embedding --model DIR --data pairs.jsonl --micro-batch 8 --accumulation 4 \\
        --steps 100 --save-dir ckpt --export out/

`--model` is a Hugging Face encoder directory or a sentence-transformers one (its pooling is read
from `modules.json`). The global contrastive batch is ranks x accumulation x micro-batch queries
(GradCache: accumulation makes the batch bigger, it does not add independent batches).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from zerotrain.command import CLIError, HelpFormatter, add_node_flags, max_world_size

if TYPE_CHECKING:
    from zerotrain.run.config import RunConfig

__all__ = ["add_train_embedding_parser", "run_train_embedding", "worker_argv", "effective_embedding_config"]

_OPTIONS = ("model", "config", "eval_stdlib", "metrics", "log_dir", "zero_stage", "steps", "epochs",
            "learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "warmup_steps",
            "warmup_ratio", "lr_scheduler_type", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
            "max_grad_norm", "save_total_limit", "logging_steps", "per_device_eval_batch_size", "negatives", "max_length", "pooling", "scale", "matryoshka_dims", "loss_chunk_size",
            "seed", "save_dir", "save_every", "export", "resume_from_checkpoint")
_FLAGS = ("resume", "bf16", "fp16", "gradient_checkpointing")
# this command's defaults where TrainingArguments' differ (HF names): no decay, a step-10 progress line
DEFAULTS = {"learning_rate": 2e-5, "weight_decay": 0.01, "lr_scheduler_type": "constant", "logging_steps": 10}
EVAL_BATCH = 64  # texts per forward in the retrieval evaluation without --per-device-eval-batch-size
# keys of the config file's "embedding" block (read here, not by the engine) -> the CLI option they set
CONFIG_KEYS = {"loss_chunk_size": "loss_chunk_size"}


def add_train_embedding_parser(sub: Any) -> None:
    from .pooling import MODES

    parser = sub.add_parser(
        "train-embedding", help="contrastive fine-tuning of a sentence-embedding model on query/positive pairs",
        description="Fine-tune an encoder (Hugging Face or sentence-transformers directory) with InfoNCE over "
                    "in-batch, hard and cross-rank negatives; gradient accumulation makes ONE bigger contrastive "
                    "batch (GradCache). Data: jsonl of {\"query\", \"positive\", \"negatives\": [...]}.",
        formatter_class=HelpFormatter)
    parser.add_argument("--model", required=True, metavar="DIR", help="encoder directory (no hub downloads)")
    parser.add_argument("--data", required=True, nargs="+", metavar="FILE",
                        help="jsonl pair file(s); `stdlib`: the train split of the standard library's "
                             "docstring -> source pairs")
    parser.add_argument("--eval-stdlib", type=int, default=0, metavar="N",
                        help="before and after training, retrieval on N held-out stdlib docstring -> source pairs "
                             "(recall@1, recall@10, MRR@10); 0: none")
    parser.add_argument("--metrics", default=None, metavar="FILE", help="append the evaluations here (jsonl)")
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="write DIR/metrics.jsonl: one record per step (docs/metrics.md schema), the evaluations "
                             "as recall_at_1/recall_at_10/mrr_at_10; `zerotrain plot DIR` draws it")
    from zerotrain.train.flags import add_max_steps_flag, add_training_flags
    # TrainingArguments' names, as `zerotrain train` has them; this command's older names stay as aliases
    add_training_flags(parser, aliases={"learning_rate": ["--lr"], "per_device_train_batch_size": ["--micro-batch"],
                                        "gradient_accumulation_steps": ["--accumulation"],
                                        "logging_steps": ["--log-every"]}, defaults=DEFAULTS)
    add_max_steps_flag(parser, "optimizer steps (default: --num-train-epochs); wins over --num-train-epochs")
    parser.add_argument("--num-train-epochs", "--epochs", dest="epochs", type=float, default=1,
                        help="passes over the pairs when --max-steps is not given")
    parser.add_argument("--negatives", type=int, default=None, metavar="N",
                        help="hard negatives per query (default: the fewest any record has)")
    parser.add_argument("--max-length", type=int, default=256, metavar="T", help="tokens per text")
    parser.add_argument("--pooling", choices=MODES, default=None,
                        help="pooling (default: the model directory's, else mean)")
    parser.add_argument("--scale", type=float, default=20.0, help="similarity scale (1 / temperature)")
    parser.add_argument("--matryoshka-dims", default=None, metavar="D,D,...",
                        help="sum the loss over these leading-dims prefixes (Matryoshka)")
    parser.add_argument("--loss-chunk-size", type=int, default=None, metavar="N",
                        help="inf-CL style chunked loss: scores in tiles of N queries x N candidates, the full score "
                             "matrix never held (config: embedding.loss_chunk_size); default: the whole matrix")
    parser.add_argument("--seed", type=int, default=None, help="data order and initialisation (default 0; on "
                        "--resume the checkpoint's)")
    parser.add_argument("--output-dir", "--save-dir", dest="save_dir", default=None, metavar="DIR",
                        help="unified checkpoint after the last step (and effective_config.json)")
    parser.add_argument("--save-steps", "--save-every", dest="save_every", type=int, default=None, metavar="N",
                        help="also save every N optimizer steps (with the data position, for --resume)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --save-dir at the exact next batch (any world "
                             "size, if ranks x accumulation x micro-batch is unchanged)")
    from zerotrain.train.resume import add_resume_flag
    add_resume_flag(parser)  # --resume-from-checkpoint PATH|TAG (HF's name)
    parser.add_argument("--export", default=None, metavar="DIR", help="sentence-transformers directory to write")
    parser.add_argument("--nproc", type=int, default=1, metavar="N", help="ranks on this machine")
    add_node_flags(parser)  # several nodes as torchrun takes them (docs/multinode.md)
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="with --nproc > 1 or several nodes: restart this node's ranks up to K times when one "
                             "fails; each restart resumes from the latest committed checkpoint in --save-dir (a stop "
                             "by signal is never restarted)")
    parser.add_argument("--stop-timeout", type=int, default=300, metavar="S",
                        help="with --nproc > 1: seconds the ranks get to save and exit after a stop signal (SIGTERM, "
                             "SIGINT, SIGHUP, SIGUSR1: a checkpoint at the next step boundary) before they are killed")


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The command each worker of `--nproc N` runs."""
    argv = ["train-embedding", "--data", *args.data]
    for dest in _OPTIONS:
        value = getattr(args, dest)
        if value is not None:
            argv.append(f"--{dest.replace('_', '-')}={value}")
    argv += [f"--{flag}" for flag in _FLAGS if getattr(args, flag)]
    return argv


def _config(args: argparse.Namespace, world: Optional[int] = None, steps: Optional[int] = None) -> Any:
    """The engine's config (a dict) for `steps` optimizer steps (default --max-steps: a decaying schedule's
    total_num_steps); the file's "embedding" block is taken out and applied to `args` (a CLI option given
    explicitly wins)."""
    from zerotrain.config import ConfigError
    from zerotrain.config.loader import read_config_file

    from zerotrain.train.flags import effective_config

    world = world if world is not None else int(os.environ.get("WORLD_SIZE", "1"))
    config = effective_config(args, world_size=world, num_training_steps=args.steps if steps is None else steps,
                              defaults=DEFAULTS)
    block = config.pop("embedding", {})
    if not isinstance(block, dict):
        raise ConfigError(f"{args.config}: 'embedding' must be an object", key="embedding", file=args.config)
    for key, value in block.items():
        if key not in CONFIG_KEYS:
            raise ConfigError(f"{args.config}: unknown key 'embedding.{key}'; valid keys here: "
                              f"{', '.join(CONFIG_KEYS)}", key=f"embedding.{key}", file=args.config)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{args.config}: 'embedding.{key}' must be a positive integer, got {value!r}",
                              key=f"embedding.{key}", file=args.config)
        if getattr(args, CONFIG_KEYS[key]) is None:
            setattr(args, CONFIG_KEYS[key], value)
    return config


def _run_config(args: argparse.Namespace, world: int) -> "RunConfig":
    """The run's `RunConfig`, built and parsed once: over --max-steps, or (--num-train-epochs alone) with the
    schedule's step counts open until the pairs are read (`RunConfig.schedule_over`)."""
    from zerotrain.config.hf_arguments import LATE_STEPS
    from zerotrain.run.config import RunConfig
    from zerotrain.train.flags import schedule_values

    return RunConfig(_config(args, world=world, steps=LATE_STEPS if args.steps is None else None), world_size=world,
                     steps=args.steps, fill=lambda steps: schedule_values(args, steps, defaults=DEFAULTS))


def _epoch_steps(args: argparse.Namespace, global_batch: int, data: Any) -> int:
    """The optimizer steps --num-train-epochs makes over `data` from the start, in batches of `global_batch` queries:
    a decaying schedule's total_num_steps."""
    from .data import DataPosition
    from .steps import steps_in_epochs

    seed = 0 if args.seed is None else args.seed
    return steps_in_epochs(data, DataPosition(epoch=0, batch=0, seed=seed, global_batch=global_batch, pairs=len(data),
                                              consumed_samples=0), int(args.epochs))


def effective_embedding_config(args: argparse.Namespace) -> dict:
    """The config `--print-config` prints: file, flags and filled "auto" values at --nproc ranks per node (with
    --num-train-epochs alone, over the steps the pairs make: the files are read, nothing is trained)."""
    from zerotrain.config import ConfigError

    args = argparse.Namespace(**vars(args))
    try:
        return _config(args, world=max_world_size(args))
    except ConfigError as exc:  # a schedule that decays over the run: its steps come from the pairs
        if args.steps is not None or not args.data or args.data == ["stdlib"] or \
                "needs its number of steps" not in str(exc):
            raise
    from .data import load_pairs

    world = max_world_size(args)
    config = _run_config(args, world)
    config.schedule_over(_epoch_steps(args, config.global_batch, load_pairs(args.data, args.negatives)))
    return config.values


def _model_files(model_dir: Path) -> tuple[Any, Any]:
    """(tokenizer, model) of `model_dir`, a CLIError naming the directory when either cannot be read."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CLIError(f"--model {model_dir}: cannot read its tokenizer: {_first_line(exc)}") from None
    try:
        model = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise CLIError(f"--model {model_dir}: cannot load the model: {_first_line(exc)}") from None
    return tokenizer, model


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def run_train_embedding(args: argparse.Namespace) -> int:
    """One rank of `zerotrain train-embedding`: every input checked (model directory, pair data, options) before the
    engine exists and the save directory is claimed, then the engine, resume (asked, or after an elastic restart),
    the one training loop with the contrastive step, the export; the exit status (the stop's after a signal)."""
    import torch
    from zerotrain import dist

    import zerotrain
    from zerotrain.comm import Comm
    from zerotrain.command import usage_error_status
    from zerotrain.config import ConfigError
    from zerotrain.data import BadRecordError
    from zerotrain.run import finish_run, start_run, stop_status
    from zerotrain.trainer import Trainer

    from .data import DataPosition, load_pairs
    from .export import export_sentence_transformers
    from .gradcache import ContrastiveStep
    from .metrics import RETRIEVAL_FIELDS
    from .steps import PairSteps, epoch_batches, steps_in_epochs
    from .pooling import read_pooling

    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise CLIError(f"--model {model_dir}: no config.json (a local Hugging Face or sentence-transformers "
                       "directory is needed; nothing is downloaded)")
    if args.resume and args.save_dir is None:
        raise ConfigError("--resume reads the latest checkpoint of --save-dir: give --save-dir", key="--resume")
    if args.save_every is not None and args.save_every < 1:
        raise ConfigError(f"--save-every must be >= 1, got {args.save_every}", key="--save-every")
    if args.epochs != int(args.epochs) or args.epochs < 0:
        raise ConfigError(f"--num-train-epochs: train-embedding runs whole epochs, got {args.epochs:g} (--max-steps "
                          "sets any number of steps)", key="--num-train-epochs")
    if args.per_device_eval_batch_size is not None and args.per_device_eval_batch_size < 1:
        raise ConfigError(f"--per-device-eval-batch-size must be >= 1, got {args.per_device_eval_batch_size}",
                          key="--per-device-eval-batch-size")
    # The data comes before the engine, as in `zerotrain train` and the HF Trainer: with --num-train-epochs alone the
    # steps (a decaying schedule's total_num_steps) are known once the pairs are read. The run's config, built once
    # here (its schedule over a stand-in step count until then), gives the global batch those steps are counted in.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config = _run_config(args, world_size)
    if args.loss_chunk_size is not None and args.loss_chunk_size < 1:
        raise ConfigError(f"--loss-chunk-size must be >= 1, got {args.loss_chunk_size}", key="--loss-chunk-size")
    try:
        dims = [int(d) for d in args.matryoshka_dims.split(",")] if args.matryoshka_dims else None
    except ValueError:
        raise CLIError(f"--matryoshka-dims {args.matryoshka_dims!r}: give comma-separated integers") from None
    try:
        pooling = read_pooling(model_dir, args.pooling)
    except ValueError as exc:
        raise CLIError(f"--model {model_dir}: {exc}") from None
    held_out: list[dict] = []
    if args.data == ["stdlib"] or args.eval_stdlib:
        from .retrieval import stdlib_pairs, write_pairs
        # only the held-out pairs are needed unless the stdlib is also the training data
        train_pairs, held_out = stdlib_pairs(max_held_out=None if args.data == ["stdlib"] else args.eval_stdlib)
        held_out = held_out[:args.eval_stdlib]
        if args.data == ["stdlib"]:
            import tempfile
            args.data = [str(write_pairs(train_pairs, Path(tempfile.mkdtemp()) / "stdlib_train.jsonl"))]
    seed = 0 if args.seed is None else args.seed
    try:
        data = load_pairs(args.data, args.negatives)
        schedule_steps = args.steps
        if schedule_steps is None:  # the passes over the pairs from the start (a resume counts the same run's)
            schedule_steps = _epoch_steps(args, config.global_batch, data)
        # the data fills one global batch (checked here, before any lock is taken)
        global_batch = config.global_batch
        first = DataPosition(epoch=0, batch=0, seed=seed, global_batch=global_batch, pairs=len(data),
                             consumed_samples=0)
        per_epoch = len(epoch_batches(data, first))
    except (BadRecordError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise CLIError(f"--data: {exc}") from None
    config.schedule_over(schedule_steps)
    torch.manual_seed(args.seed or 0)  # the weights the directory lacks (BERT's pooler) start alike
    tokenizer, model = _model_files(model_dir)
    for name, param in model.named_parameters():
        if name.startswith("pooler."):  # BERT's pooler head: sentence embeddings never use it
            param.requires_grad_(False)
    if "activation_checkpointing" in config.values:  # --gradient-checkpointing (or the file's block): the encoder's layers
        from zerotrain.checkpointing import enable_hf_gradient_checkpointing
        enable_hf_gradient_checkpointing(model)
    engine, *_ = zerotrain.initialize(model=model, config=config.parsed)  # the run's parsed config itself
    try:
        topology = engine.topology
        comm = Comm.data_parallel(topology)
        rank, world = topology.dp_rank, topology.dp_size
        accumulation, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
        if world * accumulation * micro != global_batch:
            raise CLIError(f"the engine's global batch is {world * accumulation * micro} queries, not the "
                           f"{global_batch} the config gives")
        step = ContrastiveStep(engine, comm, pooling, scale=args.scale, matryoshka_dims=dims,
                               chunk_size=args.loss_chunk_size)
        save_dir = os.path.abspath(args.save_dir) if args.save_dir is not None else None
        # an elastic restart resumes; the effective config recorded; one job per save directory
        args.resume = start_run(engine, config, resume=args.resume, save_dir=save_dir, rank=topology.rank,
                                record_dirs=(save_dir,))
        position = first
        try:
            if args.resume or args.resume_from_checkpoint:
                from zerotrain.train.resume import load_for_resume
                path, client_state = load_for_resume(engine, args, save_dir, config.values)
                if path is None:
                    if rank == 0:
                        print(f"zerotrain: nothing to resume in {args.save_dir}; starting from scratch", flush=True)
                else:
                    try:
                        saved = DataPosition.from_dict((client_state.get("embedding") or {}).get("data") or {}, path)
                        saved.check_resumable(global_batch=global_batch, pairs=len(data), seed=args.seed,
                                              where=path,
                                              split=f"{world} ranks x {accumulation} accumulation x {micro} micro")
                    except ValueError as error:
                        raise ConfigError(str(error), key="--resume") from None
                    position = saved
                    if rank == 0:
                        print(f"zerotrain: resumed from {path} at step {engine.global_steps}: epoch "
                              f"{position.epoch}, batch {position.batch} next ({position.consumed_samples} queries "
                              "consumed)", flush=True)
        except Exception as exc:
            if usage_error_status(exc) is not None:  # every rank alike: the save directory's lock released
                engine.close()
            raise
        if rank == 0:
            chunk = f", loss in tiles of {args.loss_chunk_size}" if args.loss_chunk_size else ""
            print(f"zerotrain: train-embedding {model_dir.name}: {len(data)} pairs, {data.num_negatives} hard "
                  f"negatives per query, pooling {pooling.mode}; one contrastive batch = {global_batch} queries "
                  f"({world} ranks x {accumulation} accumulation x {micro} micro), ZeRO stage "
                  f"{engine.zero_optimization_stage()}{chunk}", flush=True)

        eval_batch = args.per_device_eval_batch_size or EVAL_BATCH  # texts per forward in the retrieval evaluation

        def evaluate(when: str) -> Optional[dict]:
            if not held_out:
                return None
            from .export import encode
            from .retrieval import retrieval_metrics
            # Every rank encodes every held-out text (stage 3's forwards gather shards collectively) and computes the
            # same metrics; rank 0 reports them. Not through the Trainer's one reduction (`reduce_step`) on purpose:
            # recall@k and MRR rank each query against EVERY passage, so a rank's share of the queries is scored
            # only once all passages' embeddings are on it (an all-gather of embeddings, not a sum), and the ranks
            # hold the same texts: there is no per-rank sum to reduce, the metrics are identical on every rank.
            queries = encode(engine, tokenizer, [p["query"] for p in held_out], pooling,
                             max_length=args.max_length, batch_size=eval_batch, device=topology.device)
            passages = encode(engine, tokenizer, [p["positive"] for p in held_out], pooling,
                              max_length=args.max_length, batch_size=eval_batch, device=topology.device)
            record = {"eval": "stdlib_docstring_to_source", "when": when, "step": engine.global_steps,
                      "queries": len(held_out), "batch_size": eval_batch, **retrieval_metrics(queries, passages)}
            if rank == 0:
                print(json.dumps(record), flush=True)
                if args.metrics is not None:
                    with open(args.metrics, "a", encoding="utf-8") as f:
                        f.write(json.dumps(record) + "\n")
            return {RETRIEVAL_FIELDS[k]: v for k, v in record.items() if k in RETRIEVAL_FIELDS}

        # the one training loop (zerotrain.trainer), with the contrastive step plugged in; the stop signals its
        # default (SIGTERM, SIGINT, SIGHUP, SIGUSR1): a stop saves at the step boundary, --resume continues there
        total = args.steps if args.steps is not None else \
            engine.global_steps + steps_in_epochs(data, position, int(args.epochs))
        steps = PairSteps(engine, step, data, position, tokenizer, args.max_length, rank, world, accumulation,
                          extra_state={"pooling": pooling.mode})
        # the epoch each record, progress line and the summary show: an epoch's batches (as duplicate texts may
        # leave one fewer in a later epoch, counted from the first)
        trainer = Trainer(engine, None, total_steps=total, step=steps, evaluator=evaluate, eval_before=True,
                          steps_per_epoch=per_epoch, log_dir=args.log_dir,
                          steps_per_print=engine.config.steps_per_print or 10, save_dir=save_dir,
                          save_every=args.save_every or 0)
        summary = trainer.train()
        losses = [record["loss"] for record in trainer.history]
        if args.export is not None and summary.stopped_by is None:
            # collective: every rank takes part, rank 0 gets every parameter, frozen ones included (the module's
            # own state_dict() would fetch stage-3 shards on one rank only)
            weights = engine.full_state_dict()
            if rank == 0:
                export_sentence_transformers(args.export, weights, model.config, tokenizer, pooling, args.max_length)
                print(f"zerotrain: exported a sentence-transformers model to {args.export}", flush=True)
        if rank == 0 and losses:
            print(json.dumps({"steps": summary.steps, "first_loss": losses[0], "last_loss": losses[-1]}), flush=True)
        engine.close()  # pending saves committed, offload threads and files released
        if dist.is_initialized():
            dist.barrier()  # no rank tears its groups down while a peer still talks to it
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    status = stop_status(summary, trainer.stop_request, engine.global_steps, rank)
    return 0 if status is None else status
