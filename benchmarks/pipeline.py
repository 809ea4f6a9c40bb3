"""Pipeline bubble, step time and peak memory at p = 2 stages: torch's schedules through zerotrain.pipe, vs ZeRO-3.

The bubble is measured as each rank's time blocked waiting for its peer: the wall time inside the schedule's waits
on point-to-point receives and sends (torch.distributed.pipelining.schedules._wait_batch_p2p, timed by wrapping
it here, in the benchmark only), as a fraction of the time inside the schedule (`engine.schedule.step`: the
forwards and backwards; the optimizer step after it is not pipelined) and of the whole step. Theory for GPipe /
1F1B: (p - 1) / (m + p - 1) for m micro-batches. Only p = 2: on a 2-core machine a waiting rank lends its core to
the other, so wall-clock bubbles at p > 2 mean nothing here. Each row is one fresh 2-rank job; the same GPT and
global batch are also trained with ZeRO-3 over the same 2 ranks (data parallel: each rank m/2 micro-batches per
step), and every pipeline row is given as ratios to it: step time, and each stage's peak memory over a ZeRO-3
rank's (peak RSS growth of the process over its RSS before the model was built, after the imports and
the process group: what training added).

At the end it prints, per m, the measured bubble of each schedule beside theory and whether zero-bubble is below
1F1B, then the ratios to ZeRO-3. No job starts after --max-seconds (default 330), so a run stays near 6 minutes
even on a slow machine (the jobs left out are named at the end).

    python benchmarks/pipeline.py [--preset small] [--steps 6] [--micro 4] [--seq 128] [--out results/pipeline.json]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _batches(steps: int, count: int, micro: int, seq: int, vocab: int):
    generator = torch.Generator().manual_seed(0)
    return [[(torch.randint(0, vocab, (micro, seq), generator=generator),
              torch.randint(0, vocab, (micro, seq), generator=generator)) for _ in range(count)]
            for _ in range(steps)]


def _rss_kib(field: str) -> int:
    """This process's `field` (VmRSS: now, VmHWM: its peak) from /proc/self/status, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # no /proc: the peak, for both


