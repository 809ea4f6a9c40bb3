"""Work per training step of two checkouts of zerotrain, counted: a speed A/B that load does not blur.

    python benchmarks/step_work.py --before /path/to/old/checkout --after . --engines zt2 --rounds 4
    # offload.py's offloaded steps (ZeRO-2; cpu offload, + super_offload; clip 1.0, no clip), by MODES index
    python benchmarks/step_work.py --before /path/to/old/checkout --after . --engines off0,off1,off2,off3

`refactor_guard.py` compares wall-clock step times, which on a shared 2-core VM move by ±10% with the
other jobs. This script compares what does not move with load, for the same runs `zero_speed_memory.py`
makes (its engine setup, 70M GPT, world 2, gloo, one thread per rank), each checkout's code in its own
processes. Engines `off0`..`off3` are `benchmarks/offload.py`'s step modes instead (its MODES by index: the
70M GPT, ZeRO-2, reduce_bucket_size 2e7, `offload_optimizer` cpu or + super_offload, gradient_clipping 1.0 or 0;
its random batches and launch environment), one engine per launch: the config is built by `build_engines` of
the offload.py beside this script (an older checkout's offload.py may lack it) and run by each checkout's own
`zerotrain.initialize`. For every engine:

* CPU seconds per step (user + sys of the whole process, all threads, `getrusage`), per rank,
  rounds interleaved before/after: far less sensitive to load than wall time (waiting costs none),
  and the minor page faults per step (the kernel's share of fresh allocations);
* on rank 0, once per checkout: Python function calls per step (cProfile; zerotrain's own functions
  listed where the counts differ), torch ops per step and the bytes they allocate (torch.profiler with
  `profile_memory`), and the collectives per step with their bytes (the engine's comm counters); cProfile
  sees the main thread only (super_offload's speculation thread shows in CPU seconds and torch ops).
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import importlib.util
import json
import os
import pstats
import re
import resource
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Optional


def _load_bench(checkout: Path):
    """The checkout's own benchmarks/zero_speed_memory.py, for its exact engine setup and batches."""
    spec = importlib.util.spec_from_file_location("zsm", checkout / "benchmarks/zero_speed_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def _offload_bench():
    """benchmarks/offload.py beside this script: its MODES and `build_engines` (zerotrain from sys.path)."""
    spec = importlib.util.spec_from_file_location("offload_bench", Path(__file__).resolve().parent / "offload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _offload_mode(engine: str) -> Optional[int]:
    """offload.py's MODES index of engine `off<N>`, or None for a zero_speed_memory.py engine."""
    return int(engine[3:]) if re.fullmatch(r"off\d", engine) else None


def _offload_runner(mode: int, model: str, batch: int):
    """One engine of offload.py's mode `mode`, as a zero_speed_memory.py Runner (its config built by
    offload.py's `build_engines`, run by the zerotrain on sys.path); the engine, for its close()."""
    engine = _offload_bench().build_engines({"modes": [mode], "model": model, "batch": batch, "bucket": int(2e7)})[0]
    runner = SimpleNamespace(forward=lambda x, y: engine(x, y)[1], backward=engine.backward, step=engine.step,
                             comm=lambda: engine.memory_report()["comm"])
    return runner, engine


def _offload_batches(n: int, batch: int, seq_len: int, rank: int) -> list:
    """offload.py's batches: random bytes seeded by the rank, the input its own target."""
    import torch
    gen = torch.Generator().manual_seed(rank)
    return [(x, x) for x in (torch.randint(0, 256, (batch, seq_len), generator=gen) for _ in range(n))]


def _step(runner, x, y) -> None:
    runner.backward(runner.forward(x, y))
    runner.step()


def _function_calls(profile: cProfile.Profile, steps: int, checkout: str) -> tuple[float, dict[str, float]]:
    """(all Python-level calls per step, {function: calls per step}); the checkout's functions are named by
    their path inside it (the two checkouts' paths differ), others without line numbers or addresses."""
    stats = pstats.Stats(profile).stats
    total = sum(entry[1] for entry in stats.values()) / steps  # ncalls including recursion
    calls: dict[str, float] = {}
    for (path, line, name), entry in stats.items():
        for root in (checkout, str(Path(__file__).resolve().parent.parent)):
            path = path.replace(root.rstrip("/") + "/", "")
        path = path.rsplit("site-packages/", 1)[-1]
        key = re.sub(r" at 0x[0-9a-f]+", "", f"{path}:{name}")
        calls[key] = calls.get(key, 0.0) + entry[1] / steps
    return total, calls


def _torch_ops(runner, batches, steps: int) -> tuple[dict[str, float], float, float]:
    """({op: calls per step}, bytes allocated per step, allocations per step) over `steps` steps."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for x, y in batches[:steps]:
            _step(runner, x, y)
    ops: Counter = Counter()
    allocated = allocations = 0
    for event in prof.profiler.kineto_results.events():  # the raw events: every allocation, also inside ops
        if event.name() == "[memory]":
            if event.nbytes() > 0:
                allocated += event.nbytes()
                allocations += 1
        else:
            ops[event.name()] += 1
    return {k: v / steps for k, v in ops.items()}, allocated / steps, allocations / steps


def worker(spec: dict) -> None:
    """One rank: build the engine as zero_speed_memory.py does, warm up, then count (written to spec["out"])."""
    import torch
    import torch.distributed as dist
    sys.path.insert(0, spec["checkout"])  # this checkout's zerotrain
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from zerotrain.models import GPTConfig
    seq_len = min(128, GPTConfig.preset(spec["model"]).block_size)  # both scripts' default
    need = 2 + spec["steps"] + 2 * spec["profile_steps"]
    mode, engine = _offload_mode(spec["engine"]), None
    if mode is not None:
        batches = _offload_batches(need, 4, seq_len, rank)
        runner, engine = _offload_runner(mode, spec["model"], 4)
    else:
        bench = _load_bench(Path(spec["checkout"]))
        args = argparse.Namespace(model=spec["model"], batch=4, seq_len=seq_len, bucket=int(2e7), adamw="fused",
                                  steps=spec["steps"], warmup=2, shape="gpt")  # shape: zero_speed_memory.py >= #27
        batches = bench._make_batches(need, args.batch, args.seq_len, rank)
        runner = bench._setup(args, spec["engine"])
    import zerotrain
    assert Path(zerotrain.__file__).resolve().is_relative_to(Path(spec["checkout"]).resolve()), zerotrain.__file__
    for x, y in batches[:2]:  # warm-up
        _step(runner, x, y)
    out: dict = {"cpu": [], "user": [], "sys": [], "minflt": []}
    for x, y in batches[2:2 + spec["steps"]]:
        dist.barrier()
        before = resource.getrusage(resource.RUSAGE_SELF)
        _step(runner, x, y)
        after = resource.getrusage(resource.RUSAGE_SELF)
        out["user"].append(after.ru_utime - before.ru_utime)
        out["sys"].append(after.ru_stime - before.ru_stime)
        out["cpu"].append(out["user"][-1] + out["sys"][-1])
        out["minflt"].append(after.ru_minflt - before.ru_minflt)
    rest = batches[2 + spec["steps"]:]
    if spec["profile_steps"]:
        n = spec["profile_steps"]
        comm0 = runner.comm()
        profiler = cProfile.Profile()
        if rank == 0:
            profiler.enable()
        for x, y in rest[:n]:
            _step(runner, x, y)
        profiler.disable()
        comm1 = runner.comm()
        out["comm"] = {k: {"calls": (v["calls"] - comm0.get(k, {}).get("calls", 0)) / n,
                           "bytes": (v["bytes"] - comm0.get(k, {}).get("bytes", 0)) / n}
                       for k, v in comm1.items() if v["calls"] - comm0.get(k, {}).get("calls", 0)}
        if rank == 0:
            out["py_calls"], out["function_calls"] = _function_calls(profiler, n, spec["checkout"])
            out["ops"], out["alloc_bytes"], out["allocs"] = _torch_ops(runner, rest[n:], n)
        else:
            for x, y in rest[n:2 * n]:
                _step(runner, x, y)
    if engine is not None:
        out["offload_stats"] = engine.offload_stats()  # super_offload: speculative / committed / redone steps
    Path(spec["out"] + f".rank{rank}").write_text(json.dumps(out))
    dist.barrier()
    if engine is not None:
        engine.close()
    dist.destroy_process_group()


def run(checkout: Path, engine: str, steps: int, profile_steps: int, model: str, tmp: Path) -> list[dict]:
    """Both ranks of one engine from one checkout, in fresh processes; each rank's numbers."""
    bench = _load_bench(checkout)
    port = bench._free_port()
    out = str(tmp / f"{checkout.name}-{engine}")
    spec = json.dumps({"checkout": str(checkout), "engine": engine, "steps": steps, "profile_steps": profile_steps,
                       "model": model, "out": out})
    procs = []
    for rank in range(2):
        env = bench._child_env(rank, port, engine)
        if _offload_mode(engine) is not None:  # offload.py's launch sets no malloc or accelerator variables
            for key in ("MALLOC_MMAP_THRESHOLD_", "DS_ACCELERATOR", "MKL_NUM_THREADS", "PYTHONUNBUFFERED",
                        "LOCAL_WORLD_SIZE"):
                if key in os.environ:
                    env[key] = os.environ[key]
                else:
                    env.pop(key, None)
        env["PYTHONPATH"] = str(checkout)
        procs.append(subprocess.Popen([sys.executable, __file__, "--_worker", spec], env=env))
    codes = [p.wait(timeout=3600) for p in procs]
    if any(codes):
        raise SystemExit(f"{checkout} {engine}: worker exit codes {codes}")
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]


def _report(engine: str, found: dict[str, list[list[dict]]]) -> None:
    b_runs, a_runs = found["before"], found["after"]
    mode = _offload_mode(engine)
    print(f"\n### {engine}" + (f" (offload.py: {_offload_bench().MODES[mode][0]})" if mode is not None else "")
          + "\n")
    print("| per step | before | after | after / before |\n|---|---|---|---|")
    for rank in range(2):
        b = statistics.median(t for run in b_runs for t in run[rank]["cpu"])
        a = statistics.median(t for run in a_runs for t in run[rank]["cpu"])
        print(f"| CPU s, rank {rank} (median of {sum(len(r[rank]['cpu']) for r in a_runs)} steps) | {b:.3f} | "
              f"{a:.3f} | {a / b:.3f} |")
    for key, label in (("user", "user CPU s"), ("sys", "sys CPU s"), ("minflt", "minor faults")):
        for rank in range(2):
            if key not in b_runs[0][rank] or key not in a_runs[0][rank]:
                continue
            b = statistics.median(t for run in b_runs for t in run[rank][key])
            a = statistics.median(t for run in a_runs for t in run[rank][key])
            print(f"| {label}, rank {rank} | {b:,.3f} | {a:,.3f} | {a / b if b else float('nan'):.3f} |")
    for rank in range(2):
        b = [statistics.median(run[rank]["cpu"]) for run in b_runs]
        a = [statistics.median(run[rank]["cpu"]) for run in a_runs]
        print(f"| CPU s rank {rank}, round medians | {' '.join(f'{v:.2f}' for v in b)} | "
              f"{' '.join(f'{v:.2f}' for v in a)} | |")
    b0, a0 = b_runs[0][0], a_runs[0][0]
    if "offload_stats" in b0:
        print(f"| offload_stats() at the end, rank 0 | {b0['offload_stats']} | {a0.get('offload_stats')} | |")
    if "py_calls" not in b0:
        return
    rows = [("Python calls (cProfile)", b0["py_calls"], a0["py_calls"]),
            ("torch ops (profiler events)", sum(b0["ops"].values()), sum(a0["ops"].values())),
            ("bytes allocated", b0["alloc_bytes"], a0["alloc_bytes"]),
            ("allocations", b0["allocs"], a0["allocs"])]
    for kind in sorted(set(b0["comm"]) | set(a0["comm"])):
        for field in ("calls", "bytes"):
            rows.append((f"comm {kind} {field}", b0["comm"].get(kind, {}).get(field, 0),
                         a0["comm"].get(kind, {}).get(field, 0)))
    for label, b, a in rows:
        print(f"| {label} | {b:,.0f} | {a:,.0f} | {a / b if b else float('nan'):.3f} |")
    for title, key in (("Python functions", "function_calls"), ("torch ops", "ops")):
        names = set(b0[key]) | set(a0[key])
        diff = sorted((n for n in names if b0[key].get(n, 0) != a0[key].get(n, 0)),
                      key=lambda n: -abs(a0[key].get(n, 0) - b0[key].get(n, 0)))
        print(f"\n{title} whose calls per step differ ({len(diff)}): " + (", ".join(
            f"{n} {b0[key].get(n, 0):g}->{a0[key].get(n, 0):g}" for n in diff[:40]) or "none"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path)
    parser.add_argument("--after", type=Path)
    parser.add_argument("--engines", default="zt2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps timed for CPU seconds per launch")
    parser.add_argument("--profile-steps", type=int, default=2, help="steps counted (first round only)")
    parser.add_argument("--model", default="70m")
    parser.add_argument("--json", default=None, help="also write every launch's numbers here")
    parser.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._worker:
        worker(json.loads(args._worker))
        return 0
    if args.before is None or args.after is None:
        parser.error("--before and --after are required")
    every: dict = {}
    with tempfile.TemporaryDirectory(prefix="zt-stepwork-") as tmp:
        for engine in args.engines.split(","):
            found: dict[str, list] = {"before": [], "after": []}
            for round_index in range(args.rounds):
                for which in ("before", "after"):
                    checkout = getattr(args, which).resolve()
                    ranks = run(checkout, engine, args.steps, args.profile_steps if round_index == 0 else 0,
                                args.model, Path(tmp))
                    found[which].append(ranks)
                    print(f"round {round_index + 1} {which} {engine}: CPU s/step "
                          + " | ".join(" ".join(f"{t:.2f}" for t in r["cpu"]) for r in ranks), flush=True)
            _report(engine, found)
            every[engine] = found
    if args.json:
        Path(args.json).write_text(json.dumps(every))
    return 0


if __name__ == "__main__":
    sys.exit(main())
