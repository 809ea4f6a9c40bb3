#!/usr/bin/env python
"""Where a step's wall time goes when it is not work: per phase, wall vs CPU, garbage collection, waits.

    python benchmarks/blocked_time.py --checkouts /path/to/before,. --launches 4 [--modes 0,2] [--steps 4]

Launches `benchmarks/offload.py`'s GPT (world 2, gloo, one thread per rank, ZeRO-2 with cpu offload /
super_offload, with and without clipping: `--modes` indexes offload.py's MODES) once per checkout in turn
(A, B, A, B, ...: the machine's slow spells hit both alike), each rank running its checkout's zerotrain.
Per rank and phase (forward, backward, step) it records: wall seconds, the main thread's CPU seconds
(`time.thread_time`), the process's CPU seconds (all threads), seconds spent in Python's garbage collector
(`gc.callbacks`) and the collections by generation, and the main thread's voluntary context switches (each
one a wait: a lock, a socket, a sleep). Wall minus main-thread CPU is the time the main thread did not run:
blocked, or preempted by the other 7 jobs of a loaded machine (involuntary switches count those). Per
checkout it prints the medians over launches, steps and ranks, so that work (CPU) and waiting are told apart
under load. `--preimport MODULE` imports a module in every rank before zerotrain (to test whether an import
alone changes the step: e.g. `torch.distributed.pipelining`, which brings torch._dynamo and sympy).
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import gc
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
import time
from pathlib import Path

OFFLOAD = Path(__file__).resolve().parent / "offload.py"  # its GPT, modes and engine setup
PHASES = ("fwd", "bwd", "step")


class _GcClock:
    """Seconds in the garbage collector and collections per generation, from gc.callbacks."""

    def __init__(self) -> None:
        self.seconds, self.counts, self._start = 0.0, [0, 0, 0], 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.counts[info["generation"]] += 1


def _sample(gc_clock: _GcClock) -> list[float]:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return [time.perf_counter(), time.thread_time(), time.process_time(), gc_clock.seconds, *gc_clock.counts,
            usage.ru_nvcsw, usage.ru_nivcsw]


FIELDS = ("wall", "thread_cpu", "process_cpu", "gc_s", "gc0", "gc1", "gc2", "vol_switches", "invol_switches")


@functools.lru_cache(maxsize=None)
def _offload_bench():
    """benchmarks/offload.py beside this script (its MODES and `build_engines`; zerotrain from PYTHONPATH)."""
    spec = importlib.util.spec_from_file_location("offload_bench", OFFLOAD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MODES = _offload_bench().MODES


def _calls(profile: cProfile.Profile, root: Path) -> dict[str, int]:
    """{function: calls} of a profile; the checkout's own functions by their path inside it (the two checkouts'
    paths differ), others by file name and function."""
    calls: dict[str, int] = {}
    for (path, _line, name), entry in pstats.Stats(profile).stats.items():
        path = path.replace(str(root) + "/", "").rsplit("site-packages/", 1)[-1]
        key = re.sub(r" at 0x[0-9a-f]+", "", f"{path}:{name}")
        calls[key] = calls.get(key, 0) + entry[1]
    return calls


def worker(spec: dict) -> None:
    """One rank: an engine per mode, steps alternated between them; per step and phase the FIELDS deltas."""
    if spec.get("preimport"):
        __import__(spec["preimport"])
    import torch
    import torch.distributed as dist

    import zerotrain

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    engines = _offload_bench().build_engines(spec)
    clock = _GcClock()
    gen = torch.Generator().manual_seed(rank)
    rows: list[list] = [[] for _ in engines]
    for step in range(spec["warmup"] + spec["steps"]):
        x = torch.randint(0, 256, (spec["batch"], spec["seq_len"]), generator=gen)
        for engine, engine_rows in zip(engines, rows):
            dist.barrier()
            s0 = _sample(clock)
            loss = engine(x, x)[1]
            s1 = _sample(clock)
            engine.backward(loss)
            s2 = _sample(clock)
            engine.step()
            s3 = _sample(clock)
            if step >= spec["warmup"]:
                engine_rows.append([[b - a for a, b in zip(p, q)] for p, q in ((s0, s1), (s1, s2), (s2, s3))])
    calls = []  # one more step per engine under cProfile: every Python call, waits included, per function
    for engine in engines:
        x = torch.randint(0, 256, (spec["batch"], spec["seq_len"]), generator=gen)
        dist.barrier()
        profile = cProfile.Profile()
        profile.enable()
        loss = engine(x, x)[1]
        engine.backward(loss)
        engine.step()
        profile.disable()
        calls.append(_calls(profile, Path(zerotrain.__file__).resolve().parent.parent))
    Path(spec["out"] + f".{rank}").write_text(json.dumps({"rows": rows, "modules": len(sys.modules),
                                                         "gc_objects": len(gc.get_objects()), "calls": calls}))
    for engine in engines:
        engine.close()
    dist.destroy_process_group()


def launch(checkout: Path, args, directory: str, tag: str) -> list[dict]:
    out = os.path.join(directory, tag)
    spec = dict(modes=[int(m) for m in args.modes.split(",")], out=out, model=args.model, batch=args.batch,
                seq_len=args.seq_len, bucket=args.bucket, steps=args.steps, warmup=args.warmup,
                preimport=args.preimport)
    port = str(29700 + os.getpid() % 500)
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1", PYTHONPATH=str(checkout))
        procs.append(subprocess.Popen([sys.executable, __file__, "--_worker", json.dumps(spec)], env=env))
    codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes):
        raise SystemExit(f"{checkout}: ranks exited with {codes}")
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkouts", default="", help="comma-separated checkouts, launched in turn")
    parser.add_argument("--launches", type=int, default=2, help="launches per checkout (interleaved)")
    parser.add_argument("--modes", default="0,2", help="indices into MODES, one engine each per launch")
    parser.add_argument("--model", default="70m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--bucket", type=int, default=int(2e7))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--preimport", default="", help="a module every rank imports before zerotrain")
    parser.add_argument("--preimport-only", default="", help="comma-separated checkout indices given --preimport")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--json", default="", help="write the raw per-step fields here after every launch")
    parser.add_argument("--_worker")
    args = parser.parse_args()
    if args._worker:
        worker(json.loads(args._worker))
        return 0
    checkouts = [Path(c).resolve() for c in args.checkouts.split(",")]
    only = {int(i) for i in args.preimport_only.split(",") if i}
    modes = [int(m) for m in args.modes.split(",")]
    # results[checkout][mode][field] -> values over launches, steps, ranks (per phase and the whole step)
    results: dict[int, dict] = {i: {} for i in range(len(checkouts))}
    extra: dict[int, list] = {i: [] for i in range(len(checkouts))}
    profiles: dict[int, list] = {}  # checkout -> per rank, per mode: {function: calls} of one step
    preimport = args.preimport
    with tempfile.TemporaryDirectory() as directory:
        for launch_index in range(args.launches):
            for index, checkout in enumerate(checkouts):
                args.preimport = preimport if (not only or index in only) else ""
                start = time.perf_counter()
                ranks = launch(checkout, args, directory, f"{index}-{launch_index}")
                extra[index].append((ranks[0]["modules"], ranks[0]["gc_objects"]))
                if launch_index == 0:
                    profiles[index] = [rank_data["calls"] for rank_data in ranks]
                line = []
                for rank_data in ranks:
                    for mode, mode_rows in zip(modes, rank_data["rows"]):
                        table = results[index].setdefault(mode, {})
                        for step_rows in mode_rows:
                            for phase, deltas in zip(PHASES, step_rows):
                                for field, value in zip(FIELDS, deltas):
                                    table.setdefault((phase, field), []).append(value)
                            for k, field in enumerate(FIELDS):
                                table.setdefault(("total", field), []).append(sum(d[k] for d in step_rows))
                for mode in modes:
                    recent = {f: results[index][mode][("total", f)][-2 * args.steps:] for f in FIELDS}
                    line.append(f"{MODES[mode][0]} wall {statistics.median(recent['wall']):.3f} "
                                f"cpu {statistics.median(recent['thread_cpu']):.3f} "
                                f"vol sw {statistics.median(recent['vol_switches']):.0f}")
                if args.json:
                    Path(args.json).write_text(json.dumps({checkouts[i].name: {str(m): {"|".join(k): v for k, v in t.items()}
                                                                           for m, t in results[i].items()}
                                                           for i in results}))
                print(f"launch {launch_index + 1} {checkout.name}{' +' + args.preimport if args.preimport else ''}"
                      f" ({time.perf_counter() - start:.0f} s): " + ", ".join(line), flush=True)
    print("\nmedians over launches x steps x ranks (seconds; switches: counts)")
    for mode in modes:
        print(f"\n{MODES[mode][0]}")
        print("| checkout | phase | wall | thread cpu | process cpu | wall - thread cpu | gc s | gc2 | vol sw | invol sw |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for index, checkout in enumerate(checkouts):
            table = results[index][mode]
            for phase in (*PHASES, "total"):
                med = {f: statistics.median(table[(phase, f)]) for f in FIELDS}
                blocked = statistics.median(w - c for w, c in zip(table[(phase, "wall")], table[(phase, "thread_cpu")]))
                gc2 = sum(table[(phase, "gc2")])
                print(f"| {checkout.name} | {phase} | {med['wall']:.3f} | {med['thread_cpu']:.3f} | "
                      f"{med['process_cpu']:.3f} | {blocked:.3f} | {med['gc_s']:.4f} | {gc2:.0f} | "
                      f"{med['vol_switches']:.0f} | {med['invol_switches']:.0f} |")
    for index, checkout in enumerate(checkouts):
        print(f"{checkout.name}: modules, gc objects after the run (rank 0): {extra[index]}")
    if len(checkouts) == 2 and len(profiles) == 2:
        print("\nPython calls of one profiled step (first launch), first checkout -> second, where they differ")
        for rank in range(2):
            for position, mode in enumerate(modes):
                a, b = profiles[0][rank][position], profiles[1][rank][position]
                changed = sorted((k for k in set(a) | set(b) if a.get(k, 0) != b.get(k, 0)),
                                 key=lambda k: -abs(a.get(k, 0) - b.get(k, 0)))
                print(f"rank {rank}, {MODES[mode][0]}: all calls {sum(a.values())} -> {sum(b.values())}; "
                      + "; ".join(f"{k} {a.get(k, 0)} -> {b.get(k, 0)}" for k in changed[:25]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