def _worker(rank: int, world: int, port: int, job: dict, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed.pipelining.schedules as schedules

    import zerotrain
    from zerotrain.models.gpt import GPT, GPTConfig
    from zerotrain.pipe import PipelineModule
    from zerotrain.pipe.gpt import gpt_layers, gpt_loss

    blocked = [0.0]
    original = schedules._wait_batch_p2p

    def timed_wait(work):  # the benchmark's instrument: time blocked on the peer
        start = time.perf_counter()
        try:
            return original(work)
        finally:
            blocked[0] += time.perf_counter() - start

    schedules._wait_batch_p2p = timed_wait
    from zerotrain.topology import init_distributed
    init_distributed()  # the process group (and its threads) before the baseline: what both ways have alike
    baseline_kib = _rss_kib("VmRSS")  # after the imports and the process group, before the model
    config = GPTConfig.preset(job["preset"], block_size=job["seq"])
    m, micro, seq, steps = job["m"], job["micro"], job["seq"], job["steps"]
    base = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    torch.manual_seed(0)
    if job["schedule"] == "zero3":
        cfg = dict(base, gradient_accumulation_steps=max(1, m // world), zero_optimization={"stage": 3})
        engine, _, _, _ = zerotrain.initialize(model=GPT(config), config=cfg)
        data = _batches(steps, max(1, m // world), micro, seq, config.vocab_size)

        def step(batch):
            for x, y in batch:
                _, loss = engine(x, y)
                engine.backward(loss)
                engine.step()
    else:
        module = PipelineModule(gpt_layers(config), num_stages=world, loss_fn=gpt_loss, partition_method="parameters")
        cfg = dict(base, gradient_accumulation_steps=m, zero_optimization={"stage": 1},
                   pipeline={"schedule": job["schedule"]})
        engine, _, _, _ = zerotrain.initialize(model=module, config=cfg)
        data = _batches(steps, m, micro, seq, config.vocab_size)

        schedule_step = engine.schedule.step  # the benchmark's second instrument: time inside the schedule

        def timed_schedule(*args, **kwargs):
            start = time.perf_counter()
            try:
                return schedule_step(*args, **kwargs)
            finally:
                inside[0] += time.perf_counter() - start

        engine.schedule.step = timed_schedule

        def step(batch):
            engine.train_batch(iter(batch))
    inside = [0.0]
    step(data[0])  # warm-up (torch's shape inference on the first pipeline step)
    blocked[0] = inside[0] = 0.0
    start = time.perf_counter()
    for batch in data[1:]:
        step(batch)
    seconds = time.perf_counter() - start
    result = {"rank": rank, "step_s": seconds / (steps - 1), "blocked_fraction": blocked[0] / seconds,
              "blocked_in_schedule": blocked[0] / inside[0] if inside[0] else None,
              "peak_growth_mib": (_rss_kib("VmHWM") - baseline_kib) / 1024,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    Path(f"{out}.{rank}").write_text(json.dumps(result))


def run_job(job: dict, out: Path, world: int = 2) -> list[dict]:
    port = _free_port()
    mp.start_processes(_worker, args=(world, port, job, str(out)), nprocs=world, start_method="spawn")
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world)]


def _mean(values: list) -> float:
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--ms", default="2,4,8", help="micro-batches per step (default p, 2p, 4p)")
    parser.add_argument("--schedules", default=",".join((*SCHEDULES, "zero3")))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "pipeline.json"))
    parser.add_argument("--max-seconds", type=float, default=330.0,
                        help="start no new job after this long (the run stays near 6 minutes on a slow machine; "
                             "the jobs left out are named)")
    args = parser.parse_args()
    p = 2
    began = time.perf_counter()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    names = args.schedules.split(",")
    ms = [int(v) for v in args.ms.split(",")]
    skipped: list[str] = []
    with tempfile.TemporaryDirectory(prefix="zerotrain-pipeline-") as scratch:  # the ranks' files: none left behind
        rows = _run_jobs(args, ms, names, p, began, Path(scratch) / "rank", skipped)
    summary = _summary(rows, ms, names, p)
    if skipped:
        summary.append(f"not run (past --max-seconds {args.max_seconds:g}): {', '.join(skipped)}")
    for line in summary:
        print(line)
    elapsed = time.perf_counter() - began
    print(f"({elapsed:.0f} s)")
    Path(args.out).write_text(json.dumps({"p": p, "preset": args.preset, "micro": args.micro, "seq": args.seq,
                                          "steps": args.steps, "elapsed_s": elapsed, "rows": rows,
                                          "summary": summary}, indent=1))


def _run_jobs(args: argparse.Namespace, ms: list, names: list, p: int, began: float, scratch: Path,
              skipped: list) -> list[dict]:
    """One 2-rank job per (m, schedule) until --max-seconds (those left out added to `skipped`); the ranks write
    their results to `scratch`.N."""
    rows = []
    for m in ms:
        for schedule in names:
            if time.perf_counter() - began > args.max_seconds:
                skipped.append(f"m={m} {schedule}")
                continue
            job = dict(preset=args.preset, schedule=schedule, m=m, micro=args.micro, seq=args.seq, steps=args.steps)
            ranks = run_job(job, scratch, p)
            theory = (p - 1) / (m + p - 1) if schedule in ("gpipe", "1f1b") else None
            inside = [r["blocked_in_schedule"] for r in ranks]
            row = dict(m=m, schedule=schedule, theory=theory, ranks=ranks,
                       blocked=[r["blocked_fraction"] for r in ranks],
                       bubble=_mean(inside) if None not in inside else None,
                       step_s=max(r["step_s"] for r in ranks),
                       peak_growth_mib=[round(r["peak_growth_mib"], 1) for r in ranks],
                       peak_rss_mib=[round(r["peak_rss_mib"]) for r in ranks])
            rows.append(row)
            bubble = "-" if row["bubble"] is None else f"{row['bubble']:.3f}"
            print(f"m={m:2d} {schedule:24s} blocked/schedule {bubble} (ranks "
                  f"{' '.join('-' if b is None else f'{b:.3f}' for b in inside)})  "
                  f"theory {'-' if theory is None else f'{theory:.3f}'}  step {row['step_s']:.3f}s  "
                  f"peak growth {row['peak_growth_mib']} MiB", flush=True)
    return rows


def _summary(rows: list, ms: list, names: list, p: int) -> list[str]:
    """The bubble per m beside theory (zero-bubble vs 1F1B), then every pipeline row as ratios to ZeRO-3."""
    by = {(row["m"], row["schedule"]): row for row in rows}
    pipelines = [name for name in names if name != "zero3"]
    lines = [f"bubble at p={p}: time blocked on the peer / time inside the schedule, mean of the {p} ranks",
             "   m  theory " + " ".join(f"{name:>23s}" for name in pipelines)
             + ("  zero-bubble < 1F1B" if {"1f1b", "interleaved_zero_bubble"} <= set(pipelines) else "")]
    for m in ms:
        cells = []
        for name in pipelines:
            bubble = by.get((m, name), {}).get("bubble")
            cells.append(f"{'-' if bubble is None else f'{bubble:.3f}':>23s}")
        line = f"  {m:2d}   {(p - 1) / (m + p - 1):.3f} " + " ".join(cells)
        if {"1f1b", "interleaved_zero_bubble"} <= set(pipelines):
            zb, one = (by.get((m, name), {}).get("bubble") for name in ("interleaved_zero_bubble", "1f1b"))
            if zb is not None and one is not None:
                line += f"  {'yes' if zb < one else 'NO'} ({zb:.3f} vs {one:.3f})"
        lines.append(line)
    if "zero3" in names:
        lines.append(f"vs ZeRO-3 on the same GPT, {p} ranks, global batch: step time ratio, each stage's peak memory "
                     "growth over a ZeRO-3 rank's (ratios < 1: the pipeline is faster / smaller)")
        lines.append("   m  schedule                  step   " + "  ".join(f"stage {s}" for s in range(p)))
        for m in ms:
            zero3 = by.get((m, "zero3"))
            if zero3 is None:
                continue
            z_peak = max(zero3["peak_growth_mib"])
            for name in pipelines:
                row = by.get((m, name))
                if row is None:
                    continue
                peaks = "  ".join(f"{peak / z_peak:7.2f}" for peak in row["peak_growth_mib"])
                lines.append(f"  {m:2d}  {name:24s} {row['step_s'] / zero3['step_s']:5.2f}  {peaks}")
            lines.append(f"  {m:2d}  (ZeRO-3: step {zero3['step_s']:.3f} s, peak growth {zero3['peak_growth_mib']} MiB)")
    return lines


if __name__ == "__main__":
    sys.exit(main())
