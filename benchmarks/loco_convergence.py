"""Does 4-bit gradient communication with LoCo train as well as exact? World 4, several seeds.

Trains the package's small GPT (`zerotrain.models.GPT`, preset "tiny" by default) on the
embedded real-text corpus (the Python stdlib sources as bytes; the last 10% held out) at
world size 4 (gloo on 127.0.0.1, one thread per rank), ZeRO stage 2, AdamW, in four modes:

- exact: the fp32 reduce-scatter;
- int8: qgZ at 8 bits, no error feedback;
- int4: qgZ at 4 bits, no error feedback;
- int4+LoCo: qgZ at 4 bits with LoCo (err_beta 0.8, reset_T 1024).

Every mode runs the same seeds; a seed fixes the initialization and the batches, so the
modes of one seed see identical data. The held-out loss (a fixed set of blocks) is
measured every `--eval-every` steps. Reported per mode: mean ± standard deviation over
seeds of the final held-out loss, the gradient bytes each rank sent per step (from
`engine.memory_report()["comm"]`) and their ratio to exact's; and a PNG of the mean
held-out curves with ±1 std shaded.

    .venv/bin/python benchmarks/loco_convergence.py                       # default (5 seeds x 800 steps): ~8 min on 2 cores
    .venv/bin/python benchmarks/loco_convergence.py --steps 40 --seeds 2  # smoke run
    .venv/bin/python benchmarks/loco_convergence.py --ranks-per-node 2    # qgZ's two-hop path

    .venv/bin/python benchmarks/loco_convergence.py --summarize out.json  # the table (and PNG) of a saved run

Judge a mode against the spread across seeds, not against one seed. Since every mode runs
the same seeds, the table also gives the paired difference to exact (per seed, then mean ±
std over seeds) and on how many seeds the mode ended worse than exact.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import traceback

MODES = ("exact", "int8", "int4", "int4+LoCo")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _config(args, mode: str) -> dict:
    zero = {"stage": 2}
    if mode != "exact":
        zero["zero_quantized_gradients"] = True
    if mode == "int4+LoCo":
        zero["zeropp_loco_param"] = {"err_beta": args.beta, "reset_T": args.reset_t}
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
            "zero_optimization": zero, "steps_per_print": 0, "seed": 0}


def _grad_bytes(report: dict) -> tuple[int, int]:
    """(bytes sent, uncompressed bytes) of gradient reduce-scatters, from a comm snapshot."""
    sent = logical = 0
    for kind, entry in report.items():
        if kind.startswith("reduce_scatter"):
            sent += entry["bytes"]
            logical += entry.get("logical_bytes", entry["bytes"])
    return sent, logical


def _rank_main(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    if args.ranks_per_node:
        os.environ["ZEROTRAIN_RANKS_PER_NODE"] = str(args.ranks_per_node)
    try:
        import torch
        import torch.distributed as dist

        import zerotrain
        from zerotrain.data.corpus import load_stdlib_corpus, split
        from zerotrain.models import GPT, GPTConfig
        from zerotrain.zero.reduce import QuantizedReduce

        torch.set_num_threads(1)
        gpt_config = GPTConfig.preset(args.model)
        block = gpt_config.block_size
        train_tokens, val_tokens = split(load_stdlib_corpus(max_bytes=args.corpus_mb * 1024 * 1024), 0.1)
        # A fixed held-out set: evenly spaced blocks of the validation stream, split over the ranks.
        stride = max(1, (val_tokens.numel() - block - 1) // args.eval_blocks)
        starts = [i * stride for i in range(args.eval_blocks)]
        held_out = torch.stack([val_tokens[s:s + block + 1] for s in starts]).long()
        mine = held_out[rank::world]

        def held_out_loss(model) -> float:
            model.eval()
            with torch.no_grad():
                _, loss = model(mine[:, :-1], mine[:, 1:])
            model.train()
            total = torch.tensor([loss.item() * mine.shape[0], float(mine.shape[0])])
            dist.all_reduce(total)
            return (total[0] / total[1]).item()

        for seed in range(args.seeds):
            for mode in args.modes:
                torch.manual_seed(1000 + seed)
                model = GPT(gpt_config)
                engine, *_ = zerotrain.initialize(model=model, config=_config(args, mode))
                if mode != "exact":  # the 8-bit mode and the block size are set from code (no config key)
                    reduce = engine.reducer.reduce
                    engine.reducer.set_reduce(QuantizedReduce(dataclasses.replace(
                        reduce.quantization, bits=8 if mode == "int8" else 4, block_size=args.block), reduce.comm))
                generator = torch.Generator().manual_seed(2000 + seed)
                curve = [(0, held_out_loss(engine.module))]
                started = time.perf_counter()
                for step in range(1, args.steps + 1):
                    offsets = torch.randint(0, train_tokens.numel() - block - 1, (world * args.micro_batch,),
                                            generator=generator)
                    local = offsets[rank * args.micro_batch:(rank + 1) * args.micro_batch].tolist()
                    window = torch.stack([train_tokens[o:o + block + 1] for o in local]).long()
                    _, loss = engine(window[:, :-1], window[:, 1:])
                    engine.backward(loss)
                    engine.step()
                    if step % args.eval_every == 0 or step == args.steps:
                        curve.append((step, held_out_loss(engine.module)))
                seconds = time.perf_counter() - started
                sent, logical = _grad_bytes(engine.memory_report()["comm"])
                if rank == 0:
                    queue.put(("run", {"mode": mode, "seed": seed, "curve": curve, "seconds": seconds,
                                       "grad_bytes_per_step": sent / args.steps,
                                       "grad_logical_bytes_per_step": logical / args.steps,
                                       "final_train_loss": loss.item()}))
                del engine, model
        queue.put(("done", rank))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def _summarize(runs: list[dict], modes) -> dict:
    summary = {}
    for mode in modes:
        finals = [r["curve"][-1][1] for r in runs if r["mode"] == mode]
        sent = [r["grad_bytes_per_step"] for r in runs if r["mode"] == mode]
        summary[mode] = {"final_mean": statistics.fmean(finals), "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                         "finals": finals, "grad_bytes_per_step": statistics.fmean(sent),
                         "seconds": statistics.fmean(r["seconds"] for r in runs if r["mode"] == mode)}
    if "exact" in summary:
        exact = summary["exact"]
        for mode, entry in summary.items():
            entry["bytes_vs_exact"] = entry["grad_bytes_per_step"] / exact["grad_bytes_per_step"]
            entry["within_one_std_of_exact"] = abs(entry["final_mean"] - exact["final_mean"]) <= exact["final_std"]
            # Paired by seed (same init and data in every mode): the difference to exact per seed.
            exact_by_seed = {r["seed"]: r["curve"][-1][1] for r in runs if r["mode"] == "exact"}
            diffs = [r["curve"][-1][1] - exact_by_seed[r["seed"]] for r in runs
                     if r["mode"] == mode and r["seed"] in exact_by_seed]
            entry["paired_diffs"] = diffs
            entry["paired_mean"] = statistics.fmean(diffs) if diffs else float("nan")
            entry["paired_std"] = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
            entry["seeds_worse_than_exact"] = sum(d > 0 for d in diffs)
    return summary


def _plot(runs: list[dict], modes, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axis = plt.subplots(figsize=(7, 4.5), dpi=120)
    for mode in modes:
        curves = [r["curve"] for r in runs if r["mode"] == mode]
        steps = np.array([s for s, _ in curves[0]])
        values = np.array([[v for _, v in c] for c in curves])
        mean, std = values.mean(axis=0), values.std(axis=0, ddof=1) if len(curves) > 1 else np.zeros(len(steps))
        line, = axis.plot(steps, mean, label=f"{mode} ({mean[-1]:.3f} ± {std[-1]:.3f})")
        axis.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.18)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("held-out loss (nats/byte)")
    axis.set_title(title, fontsize=9)
    axis.legend(title="mode (final mean ± std)", fontsize=8)
    axis.grid(alpha=0.3)
    lows = [min(v for _, v in r["curve"][len(r["curve"]) // 4:]) for r in runs]
    highs = [max(v for _, v in r["curve"][len(r["curve"]) // 4:]) for r in runs]
    axis.set_ylim(min(lows) - 0.05, max(highs) + 0.05)
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--model", default="tiny", help="GPT preset")
    parser.add_argument("--micro-batch", type=int, default=8, help="blocks per rank per step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--beta", type=float, default=0.8, help="LoCo err_beta")
    parser.add_argument("--block", type=int, default=256, help="quantization block size (values per scale)")
    parser.add_argument("--reset-t", type=int, default=1024, help="LoCo reset_T")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-blocks", type=int, default=256)
    parser.add_argument("--corpus-mb", type=int, default=8)
    parser.add_argument("--ranks-per-node", type=int, default=0, help="pretend nodes of this many ranks (two hops)")
    parser.add_argument("--png", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "loco_convergence.png"))
    parser.add_argument("--json", default=None)
    parser.add_argument("--summarize", default=None, metavar="JSON",
                        help="train nothing: print the table (and plot) of a run saved with --json")
    args = parser.parse_args()
    if args.summarize:
        with open(args.summarize) as handle:
            saved = json.load(handle)
        png = args.png
        args = argparse.Namespace(**saved["args"])
        args.png, args.json = png, None
        _report(saved["runs"], args, None)
        return
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    started = time.perf_counter()
    processes = [context.Process(target=_rank_main, args=(rank, args.world, port, args, queue), daemon=True)
                 for rank in range(args.world)]
    for process in processes:
        process.start()
    runs, done = [], 0
    try:
        while done < args.world:
            kind, payload = queue.get(timeout=3600)
            if kind == "error":
                raise SystemExit(payload)
            if kind == "done":
                done += 1
                continue
            runs.append(payload)
            final = payload["curve"][-1][1]
            print(f"[{time.perf_counter() - started:6.0f}s] seed {payload['seed']} {payload['mode']:>10}: "
                  f"held-out {final:.4f}, {payload['seconds']:.1f}s, "
                  f"grad bytes/step/rank {payload['grad_bytes_per_step']:.0f}", flush=True)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
    _report(runs, args, time.perf_counter() - started)


def _report(runs: list[dict], args, elapsed) -> None:
    """Print the summary table, write the PNG and (with --json) every curve."""
    summary = _summarize(runs, args.modes)
    title = (f"GPT '{args.model}', world {args.world}, ZeRO-2, {args.steps} steps, {args.seeds} seeds, "
             f"batch {args.world}x{args.micro_batch} blocks, AdamW lr {args.lr}, quant block {args.block}")
    print(f"\n# {title}" + (f"; {elapsed:.0f} s total" if elapsed is not None else ""))
    print("| mode | final held-out loss (mean ± std) | within 1 std of exact | paired Δ vs exact (mean ± std) "
          "| seeds worse than exact | grad bytes/step/rank | vs exact |")
    print("|---|---|---|---|---|---|---|")
    for mode, entry in summary.items():
        print(f"| {mode} | {entry['final_mean']:.4f} ± {entry['final_std']:.4f} | "
              f"{'yes' if entry.get('within_one_std_of_exact') else 'no'} | "
              f"{entry.get('paired_mean', float('nan')):+.4f} ± {entry.get('paired_std', 0.0):.4f} | "
              f"{entry.get('seeds_worse_than_exact', '-')}/{len(entry['finals'])} | {entry['grad_bytes_per_step']:.0f} | "
              f"{entry.get('bytes_vs_exact', float('nan')):.4f} |")
    if args.png:
        _plot(runs, args.modes, args.png, title)
        print(f"plot: {args.png}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "summary": summary, "runs": runs}, handle, indent=1)
    if any(not math.isfinite(e["final_mean"]) for e in summary.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
