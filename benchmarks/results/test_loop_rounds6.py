"""Loop worker, one pytest per round over one half of the multi-process test files (#48's 10-run loop).

usage: loop6.py HALF(0|1) ROUND...   results appended to /tmp/loop_results.txt as "R FILE rc=N Ts summary"
(rc 0: every selected test of the file passed; 1: one failed or errored; 5: none selected). The two halves are
disjoint (tests/hf/ kept in one: its files share one session launch), so two workers never run one file at once.
Stop: touch /tmp/loop_stop (the running pytest is ended; files not finished are not recorded)."""
import collections
import os
import re
import subprocess
import sys
import threading
import time

RESULTS, STOP, ROOT = "/tmp/loop_results.txt", "/tmp/loop_stop", "/work/wt/loop"
PY = "/work/main/.venv/bin/python"
LINE = re.compile(r"^(tests/\S+?\.py)::\S.*? (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def files() -> list:
    out = subprocess.run("grep -lE 'run_distributed|subprocess|torchrun|spawn|start_python|run_python|run_cli|"
                         "served_python' -r tests --include='test_*.py' | grep -v gpu/ | sort", shell=True,
                         cwd=ROOT, capture_output=True, text=True).stdout.split()
    return out


def weights(done: list) -> dict:
    seen = collections.defaultdict(list)
    for line in done:
        parts = line.split()
        if len(parts) > 3 and parts[3].endswith("s") and parts[3][:-1].isdigit():
            seen[parts[1]].append(int(parts[3][:-1]))
    return {f: sorted(v)[len(v) // 2] for f, v in seen.items()}


def halves(all_files: list, done: list) -> list:
    w = weights(done)
    groups = collections.OrderedDict()
    for f in all_files:
        key = "tests/hf/" if f.startswith("tests/hf/") else f
        groups.setdefault(key, []).append(f)
    load, out = [0, 0], [[], []]
    for key, members in sorted(groups.items(), key=lambda kv: -sum(w.get(f, 100) for f in kv[1])):
        i = 0 if load[0] <= load[1] else 1
        out[i] += members
        load[i] += sum(w.get(f, 100) for f in members)
    return [sorted(h) for h in out]


def stable_halves(done: list) -> list:
    """The split made once (the first worker to start writes it): a file stays in its half for every round."""
    import json
    path = "/tmp/loop6_halves.json"
    if not os.path.exists(path):
        with open(path + ".tmp", "w") as out:
            json.dump(halves(files(), done), out)
        os.replace(path + ".tmp", path)
    return json.load(open(path))


def main() -> None:
    half, rounds = int(sys.argv[1]), sys.argv[2:]
    for r in rounds:
        if os.path.exists(STOP):
            return
        done = open(RESULTS).read().splitlines()
        mine = stable_halves(done)[half]
        slow_only = {l.split()[1] for l in done if len(l.split()) > 2 and l.split()[2] == "rc=5"}
        todo = [f for f in mine if f not in slow_only and not any(l.startswith(f"{r} {f} rc=") for l in done)]
        if not todo:
            continue
        log = open(f"/tmp/loop6_out_{half}_{r}.txt", "w")
        proc = subprocess.Popen(["nice", "-n", "15", "timeout", "7200", PY, "-m", "pytest", "-v", "-m", "not slow",
                                 "-p", "no:cacheprovider", "-p", "no:randomly", *todo], cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

        def watch():
            while proc.poll() is None:
                if os.path.exists(STOP):
                    proc.terminate()
                    return
                time.sleep(5)
        threading.Thread(target=watch, daemon=True).start()
        current, counts, started = None, collections.Counter(), time.time()

        def record(f, counts, seconds, rc=None):
            bad = counts["FAILED"] + counts["ERROR"]
            summary = ", ".join(f"{n} {k.lower()}" for k, n in sorted(counts.items()))
            with open(RESULTS, "a") as out:
                out.write(f"{r} {f} rc={rc if rc is not None else (1 if bad else 0)} {int(seconds)}s {summary} "
                          f"(loop6 half {half})\n")
        seen = set()
        for line in proc.stdout:
            log.write(line)
            log.flush()
            m = LINE.match(line)
            if not m:
                continue
            f, status = m.groups()
            if f != current:
                if current is not None:
                    record(current, counts, time.time() - started)
                    seen.add(current)
                current, counts, started = f, collections.Counter(), started if current is None else time.time()
            counts[status] += 1
        rc = proc.wait()
        stopped = os.path.exists(STOP)
        if current is not None and not stopped and rc in (0, 1, 5):
            record(current, counts, time.time() - started)
            seen.add(current)
        if not stopped and rc in (0, 1, 5):
            for f in todo:
                if f not in seen:
                    record(f, collections.Counter(), 0, rc=5)
        if not stopped and rc not in (0, 1, 5):
            with open(RESULTS, "a") as out:
                out.write(f"LOOP6 half {half} round {r}: pytest rc={rc} (see /tmp/loop6_out_{half}_{r}.txt)\n")
        log.close()
        if stopped:
            return
        with open(RESULTS, "a") as out:
            out.write(f"ROUND {r} half {half} DONE {time.ctime()}\n")


if __name__ == "__main__":
    main()
