"""Random whole-job kills and stop signals during save-every-step training, each checked for real.

    python benchmarks/crash_trials.py --trials 20                  # every mode, 20 trials each
    python benchmarks/crash_trials.py --modes sigterm --trials 5

Modes:
* ``kill9-sync`` / ``kill9-async``: `zerotrain train --nproc 2` (tiny GPT, ZeRO-3, a checkpoint every
  step, synchronous or asynchronous saves) is SIGKILLed as a whole job (launcher, agent and ranks at
  once, as a node failure or the OOM killer of a cgroup would) at a random moment after training began;
* ``sigterm``: the launcher gets SIGTERM at a random moment (the ranks must agree, save and exit 143).

Each trial then checks what a restarted job relies on: `zerotrain ckpt verify` of the save directory
passes; a `--resume` run to a fixed step count completes; its losses for the steps after the resume
point equal those of one uninterrupted reference run (exact continuation); after SIGTERM, the
checkpoint is the step the job stopped at. It prints one table row per mode (trials, held, what broke).
Test-suite versions of single trials live in tests/test_lifecycle.py and tests/checkpoint/test_ckpt_crash.py.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODES = ("kill9-sync", "kill9-async", "sigterm")
TOTAL_STEPS = 14


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    return env


def _config(workdir: Path, async_save: bool) -> Path:
    config = json.loads((REPO / "examples/zero3.json").read_text())
    config["checkpoint"] = {"async_save": async_save}
    path = workdir / f"config_{'async' if async_save else 'sync'}.json"
    path.write_text(json.dumps(config))
    return path


def _cmd(config: Path, save_dir: Path, log_dir: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "zerotrain.cli", "train", "--config", str(config), "--nproc", "2",
            "--model", "tiny", "--steps", str(steps), "--max-corpus-bytes", "300000", "--val-fraction", "0",
            "--save-dir", str(save_dir), "--log-dir", str(log_dir), *extra]


def _losses(log_dir: Path) -> dict[int, float]:
    path = log_dir / "metrics.jsonl"
    out: dict[int, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                out[record["step"]] = record["loss"]
    return out


def _reference(workdir: Path, config: Path) -> dict[int, float]:
    log = workdir / "reference_log"
    subprocess.run(_cmd(config, workdir / "reference_ckpt", log, TOTAL_STEPS), env=_env(), check=True,
                   capture_output=True, timeout=600)
    return _losses(log)


def _trial(mode: str, workdir: Path, config: Path, reference: dict[int, float], rng: random.Random) -> str:
    """'' when the trial held, else what broke."""
    save_dir, log_dir = workdir / "ckpt", workdir / "log"
    proc = subprocess.Popen(_cmd(config, save_dir, log_dir, TOTAL_STEPS, "--save-every", "1"), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while len(_losses(log_dir)) < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 2.0))  # somewhere in steps 1..~10, saving every step
    if proc.poll() is not None:
        return "" if proc.returncode == 0 else f"ended by itself with status {proc.returncode}"
    if mode == "sigterm":
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 128 + signal.SIGTERM:
            return f"SIGTERM: exit status {proc.returncode}: {err[-300:]}"
        stop_step = max(_losses(log_dir))
        latest = (save_dir / "latest").read_text().strip()
        if latest != f"global_step{stop_step}":
            return f"SIGTERM at step {stop_step}, but latest is {latest}"
    else:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole job at once
        proc.communicate()
    verify = subprocess.run([sys.executable, "-m", "zerotrain.cli", "ckpt", "verify", str(save_dir)], env=_env(),
                            capture_output=True, text=True, timeout=300)
    if verify.returncode != 0 and (save_dir / "latest").exists():
        return f"verify failed: {verify.stderr.strip()[-300:]}"
    resumed = subprocess.run(_cmd(config, save_dir, log_dir, TOTAL_STEPS, "--resume"), env=_env(),
                             capture_output=True, text=True, timeout=600)
    if resumed.returncode != 0:
        return f"resume failed: {resumed.stderr.strip()[-300:]}"
    got = _losses(log_dir)
    for step in range(1, TOTAL_STEPS + 1):
        if step not in got or abs(got[step] - reference[step]) > 1e-6 * abs(reference[step]):
            return f"step {step}: loss {got.get(step)} after resume, {reference[step]} uninterrupted"
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials per mode (default 20)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}")
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="zt-crash-") as tmp:
        root = Path(tmp)
        references = {}
        for mode in modes:
            async_save = mode == "kill9-async"
            config = _config(root, async_save)
            if async_save not in references:
                references[async_save] = _reference(root / f"ref_{async_save}", config)
            failures = []
            started = time.perf_counter()
            for trial in range(args.trials):
                workdir = root / f"{mode}_{trial}"
                workdir.mkdir(parents=True)
                problem = _trial(mode, workdir, config, references[async_save], rng)
                print(f"[{mode}] trial {trial + 1}/{args.trials}: {'held' if not problem else problem}", flush=True)
                if problem:
                    failures.append(problem)
                subprocess.run(["rm", "-rf", str(workdir)])
            rows.append((mode, args.trials, args.trials - len(failures), time.perf_counter() - started,
                         failures[0] if failures else ""))
    print()
    print("| mode | trials | held | wall s | first failure |")
    print("|---|---|---|---|---|")
    for mode, trials, held, wall, failure in rows:
        print(f"| {mode} | {trials} | {held} | {wall:.0f} | {failure or '-'} |")
    return 0 if all(held == trials for _, trials, held, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
