"""`zerotrain merge` vs mergekit on the same model pair: wall time, peak memory, and agreement.

Builds (offline, random init) a base and two "fine-tuned" models (base + seeded noise) of a
Llama-shaped config (~70M parameters by default, `--size 1b` for ~1.1B), writes one
mergekit-style YAML per method, and runs each merge in a fresh process: zerotrain from this
checkout (`python -m zerotrain.cli merge CONFIG OUT`), mergekit from its own venv
(`mergekit-yaml CONFIG OUT`; mergekit pins other torch/transformers versions, so it lives in a
separate venv, see docs/merge.md). Per run: wall seconds, peak RSS (ru_maxrss: includes the
file pages of memory-mapped inputs) and peak RssAnon (sampled every 10 ms: the process's own
memory). Then the outputs are compared tensor by tensor: deterministic methods must agree
within 1e-6 (max abs difference), DARE (random masks, each tool its own RNG) statistically:
the fraction of elements changed from the base matches the density on both sides.

    python benchmarks/merge.py --mergekit /work/wt/mergekit-venv/bin/mergekit-yaml [--size 70m|1b]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch
from safetensors import safe_open

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {"70m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=10, vocab_size=32000),
         "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=18, vocab_size=32000)}
METHODS = {
    "linear": "parameters:\n  weight: 0.5\n",
    "task_arithmetic": "parameters:\n  weight: 0.6\n",
    "ties": "parameters:\n  weight: 0.5\n  density: 0.5\n",
    "slerp": None,
    "dare_ties": "parameters:\n  weight: 0.5\n  density: 0.3\n",
}


def build(root: str, size: str) -> dict:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False,
                                      **SIZES[size])
    model = transformers.LlamaForCausalLM(config)
    dirs = {"base": os.path.join(root, "base")}
    model.save_pretrained(dirs["base"], max_shard_size="1GB")
    params = sum(p.numel() for p in model.parameters())
    for seed, name in ((1, "a"), (2, "b")):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))
        dirs[name] = os.path.join(root, name)
        model.save_pretrained(dirs[name], max_shard_size="1GB")
    del model
    return dirs | {"params": params}


def yaml_for(method: str, dirs: dict) -> str:
    if method == "slerp":
        return (f"merge_method: slerp\nbase_model: {dirs['base']}\nmodels:\n  - model: {dirs['base']}\n"
                f"  - model: {dirs['a']}\nparameters:\n  t: [0, 0.5, 1]\ndtype: float32\n")
    models = "".join(f"  - model: {dirs[k]}\n    {METHODS[method].replace(chr(10), chr(10) + '    ').rstrip()}\n"
                     for k in ("a", "b"))
    base = "" if method == "linear" else f"base_model: {dirs['base']}\n"
    return f"merge_method: {method}\n{base}models:\n{models}dtype: float32\n"


def measure(argv: list[str], env=None) -> dict:
    """Run argv; wall seconds, ru_maxrss and the peak of RssAnon sampled every 10 ms."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    peak = [0]
    done = threading.Event()

    def sample():  # never reaps the child (os.wait4 below does, for its rusage)
        path = f"/proc/{proc.pid}/status"
        while not done.is_set():
            try:
                with open(path) as handle:
                    for line in handle:
                        if line.startswith("RssAnon:"):
                            peak[0] = max(peak[0], int(line.split()[1]) * 1024)
            except OSError:
                return
            time.sleep(0.01)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    done.set()
    proc.returncode = os.waitstatus_to_exitcode(status)
    output = proc.stdout.read().decode(errors="replace")
    thread.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({proc.returncode}):\n{output[-3000:]}")
    return {"wall_s": wall, "maxrss": usage.ru_maxrss * 1024, "rss_anon": peak[0]}


