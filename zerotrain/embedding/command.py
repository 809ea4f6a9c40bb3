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
from typing import Any, Optional

__all__ = ["add_train_embedding_parser", "run_train_embedding", "worker_argv"]

_OPTIONS = ("model", "config", "eval_stdlib", "metrics", "micro_batch", "accumulation", "lr", "stage", "steps", "epochs", "negatives",
            "max_length", "pooling", "scale", "matryoshka_dims", "seed", "save_dir", "export", "log_every")


def add_train_embedding_parser(sub: Any) -> None:
    from .pooling import MODES

    parser = sub.add_parser(
        "train-embedding", help="contrastive fine-tuning of a sentence-embedding model on query/positive pairs",
        description="Fine-tune an encoder (Hugging Face or sentence-transformers directory) with InfoNCE over "
                    "in-batch, hard and cross-rank negatives; gradient accumulation makes ONE bigger contrastive "
                    "batch (GradCache). Data: jsonl of {\"query\", \"positive\", \"negatives\": [...]}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", required=True, metavar="DIR", help="encoder directory (no hub downloads)")
    parser.add_argument("--data", required=True, nargs="+", metavar="FILE",
                        help="jsonl pair file(s); `stdlib`: the train split of the standard library's "
                             "docstring -> source pairs")
    parser.add_argument("--eval-stdlib", type=int, default=0, metavar="N",
                        help="before and after training, retrieval on N held-out stdlib docstring -> source pairs "
                             "(recall@1, recall@10, MRR@10); 0: none")
    parser.add_argument("--metrics", default=None, metavar="FILE", help="append the evaluations here (jsonl)")
    parser.add_argument("--config", metavar="PATH", help="DeepSpeed-style JSON config (overrides the batch, "
                        "lr and stage options below)")
    parser.add_argument("--micro-batch", type=int, default=8, metavar="B", help="queries per micro-batch per rank")
    parser.add_argument("--accumulation", type=int, default=1, metavar="A",
                        help="micro-batches per step: one contrastive batch of A x B queries per rank")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--stage", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: --epochs)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--negatives", type=int, default=None, metavar="N",
                        help="hard negatives per query (default: the fewest any record has)")
    parser.add_argument("--max-length", type=int, default=256, metavar="T", help="tokens per text")
    parser.add_argument("--pooling", choices=MODES, default=None,
                        help="pooling (default: the model directory's, else mean)")
    parser.add_argument("--scale", type=float, default=20.0, help="similarity scale (1 / temperature)")
    parser.add_argument("--matryoshka-dims", default=None, metavar="D,D,...",
                        help="sum the loss over these leading-dims prefixes (Matryoshka)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", default=None, metavar="DIR", help="unified checkpoint after the last step")
    parser.add_argument("--export", default=None, metavar="DIR", help="sentence-transformers directory to write")
    parser.add_argument("--log-every", type=int, default=10, metavar="N")
    parser.add_argument("--nproc", type=int, default=1, metavar="N", help="ranks on this machine")


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The command each worker of `--nproc N` runs."""
    argv = ["train-embedding", "--data", *args.data]
    for dest in _OPTIONS:
        value = getattr(args, dest)
        if value is not None:
            argv.append(f"--{dest.replace('_', '-')}={value}")
    return argv


def _config(args: argparse.Namespace) -> Any:
    if args.config is not None:
        return args.config
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.accumulation,
            "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
            "zero_optimization": {"stage": args.stage}, "steps_per_print": 0}


def run_train_embedding(args: argparse.Namespace) -> int:
    import torch
    from zerotrain import dist
    from transformers import AutoModel, AutoTokenizer

    import zerotrain
    from zerotrain.comm import Comm

    from .data import global_batches, load_pairs, rank_micro_batches, tokenize_micro_batch
    from .export import export_sentence_transformers
    from .gradcache import ContrastiveStep
    from .pooling import read_pooling

    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"--model {model_dir}: no config.json (a local Hugging Face or sentence-transformers "
                         "directory is needed; nothing is downloaded)")
    dims = [int(d) for d in args.matryoshka_dims.split(",")] if args.matryoshka_dims else None
    pooling = read_pooling(model_dir, args.pooling)
    held_out: list[dict] = []
    if args.data == ["stdlib"] or args.eval_stdlib:
        from .retrieval import stdlib_pairs, write_pairs
        train_pairs, held_out = stdlib_pairs()
        held_out = held_out[:args.eval_stdlib]
        if args.data == ["stdlib"]:
            import tempfile
            args.data = [str(write_pairs(train_pairs, Path(tempfile.mkdtemp()) / "stdlib_train.jsonl"))]
    data = load_pairs(args.data, args.negatives)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(args.seed)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    for name, param in model.named_parameters():
        if name.startswith("pooler."):  # BERT's pooler head: sentence embeddings never use it
            param.requires_grad_(False)
    engine, *_ = zerotrain.initialize(model=model, config=_config(args))
    try:
        topology = engine.topology
        comm = Comm.data_parallel(topology)
        rank, world = topology.dp_rank, topology.dp_size
        accumulation, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
        global_batch = world * accumulation * micro
        step = ContrastiveStep(engine, comm, pooling, scale=args.scale, matryoshka_dims=dims)
        if rank == 0:
            print(f"zerotrain: train-embedding {model_dir.name}: {len(data)} pairs, {data.num_negatives} hard "
                  f"negatives per query, pooling {pooling.mode}; one contrastive batch = {global_batch} queries "
                  f"({world} ranks x {accumulation} accumulation x {micro} micro), ZeRO stage "
                  f"{engine.zero_optimization_stage()}", flush=True)
        def evaluate(when: str) -> None:
            if not held_out:
                return
            from .export import encode
            from .retrieval import retrieval_metrics
            # every rank encodes (stage 3's forwards gather shards collectively); rank 0 reports
            queries = encode(engine, tokenizer, [p["query"] for p in held_out], pooling,
                             max_length=args.max_length, device=topology.device)
            passages = encode(engine, tokenizer, [p["positive"] for p in held_out], pooling,
                              max_length=args.max_length, device=topology.device)
            record = {"eval": "stdlib_docstring_to_source", "when": when, "step": engine.global_steps,
                      "queries": len(held_out), **retrieval_metrics(queries, passages)}
            if rank == 0:
                print(json.dumps(record), flush=True)
                if args.metrics is not None:
                    with open(args.metrics, "a", encoding="utf-8") as f:
                        f.write(json.dumps(record) + "\n")

        evaluate("before")
        if args.save_dir is not None:
            engine.claim_save_dir(os.path.abspath(args.save_dir))
        total = args.steps
        losses: list[float] = []
        epoch = 0
        while total is None and epoch < args.epochs or total is not None and len(losses) < total:
            batches = list(global_batches(data, global_batch, seed=args.seed, epoch=epoch))
            if not batches:
                raise ValueError(f"{len(data)} pairs cannot fill one batch of {global_batch} queries without "
                                 "duplicate texts: use a smaller batch or more data")
            for batch in batches:
                if total is not None and len(losses) >= total:
                    break
                micro_batches = [tokenize_micro_batch(data, part, tokenizer, args.max_length, topology.device)
                                 for part in rank_micro_batches(batch, rank, world, accumulation)]
                losses.append(step.step(micro_batches))
                if rank == 0 and (len(losses) % args.log_every == 0 or len(losses) == 1):
                    print(f"step {len(losses)}: loss {losses[-1]:.6g}", flush=True)
            epoch += 1
        evaluate("after")
        if args.save_dir is not None:
            path = engine.save_checkpoint(os.path.abspath(args.save_dir), client_state={"embedding": {
                "pooling": pooling.mode, "epochs_started": epoch}})
            if rank == 0:
                print(f"zerotrain: checkpoint {path}", flush=True)
        if args.export is not None:
            # collective: every rank takes part, rank 0 gets every parameter, frozen ones included (the module's
            # own state_dict() would fetch stage-3 shards on one rank only)
            weights = engine.full_state_dict()
            if rank == 0:
                export_sentence_transformers(args.export, weights, model.config, tokenizer, pooling, args.max_length)
                print(f"zerotrain: exported a sentence-transformers model to {args.export}", flush=True)
        if rank == 0 and losses:
            print(json.dumps({"steps": len(losses), "first_loss": losses[0], "last_loss": losses[-1]}), flush=True)
        engine.close()
        if dist.is_initialized():
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
