"""One command for a GPU session: install what travelled, run tests/gpu, then the short benchmark table.

    bash benchmarks/gpu_check.sh                      # on the GPU machine (see benchmarks/RESULTS_gpu.md)
    bash benchmarks/gpu_check.sh --device cpu --tiny  # the dry run here: the same code on the CPU, tiny models

Without a CUDA device (and without --device cpu) it says so and exits 0 at once: CI runs that.

What it does, writing into one folder as it goes ($OUT when set, else runs/gpu_check; a run killed at its time
limit still leaves what it had):
1. installs the wheels of .whl/ (benchmarks/gpu_wheelhouse.sh fills it here) into a private target folder put
   first on PYTHONPATH: the machine's own CUDA torch stays, our other dependencies are the versions the CPU suite
   runs; `env.json` records the versions, the device and the torch APIs we rely on that this torch lacks;
2. `pytest tests/gpu` (correctness first), each test under a timeout, the whole under its share of the budget,
   pytest's tmp folders on a disk that takes O_DIRECT: `tests.log` (line by line) and `tests.xml`;
3. benchmarks/gpu_bench.py with the time left: `bench.jsonl` (a line per part as it finishes) and `bench.log`;
4. `summary.md`: the test counts and the benchmark table, printed last.
Exit status: 0 when every test passed (or no CUDA), 1 otherwise. The benchmark never fails the run.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TORCH_APIS = [  # (what, dotted path): every torch API zerotrain or these tests use that is newer than torch 2.4
    ("single-tensor reduce-scatter (2.13 name)", "torch.distributed.reduce_scatter_single"),
    ("single-tensor all-gather (2.13 name)", "torch.distributed.all_gather_single"),
    ("reduce_scatter_tensor (older name)", "torch.distributed.reduce_scatter_tensor"),
    ("all_gather_into_tensor (older name)", "torch.distributed.all_gather_into_tensor"),
    ("get_total_norm", "torch.nn.utils.get_total_norm"),
    ("clip_grads_with_norm_", "torch.nn.utils.clip_grads_with_norm_"),
    ("sdpa_kernel", "torch.nn.attention.sdpa_kernel"),
    ("torch.accelerator", "torch.accelerator"),
    ("fully_shard (FSDP2)", "torch.distributed.fsdp.fully_shard"),
    ("pipelining", "torch.distributed.pipelining"),
    ("get_process_group_ranks", "torch.distributed.get_process_group_ranks"),
    ("nextafter", "torch.nextafter"),
    ("private: fused-kernel devices (zerotrain.optim)",
     "torch.utils._foreach_utils._get_fused_kernels_supported_devices"),
    ("private: pytree tree_flatten (stage 3)", "torch.utils._pytree.tree_flatten"),
    ("private: CUDA memory history (monitor)", "torch.cuda.memory._record_memory_history"),
]


def _has(dotted: str) -> bool:
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def log(out: Path, message: str) -> None:
    line = f"[gpu_check {time.strftime('%H:%M:%S')}] {message}"
    print(line, flush=True)
    with open(out / "summary.md", "a") as handle:
        handle.write(message + "\n")


def install_wheels(site: Path, out: Path) -> dict:
    """pip install --no-index --no-deps every wheel of .whl into `site` (fresh); returns what was installed."""
    wheels = sorted(glob.glob(str(REPO / ".whl" / "*.whl")))
    if not wheels:
        return {"wheels": [], "note": "no .whl folder: using the machine's packages as they are"}
    shutil.rmtree(site, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", str(site), *wheels]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        log(out, f"wheel install FAILED ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return {"wheels": [os.path.basename(w) for w in wheels], "returncode": done.returncode}


def probe() -> dict:
    """Versions, the device and the torch APIs this torch lacks (run in a child with the run's PYTHONPATH)."""
    import importlib

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "peft", "deepspeed", "pydantic", "isal", "accelerate", "safetensors",
                 "tokenizers", "numpy", "pytest", "pytest_timeout", "hypothesis"):
        try:
            module = importlib.import_module(name)
            out[name] = f"{getattr(module, '__version__', '?')} @ {getattr(module, '__file__', '')}"
        except Exception as error:  # noqa: BLE001 - recorded, the run goes on
            out[name] = f"MISSING ({type(error).__name__}: {error})"
    import torch

    out["cuda_available"], out["torch_cuda"] = torch.cuda.is_available(), torch.version.cuda
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out["device"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                         "sm": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count}
    out["torch_apis_missing"] = [what for what, dotted in TORCH_APIS if not _has(dotted)]
    return out


