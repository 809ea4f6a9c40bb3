"""Step time of two checkouts of zerotrain, interleaved: did a change of shape cost speed?

    python benchmarks/refactor_guard.py --before /path/to/old/checkout --after . --rounds 4

    # the commit before a refactor, checked out beside this one (each side runs its own code):
    git worktree add --detach /tmp/zt-before 41f9958
    python benchmarks/refactor_guard.py --before /tmp/zt-before --after . --rounds 4
    # a smoke run of the script itself (seconds per round, numbers meaningless):
    python benchmarks/refactor_guard.py --before /tmp/zt-before --after . --rounds 1 --steps 1 --model tiny --seq-len 32

Runs, for each round, `benchmarks/zero_speed_memory.py` (ZeRO-1/2/3 engines, the 70M GPT at world 2)
and `benchmarks/offload.py --parts step` (plain and super offload, with and without clipping) from one
checkout, then the same from the other (each script runs the code of its own checkout). The order is
counterbalanced: before then after in odd rounds, after then before in even ones (with a fixed order any
drift of the machine within a round - memory left to reclaim by the launches before, a slow spell that
builds up - lands on the second checkout alone; 2026-11-27, issue #32: the offload rows, last in every
round, read 6-16% slower "after" twice while the code of their step is the same). Use an even number of
rounds. It prints, per engine/mode, the median step time over all rounds of each checkout and
after/before, and the after/before of each round (their spread is the noise the ratio is read against);
the target for a refactor is no more than 3% slower (issue #16). Used for the numbers in RESULTS.md.
It also prints the ratio of the fastest step of each side ("best"): noise on a shared machine only ever adds
time, so the minimum is the estimate least disturbed by it (the reasoning of Python's `timeit`: "the min()
of the result vectors is ... the only meaningful number"), while a slower step path raises the minimum too.
On this 2-core VM a launch's median moved up to 40% between rounds of the same code (2026-11-27, 14:04-14:23):
read the medians against the per-round spread, and the best-step ratio against the A/A run's.

    # the guard's own noise floor: the same checkout on both sides (an unbiased guard reads ~1.00 everywhere)
    python benchmarks/refactor_guard.py --before . --after . --rounds 4
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _zero(checkout: Path, engines: str, steps: int, out: Path, shape: list[str]) -> dict[str, list[float]]:
    subprocess.run([sys.executable, str(checkout / "benchmarks/zero_speed_memory.py"), "--engines", engines,
                    "--steps", str(steps), "--warmup", "2", *shape, "--json", str(out)], check=True,
                   stdout=subprocess.DEVNULL, timeout=3600)
    results = json.loads(out.read_text())["results"]
    return {r["label"]: [t for run in r.get("rounds", [r]) for t in run.get("step_times", [])] for r in results}


def _offload(checkout: Path, steps: int, shape: list[str]) -> dict[str, list[float]]:
    done = subprocess.run([sys.executable, str(checkout / "benchmarks/offload.py"), "--parts", "step",
                           "--steps", str(steps), *shape], check=True, capture_output=True, text=True, timeout=3600)
    rows: dict[str, list[float]] = {}
    for line in done.stdout.splitlines():  # | mode | fwd | bwd | step | total | vs plain | spec |
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[1].startswith("failed"):  # a mode whose ranks failed: no number to compare
            raise SystemExit(f"{checkout}: benchmarks/offload.py {cells[0]}: {cells[1]}\n{done.stdout}{done.stderr}")
        if len(cells) == 7 and re.fullmatch(r"[0-9.]+", cells[4]):
            label = cells[0]
            while label in rows:  # the same label in the second (clipping) launch
                label += " (clip)"
            rows[label] = [float(cells[4])]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, type=Path)
    parser.add_argument("--after", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default="zt1,zt2,zt3")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default="70m", help="GPT preset of both scripts: 70m (the numbers), tiny (a smoke run)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sample in both scripts (tiny: at most 32)")
    parser.add_argument("--json", type=Path, help="write every step time of both sides here")
    args = parser.parse_args()
    times: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    per_round: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}  # label -> median per round
    shape = ["--model", args.model, "--seq-len", str(args.seq_len)]
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for which in (("before", "after") if round_index % 2 == 0 else ("after", "before")):
                checkout = getattr(args, which).resolve()
                found = _zero(checkout, args.engines, args.steps, Path(tmp) / f"{which}{round_index}.json", shape)
                found.update({f"offload: {k}": v
                              for k, v in _offload(checkout, max(3, args.steps // 2), shape).items()})
                for label, values in found.items():
                    times[which].setdefault(label, []).extend(values)
                    per_round[which].setdefault(label, []).append(statistics.median(values))
                print(f"round {round_index + 1}/{args.rounds} {which}: "
                      + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in found.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"times": times, "per_round": per_round, "args": vars(args)}, default=str))
    print("\n| engine / mode | before s | after s | after / before | per round | best before s | best after s | best after / before |")
    print("|---|---|---|---|---|---|---|---|")
    worst = worst_best = 0.0
    for label, before in times["before"].items():
        after = times["after"].get(label)
        if not after:
            continue
        b, a = statistics.median(before), statistics.median(after)
        worst = max(worst, a / b)
        rounds = ", ".join(f"{x / y:.2f}" for x, y in zip(per_round["after"][label], per_round["before"][label]))
        best_b, best_a = min(before), min(after)
        worst_best = max(worst_best, best_a / best_b)
        print(f"| {label} | {b:.3f} | {a:.3f} | {a / b:.3f} | {rounds} | {best_b:.3f} | {best_a:.3f} | {best_a / best_b:.3f} |")
    print(f"\nworst after/before: medians {worst:.3f}, best steps {worst_best:.3f} (target <= 1.03)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
