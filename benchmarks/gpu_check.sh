#!/usr/bin/env bash
# The GPU session's one command (benchmarks/gpu_check.py says what it does; benchmarks/RESULTS_gpu.md how to call
# it through the device tool). Without a CUDA device it says so and exits 0; `--device cpu --tiny` is the dry run.
cd "$(dirname "$0")/.." || exit 1
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