def environment(env: dict, device: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--probe"], capture_output=True, text=True, env=env,
                          timeout=120)
    try:
        info = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        info = {"probe_error": done.stderr[-2000:]}
    info.update(platform=platform.platform(), requested_device=device, cpus=os.cpu_count())
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    return info


def scratch_dir(out: Path) -> Path:
    """A folder for pytest's tmp paths and NVMe files on a filesystem that takes O_DIRECT (never under $OUT:
    its files would travel back). The first candidate that takes it, else the first that exists."""
    candidates = [os.environ.get("ZEROTRAIN_SCRATCH"), str(REPO / "runs" / "gpu_scratch"), "/var/tmp/zerotrain_gpu",
                  os.path.join(tempfile.gettempdir(), "zerotrain_gpu")]
    from zerotrain.offload.aio import direct_io_supported

    usable = []
    for candidate in filter(None, candidates):
        try:
            os.makedirs(candidate, exist_ok=True)
        except OSError:
            continue
        usable.append(candidate)
        if direct_io_supported(candidate):
            return Path(candidate)
    log(out, f"no candidate folder takes O_DIRECT ({usable}): the NVMe paths run with buffered I/O")
    return Path(usable[0])


def run_streamed(command: list, env: dict, log_path: Path, timeout: float) -> tuple[int, float]:
    """Run `command`, its output copied line by line into `log_path` and to stdout; kill it (and its children)
    after `timeout` seconds. Returns (return code, 124 on timeout; seconds)."""
    start = time.monotonic()
    with open(log_path, "a") as handle:
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   cwd=REPO, start_new_session=True, bufsize=1)
        import selectors
        selector = selectors.DefaultSelector()
        selector.register(process.stdout, selectors.EVENT_READ)
        timed_out = False
        while True:
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                timed_out = True
                break
            if not selector.select(timeout=min(left, 1.0)):
                if process.poll() is not None:
                    break
                continue
            line = process.stdout.readline()
            if not line:
                break
            handle.write(line)
            handle.flush()
            sys.stdout.write(line)
            sys.stdout.flush()
        if timed_out:
            import signal
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            handle.write(f"\n[gpu_check] killed after {timeout:.0f} s\n")
        process.wait()
    return (124 if timed_out else process.returncode), time.monotonic() - start


