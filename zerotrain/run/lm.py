"""`zerotrain train`'s run, one rank: a Hugging Face model directory (or a preset) trained on local data or the
standard library's source, as a language model or through a pipeline.

`run_lm` resolves the model, builds the run's config once (`RunConfig`, unless the command built it already),
starts torch.distributed, builds the model (`run.model`), reads the data (the steps --num-train-epochs makes),
lays the schedule over those steps, builds the engine, then the run's skeleton every training command shares
(`zerotrain.run`: an elastic restart resumes, the effective config recorded, the save directory claimed, the
`trainer`, close and teardown, the stop's status).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Optional

from zerotrain.command import PROG, CLIError
from zerotrain.run.config import RunConfig, train_run_config
from zerotrain.run.model import load_weights, lora_options, train_engine, train_model
from zerotrain.train.flags import optimizer_from_flags

__all__ = ["run_lm", "nothing_to_train", "start_notes", "LMData", "stdlib_data", "local_data", "DEFAULT_VAL_FRACTION"]

# The share of the data held out for evaluation when nothing else says: the built-in corpus' tail; with --data, when
# --eval-interval asks for evaluation without --eval-data or --val-fraction.
DEFAULT_VAL_FRACTION = 0.02


def nothing_to_train(path: str, step: int, steps: int) -> str:
    """What a resumed run says when its checkpoint already holds the steps asked for."""
    return (f"{PROG}: nothing to train: --steps {steps} is the total to reach, counting the steps done, and the "
            f"checkpoint {path} is at step {step}; give --steps above {step} to train on")




def run_lm(args: argparse.Namespace, config: Optional[RunConfig] = None) -> int:
    """One rank of `zerotrain train`: build the model, read the data (the steps --num-train-epochs makes), build the
    engine with the schedule over those steps, load weights or resume, wire the data, run the `Trainer`; the exit
    status (128 + the signal's number after a stop)."""
    from zerotrain import dist

    from zerotrain.models.hf import (ModelError, count_parameters, grow_vocab, load_tokenizer, resolve_model,
                                     tokenizer_files)
    from zerotrain.precision import training_dtype
    from zerotrain.run import finish_run, start_run, stop_status
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
    # known once the data is read, and the learning-rate schedule is laid out over them. The config, built once
    # here (or by the command, for this same world), fixes all the model needs (dtype, stage) and the batch; only
    # the schedule's step counts wait for the data (open, "auto", until then: filled in place, no rebuild).
    if config is None or config.world_size != world_size:
        config = train_run_config(args, world_size=world_size, hidden_size=hidden)
    dist.init_distributed(timeout=config.parsed.comm_timeout_seconds)
    dtype = training_dtype(config.parsed.precision)
    try:
        model = train_model(source, config, seed=args.seed, lora=lora)
    except ModelError as exc:
        raise CLIError(str(exc)) from None
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        if args.data:
            data = local_data(args, model, tokenizer, seq_len, dtype)
        else:
            data = stdlib_data(args, seq_len)
        global_batch = config.global_batch  # micro x accumulation x data-parallel ranks, as the engine has it
        steps_per_epoch = max(1, data.samples // global_batch)  # full global batches in one pass
        if args.steps is None:  # --num-train-epochs alone: the steps those passes make (the HF Trainer's max_steps)
            args.steps = math.ceil(args.num_train_epochs * steps_per_epoch)
        config.schedule_over(args.steps)  # the schedule over those steps
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
        # an elastic restart resumes; the effective config recorded; one job per save directory
        args.resume = start_run(engine, config, resume=args.resume, save_dir=save_dir, rank=rank,
                                record_dirs=(save_dir, args.log_dir))
        path = None
        base_loaded = False
        from zerotrain.train.resume import load_for_resume, wants_resume
        if wants_resume(args) and lora is not None and source.weights_dir is not None:
            # The base first: a checkpoint saved with checkpoint.adapters_only holds only the adapter (a full
            # one overwrites it all again).
            load_weights(engine, source, model, old_vocab, save_dir, args.seed)
            base_loaded = True
        if wants_resume(args):
            path, _ = load_for_resume(engine, args, save_dir, config.values)
            if path is not None and args.steps is not None and engine.global_steps >= args.steps:  # e.g. an elastic restart after the end
                if rank == 0:
                    print(nothing_to_train(path, engine.global_steps, args.steps), flush=True)
                finish_run(engine)
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
            for line in start_notes(args, model, lora):
                print(line, flush=True)
        step, evaluator = None, None
        if int(config.parsed.pipeline_parallel_size) > 1:  # whole batches through train_batch (train.pipeline)
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


def start_notes(args: argparse.Namespace, model, lora) -> list[str]:
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


class LMData:
    """The run's data, read before the engine exists (`samples`: training samples in one pass, for the steps an
    epoch makes); `loaders` wires it to the engine's batch sizes and data-parallel position:
    ``(text, make_loader(consumed samples), eval loader, eval batches)``."""

    def __init__(self, samples: int, loaders) -> None:
        self.samples = samples
        self.loaders = loaders


def stdlib_data(args: argparse.Namespace, seq_len: int) -> LMData:
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

    return LMData(len(train_set), loaders)


def _causal_blocks(items: list) -> dict:
    """A batch of (x, y) byte blocks as a causal LM's input: the model shifts the labels itself."""
    import torch

    ids = torch.stack([x for x, _ in items])
    return {"input_ids": ids, "labels": ids}


def local_data(args: argparse.Namespace, model, tokenizer, seq_len: int, dtype) -> LMData:
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

    return LMData(len(train.dataset), loaders)


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
