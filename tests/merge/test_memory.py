"""The streaming bound: a merge of models larger than --max-memory grows anonymous memory (RssAnon) by
less than the cap. Measured in a fresh subprocess by a thread sampling /proc/self/status; the pages of
memory-mapped safetensors files are file-backed (RssFile), not the tool's, and are not counted."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux)")

TENSORS, ROWS, COLS = 24, 1024, 1024          # 24 x 4 MiB fp32 = 96 MiB per model
CAP = 80 << 20  # each input (96 MiB) is larger; the tool's own bound for this merge is (3 inputs + 13) x 4 MiB
#                = 64 MiB, and the interpreter's own allocations come on top of it (measured 66-69 MiB)

_CHILD = r"""
import json, sys, threading, time
from safetensors.torch import load_file
from zerotrain.merge import ModelSpec, Recipe, merge

def rss_anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

peak, stop = [0], [False]
def sample():
    while not stop[0]:
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.0005)

a, b, base, out, cap = sys.argv[1:6]
baseline = rss_anon()
thread = threading.Thread(target=sample, daemon=True)
thread.start()
merge(Recipe("ties", [ModelSpec(a), ModelSpec(b)], base=base, params={"density": 0.5}, max_memory=int(cap)), out)
stop[0] = True
thread.join()
merged_peak = peak[0]
# the same measure catches a tool that holds a model: loading one model's file whole
whole = {k: v.clone() for k, v in load_file(a + "/model-00001-of-00001.safetensors").items()}
loaded = rss_anon() - baseline
print(json.dumps({"baseline": baseline, "peak": merged_peak, "whole_model_growth": loaded}))
"""


def _model(path, seed: int) -> str:
    os.makedirs(path)
    g = torch.Generator().manual_seed(seed)
    tensors = {f"model.layers.{i}.w.weight": torch.randn(ROWS, COLS, generator=g) for i in range(TENSORS)}
    save_file(tensors, os.path.join(path, "model-00001-of-00001.safetensors"))
    weight_map = {name: "model-00001-of-00001.safetensors" for name in tensors}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {"total_size": TENSORS * ROWS * COLS * 4}, "weight_map": weight_map}, handle)
    return str(path)


def test_rss_anon_growth_stays_below_max_memory(tmp_path):
    dirs = [_model(tmp_path / name, seed) for seed, name in enumerate(("base", "a", "b"))]
    assert TENSORS * ROWS * COLS * 4 > CAP  # each input alone is larger than the cap
    out = str(tmp_path / "out")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", _CHILD, dirs[1], dirs[2], dirs[0], out, str(CAP)],
                            capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    growth = report["peak"] - report["baseline"]
    assert 0 < growth < CAP, report
    assert report["whole_model_growth"] > CAP, report  # the measurement sees a whole model when one is held
    assert os.path.getsize(os.path.join(out, "model-00001-of-00001.safetensors")) > TENSORS * ROWS * COLS * 4


def test_max_memory_below_one_tensor_is_refused(tmp_path):
    from zerotrain.merge import MergeError, ModelSpec, Recipe, merge

    dirs = [_model(tmp_path / name, seed) for seed, name in enumerate(("base", "a"))]
    with pytest.raises(MergeError, match=r"model\.layers\.0\.w\.weight.*--max-memory"):
        merge(Recipe("task_arithmetic", [ModelSpec(dirs[1])], base=dirs[0], max_memory=8 << 20),
              str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")
