"""Long-context memory with Ulysses sequence parallelism (`sequence_parallel_size`), on the CPU.

A tiny Hugging Face Llama (bytes vocabulary, grouped-query attention, activation checkpointing on:
`gradient_checkpointing_enable`) trains one sequence per step with zerotrain at SP = 1, 2, 4 (world =
SP, one sequence-parallel group, ZeRO-1). Per rank and step it measures:

- the peak RSS during the step, sampled every millisecond by a thread reading /proc/self/statm
  (children run with MALLOC_MMAP_THRESHOLD_=65536 so freed buffers go back to the OS and RSS follows
  live memory), and the step's growth over the RSS just before it (activations and transients: the
  model here is so small that its states do not matter);
- the longest sequence whose step growth stays under a fixed per-rank budget (`--budget-mib`):
  doubling from 512 tokens, then a binary search to `--quantum` tokens;
- the step time per token at `--time-length` (SP 1 and 2 only: 4 ranks on 2 cores time nothing);
- the bytes of Ulysses' all-to-alls per step and rank (the engine's counters) next to theory: per layer
  q, k, v and the output, (2 H + 2 K') × head_dim × S/N × (N-1)/N × 4 bytes (K' = key/value heads after
  replication), three times per step (forward, the checkpointed recompute, backward).

    python benchmarks/long_context.py --sp 1,2,4 --budget-mib 48 --json benchmarks/results/long_context.json
    python benchmarks/long_context.py --engine deepspeed --sp 1,2,4 --budget-mib 48 --json ...   # DeepSpeed's ALST

`--engine deepspeed` runs the same model, steps and probes through DeepSpeed 0.19.8's Ulysses for HF models
(`UlyssesSPAttentionHF.register_with_transformers`, its mpu, ZeRO-1, DS_ACCELERATOR=cpu).

Every probe is one forward/backward/step of all ranks; the ranks agree on "fits" by the largest growth.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, VOCAB = 128, 2, 8, 2, 256, 256


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RssSampler:
    """The largest RSS seen between start() and stop(), sampled every `interval` seconds."""

    def __init__(self, interval: float = 0.001):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def __enter__(self) -> "RssSampler":
        self.peak = self.rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def build_model():
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, max_position_embeddings=1 << 20)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def theory_bytes(length: int, sp: int) -> float:
    """Ulysses all-to-all bytes one rank sends per step (see the module doc)."""
    if sp == 1:
        return 0.0
    head_dim = HIDDEN // HEADS
    kv = max(KV_HEADS, sp)  # replicated up to one per rank when fewer
    per_layer = (2 * HEADS + 2 * kv) * head_dim * (length // sp) * (sp - 1) / sp * 4
    return 3 * LAYERS * per_layer


def _deepspeed(sp: int):
    """DeepSpeed's Ulysses for HF models (ALST): the registered attention wrapper, its mpu, ZeRO-1, the batch
    sliced as its UlyssesSPDataLoaderAdapter does (shift_labels, position_ids), the loss summed over the group
    with a differentiable all-reduce (as ALST's examples weight per-rank losses)."""
    import deepspeed
    import torch
    import torch.distributed.nn.functional as dfn
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, micro_batch_size=1,
                                                          seq_length_is_variable=True)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1 << 30,
              "zero_optimization": {"stage": 1}, "sequence_parallel_size": sp}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config=config, mpu=mpu)
    group = mpu.get_sequence_parallel_group() if mpu is not None else None
    rank = mpu.get_sequence_parallel_rank() if mpu is not None else 0

    def run(ids):
        length = ids.shape[1]
        labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
        local = length // sp
        piece = slice(rank * local, (rank + 1) * local)
        positions = torch.arange(length).unsqueeze(0)
        logits = engine(input_ids=ids[:, piece], position_ids=positions[:, piece], use_cache=False).logits
        target = labels[:, piece].reshape(-1)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), target, ignore_index=-100,
                                                 reduction="sum")
        if sp > 1:
            loss = dfn.all_reduce(loss, group=group)
        loss = loss / (labels != -100).sum()
        engine.backward(loss)
        engine.step()
        return loss

    return engine, run


