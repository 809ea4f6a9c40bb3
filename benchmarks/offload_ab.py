"""A/B of the offload step alone: `benchmarks/offload.py --parts step --steps 5` of two checkouts, alternating
which runs first, N launches each; per mode the medians, the best launches and each pair's ratio (issue #32: the
guard's no-clip offload rows, whose wall clock moved with the VM's speed between its rounds).

    python benchmarks/offload_ab.py BEFORE_CHECKOUT AFTER_CHECKOUT [N=6] [--json OUT]
"""
import json
import re
import statistics
import subprocess
import sys

PY = sys.executable
args = [a for a in sys.argv[1:] if not a.startswith("--json")]
OUT = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--json=")), None)
SIDES = {"before": args[0], "after": args[1]}
N = int(args[2]) if len(args) > 2 else 6
rows = {"before": {}, "after": {}}
for i in range(N):
    order = ("before", "after") if i % 2 == 0 else ("after", "before")
    for side in order:
        out = subprocess.run([PY, f"{SIDES[side]}/benchmarks/offload.py", "--parts", "step", "--steps", "5",
                              "--model", "70m", "--seq-len", "128"], capture_output=True, text=True, timeout=900).stdout
        got = {}
        for line in out.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 7 and re.fullmatch(r"[0-9.]+", cells[4]):
                got[cells[0]] = float(cells[4])
        for k, v in got.items():
            rows[side].setdefault(k, []).append(v)
        print(i, side, got, flush=True)
if OUT:
    json.dump(rows, open(OUT, "w"))
print("\n| mode | before median | after median | ratio | before min | after min | ratio (min) | per pair |")
for k in rows["before"]:
    b, a = rows["before"][k], rows["after"][k]
    pairs = ", ".join(f"{y / x:.2f}" for x, y in zip(b, a))
    print(f"| {k} | {statistics.median(b):.3f} | {statistics.median(a):.3f} | {statistics.median(a)/statistics.median(b):.3f} | {min(b):.3f} | {min(a):.3f} | {min(a)/min(b):.3f} | {pairs} |")
