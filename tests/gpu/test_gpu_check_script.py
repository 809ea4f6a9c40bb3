"""benchmarks/gpu_check.sh, the GPU session's one command: without a CUDA device it says so and exits 0 at once
(CI runs it so), writing nothing; the benchmark's FLOP count matches the model it builds.

The dry run of everything else (`bash benchmarks/gpu_check.sh --device cpu --tiny`, a few minutes) is run by hand
before a GPU session; benchmarks/RESULTS_gpu.md says how.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a CUDA device the script runs the whole check")
def test_without_cuda_the_check_says_so_and_exits_0(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    start = time.monotonic()
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout and "exit 0" in done.stdout, done.stdout
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written
    assert time.monotonic() - start < 60  # seconds (importing torch), not a run


def test_benchmark_counts_the_parameters_of_the_model_it_builds():
    import transformers

    spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "benchmarks" / "gpu_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for name in ("tiny", "llama05b"):
        fields, _, seq, _, _ = bench.SIZES[name]
        config = bench._llama_config(fields, seq)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        assert bench._n_params(config) == sum(p.numel() for p in model.parameters()), name
        # model FLOPs: 6 x (every weight but the input embedding) + attention
        weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
        attention = 12 * config.num_hidden_layers * config.hidden_size * seq
        assert bench._model_flops_per_token(config, seq) == 6 * weights + attention, name
    assert 0.95e9 < bench._n_params(bench._llama_config(*bench.SIZES["llama1b"][:1], 1024)) < 1.1e9