def worker(args) -> None:
    import torch
    import zerotrain
    from zerotrain import dist

    torch.set_num_threads(1)
    sp = int(os.environ["WORLD_SIZE"])
    if args.engine == "deepspeed":
        engine, run = _deepspeed(sp)
    else:
        config = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": sp,
                  # weight_decay: torch AdamW's, as the DeepSpeed run's optimizer
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
                  "zero_optimization": {"stage": 1},
                  "steps_per_print": 0, "comm_timeout_seconds": 600}
        engine, *_ = zerotrain.initialize(model=build_model(), config=config)

        def run(ids):
            batch = {"input_ids": ids, "labels": ids}
            if engine.sequence_parallel is not None:
                batch = engine.sequence_parallel.shard(batch)
            loss = engine(**batch, use_cache=False).loss
            engine.backward(loss)
            engine.step()
            return loss
    engine.train()
    sampler = RssSampler()
    generator = torch.Generator().manual_seed(1)

    def step(length: int) -> dict:
        ids = torch.randint(0, VOCAB, (1, length), generator=generator)
        before = sampler.rss()
        counters = getattr(engine, "counters", None)
        counted = dict(counters.bytes) if counters is not None else None
        dist.barrier()
        start = time.perf_counter()
        with sampler:
            loss = run(ids)
        seconds = time.perf_counter() - start
        growth = torch.tensor([float(sampler.peak - before), float(sampler.peak), seconds])
        dist.all_reduce(growth, op=dist.ReduceOp.MAX)
        sent = _a2a_bytes(engine, counted)
        return {"length": length, "growth_mib": growth[0].item() / 2**20, "peak_mib": growth[1].item() / 2**20,
                "seconds": growth[2].item(), "a2a_bytes": sent, "a2a_theory": theory_bytes(length, sp),
                "loss": float(loss.detach())}

    step(256 * sp)  # warm-up
    rows = [step(length) for length in args.lengths if length % sp == 0]
    timing = []
    if args.time_length and sp <= 2:
        timing = [step(args.time_length) for _ in range(args.time_steps)]
    budget = args.budget_mib
    fits, probes = 0, []
    length, too_long = 512, None
    while budget > 0 and too_long is None and length <= args.max_length:  # doubling (--budget-mib 0: no search)
        row = step(length)
        probes.append(row)
        if row["growth_mib"] <= budget:
            fits, length = length, length * 2
        else:
            too_long = length
    if too_long is not None:
        while too_long - fits > args.quantum:  # bisection
            middle = (fits + too_long) // 2 // args.quantum * args.quantum
            row = step(middle)
            probes.append(row)
            if row["growth_mib"] <= budget:
                fits = middle
            else:
                too_long = middle
    if int(os.environ["RANK"]) == 0:
        with open(args.out, "w") as f:
            json.dump({"sp": sp, "rows": rows, "timing": timing, "probes": probes, "longest": fits,
                       "budget_mib": budget}, f)
    dist.destroy_process_group()


def _a2a_bytes(engine, before) -> float:
    """Bytes this rank sent in Ulysses' all-to-alls since `before` (the counters' snapshot)."""
    counters = getattr(engine, "counters", None)
    if before is None or counters is None:
        return float("nan")
    return float(counters.bytes.get("sequence_all_to_all", 0.0) - before.get("sequence_all_to_all", 0.0))


def launch(sp: int, args, out: str) -> dict:
    port = _free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(sp),
               LOCAL_WORLD_SIZE=str(sp), OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",
               MALLOC_TRIM_THRESHOLD_="65536")
    if args.engine == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
    command = [sys.executable, __file__, "--worker", "--engine", args.engine, "--out", out, "--budget-mib", str(args.budget_mib),
               "--lengths", ",".join(map(str, args.lengths)), "--time-length", str(args.time_length),
               "--time-steps", str(args.time_steps), "--quantum", str(args.quantum),
               "--max-length", str(args.max_length)]
    procs = [subprocess.Popen(command, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(sp)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"SP{sp}: ranks exited with {codes}")
    with open(out) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sp", default="1,2,4")
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--budget-mib", type=float, default=96.0)
    parser.add_argument("--quantum", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=1 << 16)
    parser.add_argument("--time-length", type=int, default=2048)
    parser.add_argument("--time-steps", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--engine", choices=("zerotrain", "deepspeed"), default="zerotrain")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.lengths = [int(x) for x in str(args.lengths).split(",") if x]
    if args.worker:
        worker(args)
        return
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for sp in [int(x) for x in args.sp.split(",")]:
            results[sp] = launch(sp, args, os.path.join(tmp, f"sp{sp}.json"))
            print(f"SP{sp}: longest sequence under {args.budget_mib:.0f} MiB of step growth: "
                  f"{results[sp]['longest']}", flush=True)
    report(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


def report(results: dict, args) -> None:
    print(f"\nper-rank step growth / peak RSS (MiB) vs sequence length (activation checkpointing on)")
    print("| length | " + " | ".join(f"SP{sp} growth / peak" for sp in results) + " |")
    print("|---|" + "---|" * len(results))
    for length in args.lengths:
        cells = []
        for sp, res in results.items():
            row = next((r for r in res["rows"] if r["length"] == length), None)
            cells.append(f"{row['growth_mib']:.1f} / {row['peak_mib']:.0f}" if row else "—")
        print(f"| {length} | " + " | ".join(cells) + " |")
    base = results.get(1, {}).get("longest") or None
    print(f"\nlongest sequence with step growth <= {args.budget_mib:.0f} MiB per rank")
    print("| SP | longest | vs SP1 |")
    print("|---|---|---|")
    for sp, res in results.items():
        ratio = f"{res['longest'] / base:.2f}x" if base else "—"
        print(f"| {sp} | {res['longest']} | {ratio} |")
    print(f"\nstep time per token at {args.time_length} tokens (median of {args.time_steps})")
    print("| SP | step s | us/token (whole sequence) |")
    print("|---|---|---|")
    for sp, res in results.items():
        if res["timing"]:
            seconds = sorted(r["seconds"] for r in res["timing"])[len(res["timing"]) // 2]
            print(f"| {sp} | {seconds:.3f} | {seconds / args.time_length * 1e6:.1f} |")
    print("\nUlysses all-to-all bytes per step and rank vs theory")
    print("| SP | length | measured MB | theory MB | ratio |")
    print("|---|---|---|---|---|")
    for sp, res in results.items():
        for row in res["rows"]:
            if row["a2a_theory"]:
                print(f"| {sp} | {row['length']} | {row['a2a_bytes'] / 1e6:.3f} | {row['a2a_theory'] / 1e6:.3f} | "
                      f"{row['a2a_bytes'] / row['a2a_theory']:.3f} |")


if __name__ == "__main__":
    main()
