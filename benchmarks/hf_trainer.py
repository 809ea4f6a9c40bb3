"""zerotrain vs the Hugging Face Trainer + DeepSpeed on the same HF model directory, data and DeepSpeed config.

    python benchmarks/hf_trainer.py                     # default run (~5 min on 2 cores): 2 rounds, A B A B
    python benchmarks/hf_trainer.py --rounds 3 --steps 8 --write-results   # the quiet-machine rerun

What runs (world size 2, CPU, gloo, fp32, one thread per rank):

* ``zt``: ``zerotrain train --nproc 2 --model DIR --data DATA --config ds.json`` (the CLI, as a user runs it);
  tokens/s and peak RSS per rank come from its ``metrics.jsonl``.
* ``zthf``: the ``hf`` script with ``zerotrain.hf``'s ``Trainer`` and ``TrainingArguments`` imported instead
  (nothing else changed; the model loaded whole by ``from_pretrained``, partitioned when the engine starts).
* ``hf``: ``transformers.Trainer`` with ``TrainingArguments(deepspeed=ds.json)`` under torchrun, the model
  loaded with ``AutoModelForCausalLM.from_pretrained`` (after the TrainingArguments, so transformers builds it
  under DeepSpeed's ``zero.Init``: partitioned at load, as zerotrain does); a callback records the same
  numbers at the end of each optimizer step.

Same for both: the model directory (a Llama-style model of >= 70M parameters with a BPE tokenizer trained on
the standard library's source, random init, written once with ``save_pretrained``), the packed training
samples (``zerotrain.data.build_data`` over a jsonl of standard-library source files: both get the very same
``seq_len`` blocks and collator, so they run the same FLOPs; the order differs), the DeepSpeed config file
(ZeRO-3, fp32, micro batch per rank, AdamW as torch's, gradient clipping 1.0, no scheduler: constant lr),
``OMP_NUM_THREADS=1`` and ``MALLOC_MMAP_THRESHOLD_=65536`` (freed buffers go back to the OS, so RSS follows
live memory). DeepSpeed runs with ``DS_ACCELERATOR=cpu`` over a gloo process group.

Measured per run: tokens/s = input tokens of the steps after ``--warmup`` over all ranks / their wall time
on rank 0 (end of warm-up step to end of last step); peak RSS per rank (``getrusage`` high-water mark, the
whole process: Python, torch, the library, the model states). Engines are interleaved (zt hf zt hf ...)
so background load hits both alike; the table gives the median over rounds and the ratios zt / hf, with the
load average before and after. ``--write-results`` appends the table to ``benchmarks/RESULTS.md``.

TRL's trainers (``--trl dpo,reward,grpo``, issue #45): peak RSS per rank of ``zerotrain.hf``'s ``DPOTrainer`` /
``RewardTrainer`` / ``GRPOTrainer`` against TRL's own + DeepSpeed 0.19.8 on the same model directory (the reward
model: the same directory as a 1-label sequence-classification model, its score head drawn with seed 0), the same
config file (ZeRO-3, fp32, the optimizer block) and synthetic records (DPO: prompt / chosen / rejected; reward:
chosen / rejected; GRPO: prompts, 4 generations of ``--trl-completion`` tokens, a reward function in Python); the
reference model (DPO, GRPO's ``beta`` 0.1) loaded by TRL from the model's path on both sides. Printed side by side
with the ratios zerotrain / DeepSpeed per rank (target <= 1.0x), with the first and last logged loss of each run.
Memory is not noisy under load: one round is enough. ``--trl-only`` skips the tokens/s runs::

    python benchmarks/hf_trainer.py --trl dpo,reward,grpo --trl-only --steps 4 --write-results
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "MALLOC_MMAP_THRESHOLD_": "65536",
       "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
       "PYTHONUNBUFFERED": "1", "WANDB_DISABLED": "true"}


# --- setup: model directory, data, DeepSpeed config (written once, reused across runs) ------------------------

def prepare(args: argparse.Namespace) -> dict:
    """Write (or reuse) the model directory, the jsonl data and the DeepSpeed config under ``args.work_dir``."""
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / f"llama-h{args.hidden}-l{args.layers}-v{args.vocab}"
    if not (model_dir / "config.json").exists():
        from zerotrain.models.tiny_llama import build_tiny_llama

        print(f"building the model directory {model_dir} ...", flush=True)
        build_tiny_llama(model_dir, vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                         num_heads=args.heads, num_kv_heads=args.heads, intermediate_size=args.intermediate,
                         max_positions=max(1024, args.seq_len), corpus_bytes=4 << 20)
    data = work / "stdlib.jsonl"
    if not data.exists():
        from zerotrain.data import iter_stdlib_sources

        total = 0
        with data.open("w", encoding="utf-8") as f:
            for source in iter_stdlib_sources():
                text = source.read_bytes().decode("utf-8", errors="replace")
                f.write(json.dumps({"text": text}) + "\n")
                total += len(text)
                if total >= args.data_bytes:
                    break
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "train_batch_size": args.micro * 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 1000000,
    }
    config = work / "ds_zero3.json"
    config.write_text(json.dumps(ds_config, indent=1))
    return {"model": str(model_dir), "data": str(data), "config": str(config)}


def count_params(model_dir: str) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                n = 1
                for d in h.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


# --- the HF Trainer worker (one per rank, under torchrun) -------------------------------------------------------

def hf_worker(args: argparse.Namespace) -> None:
    """One rank of the Trainer script: transformers' Trainer + DeepSpeed (``hf``), or the very same script with
    ``zerotrain.hf``'s Trainer and TrainingArguments (``zthf``: its two imports changed, nothing else)."""
    import torch
    import torch.distributed as dist

    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    if args.worker == "zthf":
        from zerotrain.hf import Trainer, TrainingArguments
    else:
        import deepspeed
        from transformers import Trainer, TrainingArguments

        # gloo before anything else (DeepSpeed's CPU accelerator would pick oneCCL); deepspeed.comm must know the
        # group before from_pretrained's zero.Init reads the world size; transformers/accelerate then find it there.
        deepspeed.init_distributed(dist_backend="gloo")

    from zerotrain.data import DataConfig, build_data

    ds = json.loads(Path(args.config).read_text())
    opt = ds["optimizer"]["params"]
    out_dir = Path(args.out) / args.worker
    training_args = TrainingArguments(
        output_dir=str(out_dir), deepspeed=args.config, per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=opt["lr"],
        adam_beta1=opt["betas"][0], adam_beta2=opt["betas"][1], adam_epsilon=opt["eps"],
        weight_decay=opt["weight_decay"], max_grad_norm=ds["gradient_clipping"], lr_scheduler_type="constant",
        warmup_steps=0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, remove_unused_columns=False, seed=1234, disable_tqdm=True,
    )
    rank = dist.get_rank()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # After TrainingArguments(deepspeed=...) at ZeRO-3 this builds the model under zero.Init (partitioned).
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    data = build_data(DataConfig(paths=[args.data], seq_len=args.seq_len, seed=1234,
                                 cache_dir=str(Path(args.work_dir) / "data-cache")), tokenizer, model=model)
    records: list = []

    class Measure(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            records.append({"step": state.global_step, "t": time.perf_counter(),
                            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})

        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "loss" in logs and records:
                records[-1]["loss"] = float(logs["loss"])

    trainer = Trainer(model=model, args=training_args, train_dataset=data.dataset, data_collator=data.collator,
                      callbacks=[Measure()])
    trainer.train()
    rss = [None] * dist.get_world_size()
    dist.all_gather_object(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if rank == 0:
        (Path(args.out) / f"{args.worker}.json").write_text(json.dumps({"records": records, "peak_rss": rss}))
    dist.barrier()
    dist.destroy_process_group()


# --- TRL's trainers (one per rank, under torchrun) -----------------------------------------------------------------

TRL_WORDS = ("def return class import self value list dict for while if else try except with yield lambda none "
             "true false print open read write path data model train step loss").split()


def trl_records(kind: str, n: int, words_per_text: int) -> list:
    """Synthetic records for a TRL trainer (fixed seed: the same on both sides)."""
    import random

    rng = random.Random(11)
    text = lambda k: " ".join(rng.choices(TRL_WORDS, k=k))  # noqa: E731
    w = words_per_text
    if kind == "dpo":
        return [{"prompt": text(w // 2) + " ->", "chosen": " " + text(w // 2), "rejected": " " + text(w // 2)}
                for _ in range(n)]
    if kind == "reward":
        return [{"chosen": text(w), "rejected": text(w)} for _ in range(n)]
    return [{"prompt": text(w // 2) + " ->"} for _ in range(n)]


def reward_model_dir(model_dir: str, work: Path) -> str:
    """`model_dir` as a 1-label sequence-classification model (score head drawn with seed 0) with its tokenizer."""
    out = work / (Path(model_dir).name + "-reward")
    if not (out / "config.json").exists():
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
            else tokenizer.eos_token_id
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    return str(out)


def _letters(completions: list, **kwargs) -> list:
    """GRPO's reward in Python: the share of the letter 'a' in each completion."""
    return [text.count("a") / max(1, len(text)) for text in completions]


def trl_worker(args: argparse.Namespace) -> None:
    """One rank of a TRL trainer run: ``zerotrain.hf``'s (``--engine zt``) or TRL's + DeepSpeed (``ds``)."""
    import torch.distributed as dist
    from datasets import Dataset

    if args.engine == "zt":
        import zerotrain.hf as trl_side
    else:
        import deepspeed
        import trl as trl_side

        deepspeed.init_distributed(dist_backend="gloo")
    ds = json.loads(Path(args.config).read_text())
    opt = ds["optimizer"]["params"]
    common = dict(output_dir=str(Path(args.out) / f"trl-{args.trainer}-{args.engine}"), deepspeed=args.config,
                  per_device_train_batch_size=args.micro, gradient_accumulation_steps=1, max_steps=args.steps,
                  learning_rate=opt["lr"], adam_beta1=opt["betas"][0], adam_beta2=opt["betas"][1],
                  adam_epsilon=opt["eps"], weight_decay=opt["weight_decay"], max_grad_norm=ds["gradient_clipping"],
                  lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, save_strategy="no", report_to="none",
                  use_cpu=True, seed=1234, disable_tqdm=True, bf16=False, model_init_kwargs={"dtype": "float32"})
    n = args.micro * 2 * args.steps * 2
    words = max(4, args.seq_len // 2)
    if args.trainer == "dpo":
        config = trl_side.DPOConfig(**common, max_length=args.seq_len, beta=0.1)
        trainer = trl_side.DPOTrainer(model=args.model, args=config, train_dataset=Dataset.from_list(
            trl_records("dpo", n, words)))
    elif args.trainer == "reward":
        config = trl_side.RewardConfig(**common, max_length=args.seq_len)
        trainer = trl_side.RewardTrainer(model=args.reward_model, args=config, train_dataset=Dataset.from_list(
            trl_records("reward", n, words)))
    else:
        config = trl_side.GRPOConfig(**common, num_generations=4,
                                     max_completion_length=args.trl_completion, beta=0.1, temperature=1.0)
        trainer = trl_side.GRPOTrainer(model=args.model, reward_funcs=_letters, args=config,
                                       train_dataset=Dataset.from_list(trl_records("grpo", n, words)))
    trainer.train()
    losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
    rss = [None] * dist.get_world_size()
    dist.all_gather_object(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if dist.get_rank() == 0:
        (Path(args.out) / f"trl-{args.trainer}-{args.engine}.json").write_text(
            json.dumps({"peak_rss": rss, "loss_first": losses[0], "loss_last": losses[-1]}))
    dist.barrier()
    dist.destroy_process_group()


def run_trl(paths: dict, args: argparse.Namespace, out: Path, trainer: str, engine: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--worker", "trl", "--trainer", trainer, "--engine", engine, "--out", str(out), "--model", paths["model"],
           "--reward-model", paths["reward_model"], "--config", paths["config"], "--work-dir", args.work_dir,
           "--seq-len", str(args.seq_len), "--micro", str(args.micro), "--steps", str(args.steps),
           "--trl-completion", str(args.trl_completion)]
    _run(cmd, out / f"trl-{trainer}-{engine}.log", args)
    return json.loads((out / f"trl-{trainer}-{engine}.json").read_text())


def trl_table(results: dict, args: argparse.Namespace, n_params: int, started: str, load: tuple) -> str:
    """The TRL trainers' peak RSS per rank, zerotrain.hf and TRL + DeepSpeed side by side, with the ratios."""
    lines = [f"### #45 TRL trainers: peak RSS, zerotrain.hf vs TRL + DeepSpeed 0.19.8 ({started})", "",
             f"`benchmarks/hf_trainer.py {' '.join(sys.argv[1:])}`: Llama-style model ({n_params / 1e6:.1f}M params), "
             f"fp32, ZeRO-3, world 2, CPU, gloo, micro batch {args.micro} per rank (GRPO: completions, 4 generations a prompt, "
             f"{args.trl_completion} tokens each), max length {args.seq_len}, {args.steps} steps; reference model loaded "
             f"by TRL (DPO, GRPO beta 0.1). Load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} "
             f"(memory is not noisy under load); {os.cpu_count()} CPUs.", "",
             "| trainer | zerotrain rank 0 / 1 (MiB) | DeepSpeed rank 0 / 1 (MiB) | zerotrain / DeepSpeed rank 0 / 1 | "
             "loss first -> last (zerotrain; DeepSpeed) |", "|---|---|---|---|---|"]
    for name, runs in results.items():
        zt, ds = runs["zt"], runs["ds"]
        ratio = [z / d for z, d in zip(zt["peak_rss"], ds["peak_rss"])]
        lines.append(f"| {name} | {_mib(zt['peak_rss'][0])} / {_mib(zt['peak_rss'][1])} | {_mib(ds['peak_rss'][0])} / "
                     f"{_mib(ds['peak_rss'][1])} | **{ratio[0]:.2f}x / {ratio[1]:.2f}x** | {zt['loss_first']:.4f} -> "
                     f"{zt['loss_last']:.4f}; {ds['loss_first']:.4f} -> {ds['loss_last']:.4f} |")
    return "\n".join(lines)


# --- runs ---------------------------------------------------------------------------------------------------------

def run_zt(paths: dict, args: argparse.Namespace, out: Path) -> dict:
    log_dir = out / "zt"
    cmd = [sys.executable, "-m", "zerotrain.cli", "train", "--nproc", "2", "--model", paths["model"],
           "--data", paths["data"], "--config", paths["config"], "--seq-len", str(args.seq_len),
           "--steps", str(args.steps), "--log-dir", str(log_dir), "--no-save", "--eval-batches", "0",
           "--seed", "1234"]
    _run(cmd, out / "zt.log", args)
    recs = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    w = args.warmup
    seconds = recs[-1]["elapsed_s"] - recs[w - 1]["elapsed_s"]
    tokens = args.micro * 2 * args.seq_len * (len(recs) - w)
    return {"tokens_per_s": tokens / seconds, "peak_rss": recs[-1]["memory_bytes"],
            "loss_first": recs[0]["loss"], "loss_last": recs[-1]["loss"]}


def run_hf(paths: dict, args: argparse.Namespace, out: Path, worker: str = "hf") -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--worker", worker, "--out", str(out), "--model", paths["model"], "--data", paths["data"],
           "--config", paths["config"], "--work-dir", args.work_dir, "--seq-len", str(args.seq_len),
           "--micro", str(args.micro), "--steps", str(args.steps)]
    _run(cmd, out / f"{worker}.log", args)
    result = json.loads((out / f"{worker}.json").read_text())
    recs, w = result["records"], args.warmup
    seconds = recs[-1]["t"] - recs[w - 1]["t"]
    tokens = args.micro * 2 * args.seq_len * (len(recs) - w)
    losses = [r["loss"] for r in recs if "loss" in r]
    return {"tokens_per_s": tokens / seconds, "peak_rss": result["peak_rss"],
            "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None}


def _run(cmd: list, log: Path, args: argparse.Namespace) -> None:
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "ZEROTRAIN_DATA_CACHE": str(Path(args.work_dir) / "data-cache")}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.timeout, cwd=log.parent)
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{shlex.join(cmd)} exited with {proc.returncode}; last lines of {log}:\n{tail}")


def _mib(x: float) -> str:
    return f"{x / 2**20:,.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="zt hf pairs, interleaved")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of tokens/s")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro", type=int, default=2, help="micro batch per rank")
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--layers", type=int, default=11)
    p.add_argument("--heads", type=int, default=10)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--data-bytes", type=int, default=4 << 20, help="stdlib source bytes in the jsonl")
    p.add_argument("--engines", default="zt,hf,zthf",
                   help="zt: zerotrain train; hf: Trainer + DeepSpeed; zthf: the same Trainer script on zerotrain.hf")
    p.add_argument("--work-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "zerotrain-hf-bench"))
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--write-results", action="store_true", help="append the table to benchmarks/RESULTS.md")
    p.add_argument("--trl", default="", help="also TRL's trainers' peak RSS vs TRL + DeepSpeed: dpo,reward,grpo")
    p.add_argument("--trl-only", action="store_true", help="only the --trl runs (no tokens/s runs)")
    p.add_argument("--trl-completion", type=int, default=16, help="GRPO's max completion length")
    # worker mode (internal)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--trainer", default=None, help=argparse.SUPPRESS)
    p.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    p.add_argument("--reward-model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker in ("hf", "zthf"):
        hf_worker(args)
        return
    if args.worker == "trl":
        trl_worker(args)
        return
    trainers = [t for t in args.trl.split(",") if t]
    if any(t not in ("dpo", "reward", "grpo") for t in trainers):
        p.error(f"--trl: {args.trl!r}: expected a comma-separated subset of dpo,reward,grpo")
    if args.trl_only and not trainers:
        p.error("--trl-only needs --trl")
    if args.warmup < 1 or args.steps <= args.warmup:
        p.error("need 1 <= --warmup < --steps")

    paths = prepare(args)
    n_params = count_params(paths["model"])
    if trainers:
        paths["reward_model"] = reward_model_dir(paths["model"], Path(args.work_dir))
        trl_results: dict = {}
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        for name in trainers:
            for engine in ("zt", "ds"):
                out = Path(args.work_dir) / "runs" / f"trl-{name}-{engine}"
                shutil.rmtree(out, ignore_errors=True)
                res = trl_results.setdefault(name, {})[engine] = run_trl(paths, args, out, name, engine)
                print(f"{name} {engine}: peak RSS MiB {[_mib(x) for x in res['peak_rss']]}, loss "
                      f"{res['loss_first']:.4f} -> {res['loss_last']:.4f}", flush=True)
        table = trl_table(trl_results, args, n_params, started, os.getloadavg())
        print("\n" + table + "\n")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "params": n_params, "trl": trl_results},
                                                  indent=1))
        if args.write_results:
            with (ROOT / "benchmarks" / "RESULTS.md").open("a") as f:
                f.write("\n" + table + "\n")
            print("appended to benchmarks/RESULTS.md")
        if args.trl_only:
            return
    engines = args.engines.split(",")
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results: dict = {e: [] for e in engines}
    for r in range(args.rounds):
        for e in engines:
            out = Path(args.work_dir) / "runs" / f"{e}{r}"
            shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl appends: start each run clean
            t0 = time.time()
            res = run_zt(paths, args, out) if e == "zt" else run_hf(paths, args, out, worker=e)
            res["load1"] = os.getloadavg()[0]
            results[e].append(res)
            print(f"round {r} {e}: {res['tokens_per_s']:,.0f} tokens/s, peak RSS MiB "
                  f"{[_mib(x) for x in res['peak_rss']]}, loss {res['loss_first']:.4f} -> {res['loss_last']:.4f}, "
                  f"load {res['load1']:.2f} ({time.time() - t0:.0f}s)", flush=True)
    load_after = os.getloadavg()

    def med(e: str, key: str, rank=None) -> float:
        return statistics.median(x[key] if rank is None else x[key][rank] for x in results[e])

    lines = [
        f"### #14 zerotrain vs HF Trainer + DeepSpeed ({started})",
        "",
        f"`benchmarks/hf_trainer.py {' '.join(sys.argv[1:])}`: Llama-style model ({n_params / 1e6:.1f}M params: "
        f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), fp32, ZeRO-3, world 2, CPU, gloo, "
        f"micro batch {args.micro} x seq {args.seq_len} per rank, {args.steps} steps ({args.warmup} warm-up), "
        f"{args.rounds} interleaved rounds (median). Load average before {load_before[0]:.2f} / "
        f"{load_before[1]:.2f} / {load_before[2]:.2f}, after {load_after[0]:.2f} / {load_after[1]:.2f} / "
        f"{load_after[2]:.2f}; {os.cpu_count()} CPUs.",
        "",
        "| engine | tokens/s | peak RSS rank 0 (MiB) | peak RSS rank 1 (MiB) | loss first -> last | per round tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    names = {"zt": "zerotrain train", "hf": "HF Trainer + DeepSpeed", "zthf": "zerotrain.hf.Trainer (same script)"}
    for e in engines:
        lines.append(f"| {names[e]} | "
                     f"{med(e, 'tokens_per_s'):,.0f} | {_mib(med(e, 'peak_rss', 0))} | {_mib(med(e, 'peak_rss', 1))} | "
                     f"{results[e][0]['loss_first']:.3f} -> {results[e][0]['loss_last']:.3f} | "
                     f"{', '.join(format(x['tokens_per_s'], ',.0f') for x in results[e])} |")
    if "zt" in results and "hf" in results:
        speed = med("zt", "tokens_per_s") / med("hf", "tokens_per_s")
        mem = [med("zt", "peak_rss", r) / med("hf", "peak_rss", r) for r in (0, 1)]
        pairs = [z["tokens_per_s"] / h["tokens_per_s"] for z, h in zip(results["zt"], results["hf"])]
        lines += ["", f"**zerotrain / HF Trainer: tokens/s {speed:.2f}x** (per round {', '.join(f'{x:.2f}' for x in pairs)}; "
                  f"target >= 1.3x), **peak RSS {mem[0]:.2f}x / {mem[1]:.2f}x** (rank 0 / rank 1; target <= 1.0x)."]
    if "zthf" in results and "hf" in results:
        speed = med("zthf", "tokens_per_s") / med("hf", "tokens_per_s")
        mem = [med("zthf", "peak_rss", r) / med("hf", "peak_rss", r) for r in (0, 1)]
        lines += ["", f"**zerotrain.hf.Trainer / HF Trainer + DeepSpeed (the same script): tokens/s {speed:.2f}x** "
                  f"(target >= 1.3x), **peak RSS {mem[0]:.2f}x / {mem[1]:.2f}x** (rank 0 / rank 1; target <= 1.0x)."]
    table = "\n".join(lines)
    print("\n" + table + "\n")
    rerun = (f"{shlex.quote(sys.executable)} benchmarks/hf_trainer.py --rounds 3 --steps 8 --write-results")
    print(f"For the final quiet-machine rerun (load average near 0, nothing else running), from the repository root:\n"
          f"  {rerun}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "params": n_params, "load_before": load_before,
                                               "load_after": load_after, "results": results}, indent=1))
    if args.write_results:
        with (ROOT / "benchmarks" / "RESULTS.md").open("a") as f:
            f.write("\n" + table + "\n")
        print("appended to benchmarks/RESULTS.md")


if __name__ == "__main__":
    main()