def test_counts(xml_path: Path) -> dict:
    import xml.etree.ElementTree as ET

    if not xml_path.exists():
        return {}
    root = ET.parse(xml_path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    counts["failed_names"] = [case.get("name") for case in suite.iter("testcase")
                              if case.find("failure") is not None or case.find("error") is not None]
    return counts


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="cpu: the dry run (tests/gpu on the CPU, the benchmark's code at --tiny sizes)")
    parser.add_argument("--tiny", action="store_true", help="tiny benchmark models (the dry run)")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "runs" / "gpu_check"))
    parser.add_argument("--budget", type=float, default=285.0, help="seconds for everything (default 285)")
    parser.add_argument("--test-share", type=float, default=0.5, help="share of the budget for tests/gpu")
    parser.add_argument("--test-timeout", type=int, default=150, help="seconds per test")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--tests", default="tests/gpu",
                        help="pytest arguments, shell-quoted (default tests/gpu; e.g. \"tests/gpu -k 'lora or gloo'\")")
    parser.add_argument("--parts", default="", help="benchmark parts, comma-separated (default: all)")
    parser.add_argument("--install", action="store_true",
                        help="install .whl's wheels on the CPU too (a simulation of the GPU machine's set-up)")
    parser.add_argument("--nvme-size", default="", help="the benchmark's nvme model (gpu_bench.py --nvme-size)")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe()))
        return 0
    start = time.monotonic()

    device = args.device
    if device == "auto":
        import torch
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here: nothing to check (exit 0). "
                  "Pass --device cpu --tiny for the dry run.", flush=True)
            return 0
        device = "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(f"# gpu_check {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, device {device}"
                                    f"{' (tiny)' if args.tiny else ''}\n\n")

    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    paths = [str(REPO)]
    if device == "cuda" or args.install:
        site = Path(tempfile.gettempdir()) / "zerotrain_gpu_site"
        installed = install_wheels(site, out)
        if installed["wheels"]:
            paths.insert(0, str(site))
    else:  # the dry run uses this machine's environment as it is
        installed = {"wheels": [], "note": "dry run: this environment's packages"}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["ZEROTRAIN_GPU_DRY_RUN"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    sys.path[:0] = paths  # this process imports zerotrain too (scratch_dir), which needs the carried pydantic
    info = environment(env, device)
    info["installed"] = installed
    (out / "env.json").write_text(json.dumps(info, indent=1))
    log(out, f"environment: torch {info.get('torch', '?').split(' @')[0]}, "
             f"transformers {info.get('transformers', '?').split(' @')[0]}, "
             f"deepspeed {info.get('deepspeed', '?').split(' @')[0]}, device {info.get('device', device)}")
    if info.get("torch_apis_missing"):
        log(out, f"torch lacks: {', '.join(info['torch_apis_missing'])}")
    scratch = scratch_dir(out)
    env["ZEROTRAIN_SCRATCH"] = str(scratch)

    status = 0
    if not args.skip_tests:
        test_budget = args.budget * args.test_share - (time.monotonic() - start)
        command = [sys.executable, "-m", "pytest", *shlex.split(args.tests), "-v", "-rfE", "-p", "no:cacheprovider",
                   "-o", "addopts=", f"--timeout={args.test_timeout}", f"--junitxml={out / 'tests.xml'}",
                   f"--basetemp={scratch / 'pytest'}"]
        log(out, f"tests: {' '.join(command[3:])} (at most {test_budget:.0f} s)")
        code, seconds = run_streamed(command, env, out / "tests.log", max(30.0, test_budget))
        counts = test_counts(out / "tests.xml")
        passed = counts.get("tests", 0) - counts.get("failures", 0) - counts.get("errors", 0) - counts.get("skipped", 0)
        log(out, f"tests: exit {code} in {seconds:.0f} s; {passed} passed, {counts.get('failures', 0)} failed, "
                 f"{counts.get('errors', 0)} errors, {counts.get('skipped', 0)} skipped"
                 + (f"; FAILED: {', '.join(counts['failed_names'])}" if counts.get("failed_names") else "")
                 + (" (TIMED OUT: see tests.log for the last test)" if code == 124 else ""))
        status = 0 if code == 0 else 1
    if not args.skip_bench:
        bench_budget = args.budget - (time.monotonic() - start)
        command = [sys.executable, str(REPO / "benchmarks" / "gpu_bench.py"), "--device", device, "--out", str(out),
                   "--budget", f"{max(20.0, bench_budget - 10):.0f}", "--scratch", str(scratch)]
        command += ["--tiny"] if args.tiny else []
        command += ["--parts", args.parts] if args.parts else []
        command += ["--nvme-size", args.nvme_size] if args.nvme_size else []
        log(out, f"benchmark: at most {bench_budget:.0f} s")
        code, seconds = run_streamed(command, env, out / "bench.log", max(30.0, bench_budget))
        table = out / "bench.md"
        log(out, f"benchmark: exit {code} in {seconds:.0f} s")
        if table.exists():
            log(out, "\n" + table.read_text())
    log(out, f"gpu_check: done in {time.monotonic() - start:.0f} s, exit {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
