"""Parent side of benchmarks/checkpoint_speed.py: launch one phase of one engine, print the table."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ENGINES = {"zt": "zerotrain (ZeRO-3)", "ztp": "zerotrain, process writer", "dcp": "torch DCP (FSDP2)",
           "ds": "DeepSpeed (ZeRO-3)", "ztn": "zerotrain, verify_on_load false (load rounds only)",
           "zto": "zerotrain of --old-code (before)",
           "ztr": "zerotrain, reshard: the world-2 checkpoint at --reshard-world (load rounds only)"}
# engines that only load, in the load rounds: the checkpoint another engine wrote (zerotrain's, here)
LOAD_ONLY = {"ztn": "zt", "ztr": "zt"}
SCRIPT = str(Path(__file__).resolve().parent / "checkpoint_speed.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(engine: str, phase: str, world: int, args, root: Path) -> dict:
    """Run one phase of one engine in `world` fresh processes; rank 0's result."""
    port, procs, outs = _free_port(), [], []
    spec_args = {k: getattr(args, k, None) for k in ("model", "batch", "seq_len", "warmup", "repeats", "verify_on_load",
                                                     "no_async", "load_warmup", "memory_budget_gib", "reshard_world",
                                                     "prewarm_gib")}
    repo = str(Path(__file__).resolve().parent.parent)
    if engine == "zto":  # the same benchmark, importing zerotrain from the other checkout
        repo = os.path.abspath(args.old_code)
    for rank in range(world):
        out = root / f"{engine}.{phase}.rank{rank}.json"
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p))
        spec = {"engine": engine, "phase": phase, "out": str(out), "root": str(root / LOAD_ONLY.get(engine, engine)),
                "args": spec_args}
        log = open(root / f"{engine}.{phase}.rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, SCRIPT, "--_worker", json.dumps(spec)],
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
        outs.append(out)
    deadline = time.monotonic() + args.timeout
    try:  # a rank that failed leaves its peers waiting in a collective: stop them
        while time.monotonic() < deadline and any(proc.poll() is None for proc, _ in procs):
            failed = [out for (proc, _), out in zip(procs, outs) if proc.poll() is not None and
                      (not out.exists() or json.loads(out.read_text()).get("status") != "ok")]
            if failed:
                break
            time.sleep(0.2)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if not outs[0].exists():
        tail = (root / f"{engine}.{phase}.rank0.log").read_text()[-1500:]
        return {"status": "failed", "reason": "no result\n" + tail}
    return json.loads(outs[0].read_text())


def _fmt(value, spec=".2f", none="n/a") -> str:
    return none if value is None else format(value, spec)


def print_table(results: dict, args) -> None:
    zt = results.get("zt", {})
    print(f"\nmodel {args.model}, world size 2 (gloo, CPU), batch {args.batch} x seq {args.seq_len}, "
          f"best of {args.repeats}; checkpoint = model + AdamW states (fp32)\n")
    head = ("engine", "GB", "save s", "GB/s", "vs zt", "async stall s: call + fence = whole (1st whole)",
            "next step / 2 steps slower s", "load s", "reshard load s", "reshard/load")
    rows = []
    for engine, label in ENGINES.items():
        r = results.get(engine)
        if r is None:
            continue
        if r.get("status") != "ok":
            rows.append((label, f"{r.get('status')}: {r.get('reason', '').splitlines()[0][:90]}"))
            continue
        gb = r["bytes"] / 1e9
        save = f"{r['save_s']:.2f}" + (f" (+{r['fsync_s']:.2f} fsync)" if "fsync_s" in r else "")
        ratio = f"{r['save_s'] / zt['save_s']:.2f}x" if zt.get("status") == "ok" else "-"
        stall, slower = "n/a (no async save)", "n/a"
        if "whole_stall_s" in r:
            wholes = r["whole_stall_all_s"]
            best = wholes.index(r["whole_stall_s"], 1 if len(wholes) > 1 else 0)
            stall = (f"{r['stall_all_s'][best]:.3f} + {r['fence_all_s'][best]:.3f} = {wholes[best]:.3f} "
                     f"({wholes[0]:.3f})")
            slower = f"{r['next_step_slowdown_s']:.2f} / {r['step_slowdown_s']:.2f}"
        reshard = r.get("reshard_load_s")
        rows.append((label, f"{gb:.2f}", save, f"{gb / r['save_s']:.2f}", ratio, stall,
                     slower, f"{r['load_s']:.2f}",
                     _fmt(reshard, none=r.get("reshard_note", "n/a")),
                     _fmt(reshard / r["load_s"] if reshard else None)))
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for engine, r in results.items():
        if r.get("status") == "ok":
            print(f"{engine}: no-save step {r['step_s']:.2f}s; saves {['%.2f' % s for s in r['save_all_s']]}; "
                  f"loads {['%.2f' % s for s in r['load_all_s']]}"
                  + (f"; async wait after 2 steps {['%.2f' % s for s in r['async_wait_s']]}"
                     if "async_wait_s" in r else ""))


def print_load_rounds(rounds: dict, what: str = "cold loads", dd_seconds: float | None = None) -> None:
    """The interleaved cold loads (or durable saves): every round's seconds, the median and the spread (min-max),
    zerotrain's median over this one's (below 1: zerotrain is faster) and, given `dd_seconds` (dd's time for the
    same bytes on the same disk: its write for saves, its cold read for loads), this median over dd's."""
    import statistics
    zt = statistics.median(rounds["zt"]) if rounds.get("zt") else None
    print(f"\n{what} in fresh processes, engines interleaved round by round\n")
    dd = " this / dd |" if dd_seconds else ""
    print(f"| engine | {what.split()[-1]} s (round order) | median s | spread s (min-max) | zerotrain / this |{dd}")
    print("|---|---|---|---|---|" + ("---|" if dd_seconds else ""))
    for engine, label in ENGINES.items():
        if engine not in rounds:
            continue
        median = statistics.median(rounds[engine])
        ratio = f" {median / dd_seconds:.2f} |" if dd_seconds else ""
        print(f"| {label} | {', '.join('%.3f' % s for s in rounds[engine])} | {median:.3f} | "
              f"{min(rounds[engine]):.3f}-{max(rounds[engine]):.3f} | {_fmt(zt / median if zt else None)} |{ratio}")