def tensors(path: str):
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        weight_map = json.load(open(index_path))["weight_map"]
    else:  # one file, no index
        with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as handle:
            weight_map = {name: "model.safetensors" for name in handle.keys()}
    handles = {}
    for name, file in sorted(weight_map.items()):
        if file not in handles:
            handles[file] = safe_open(os.path.join(path, file), framework="pt")
        yield name, handles[file].get_tensor(name)


def compare(method: str, ours: str, theirs: str, base: str) -> str:
    theirs_map = dict(tensors(theirs))
    if method.startswith("dare"):
        base_map = dict(tensors(base))
        changed_ours = changed_theirs = total = 0
        for name, tensor in tensors(ours):
            if name.endswith("norm.weight"):
                continue
            changed_ours += int((tensor != base_map[name]).sum())
            changed_theirs += int((theirs_map[name] != base_map[name]).sum())
            total += tensor.numel()
        return f"changed {changed_ours / total:.4f} vs {changed_theirs / total:.4f}"
    worst = 0.0
    for name, tensor in tensors(ours):
        worst = max(worst, float((tensor.double() - theirs_map[name].double()).abs().max()))
    return f"max |diff| {worst:.1e}" + ("" if worst <= 1e-6 else "  (> 1e-6)")


def _parameter_count(size: str) -> int:
    """Parameters of the Llama config SIZES[size] (untied head), counted without building it."""
    c = SIZES[size]
    h, i, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    return 2 * vocab * h + layers * (4 * h * h + 3 * h * i + 2 * h) + h


def _check_free_space(root: str, size: str) -> None:
    """Refuse to start when the disk cannot hold three inputs and two outputs (fp32) with 10% to spare."""
    need = int(_parameter_count(size) * 4 * 5 * 1.1)
    free = shutil.disk_usage(root).free
    if free < need:
        raise SystemExit(f"benchmarks/merge.py --size {size} needs {need / 2**30:.1f} GiB free in {root}, "
                         f"has {free / 2**30:.1f} GiB (pick another --workdir)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mergekit", default="/work/wt/mergekit-venv/bin/mergekit-yaml")
    parser.add_argument("--size", choices=sorted(SIZES), default="70m")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    root = args.workdir or tempfile.mkdtemp(prefix="merge_bench_")
    os.makedirs(root, exist_ok=True)
    _check_free_space(root, args.size)
    rows = []
    try:
        dirs = build(root, args.size)
        print(f"models: 3 x {dirs['params'] / 1e6:.0f}M params (fp32) in {root}", flush=True)
        env = dict(os.environ, PYTHONPATH=ROOT)
        for method in args.methods.split(","):
            config = os.path.join(root, f"{method}.yml")
            with open(config, "w") as handle:
                handle.write(yaml_for(method, dirs))
            ours, theirs = os.path.join(root, f"zt_{method}"), os.path.join(root, f"mk_{method}")
            zt = measure([sys.executable, "-m", "zerotrain.cli", "merge", config, ours], env=env)
            mk = measure([args.mergekit, config, theirs, "--out-shard-size", "5B"])
            agreement = compare(method, ours, theirs, dirs["base"])
            rows.append({"method": method, "zerotrain": zt, "mergekit": mk, "agreement": agreement})
            print(f"{method:16s} zt {zt['wall_s']:6.1f}s  mk {mk['wall_s']:6.1f}s  time x{zt['wall_s'] / mk['wall_s']:.2f}"
                  f"  | RssAnon zt {zt['rss_anon'] / 2**20:6.0f} MiB  mk {mk['rss_anon'] / 2**20:6.0f} MiB "
                  f"x{zt['rss_anon'] / mk['rss_anon']:.2f}  | maxrss zt {zt['maxrss'] / 2**20:6.0f}  "
                  f"mk {mk['maxrss'] / 2**20:6.0f} x{zt['maxrss'] / mk['maxrss']:.2f}  | {agreement}", flush=True)
            shutil.rmtree(ours)
            shutil.rmtree(theirs)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"size": args.size, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
