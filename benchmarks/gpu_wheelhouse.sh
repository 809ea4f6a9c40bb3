#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels benchmarks/gpu_check.sh installs on a GPU machine that has no network.
#
# That machine's python3 is 3.12 with a CUDA torch of its own (2.11 at last report) and, among our needs,
# numpy, safetensors, psutil, rich, pytest, pytest-timeout, hypothesis, accelerate, tokenizers, huggingface-hub,
# pyyaml and regex already (/work/.library/device/KINDS.md). It lacks pydantic (+ its core, annotated-types,
# typing-inspection) and isal, and has an older transformers (5.17) and peft: we carry the versions the CPU suite
# runs, so both machines run the same code (and regex, whose version transformers checks at import). DeepSpeed (for the HF Trainer + DeepSpeed column) is built here as a
# pure-Python wheel with no compiled ops (DS_BUILD_OPS=0; the benchmark uses torch's Adam) plus hjson.
# torch is never carried: the machine's CUDA build is the one under test.
#
# Usage (in the repository root, on a machine with pip and network): bash benchmarks/gpu_wheelhouse.sh
# Then: the run tool's `carry` names ".whl" (see benchmarks/RESULTS_gpu.md). Total stays well under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-/work/main/.venv/bin/python}
OUT=${WHEEL_DIR:-.whl}                  # another folder and Python: a simulation of the machine here (3.11)
TARGET_PYTHON=${WHEEL_PYTHON:-3.12}     # the GPU machine's python3
rm -rf "$OUT" && mkdir -p "$OUT"
PLATFORM=(--python-version "$TARGET_PYTHON" --implementation cp --only-binary=:all: --no-deps
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# Pin to what this checkout's CPU suite runs (pip show in the dev venv), falling back to known-good versions.
version() { "$PY" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p' || true; }
pin() { local v; v=$(version "$1"); echo "$1==${v:-$2}"; }
WHEELS=(
  "$(pin pydantic 2.14.4)" "$(pin pydantic_core 2.50.5)" "$(pin annotated-types 0.8.0)"
  "$(pin typing-inspection 0.4.5)" "$(pin typing_extensions 4.16.0)"
  "$(pin isal 1.9.1)"
  "$(pin transformers 5.24.0)" "$(pin peft 0.21.2)"
  "$(pin regex 2026.1.15)"  # transformers checks regex >= 2025.10.22 at import; the machine's may be older
  "$(pin hjson 3.1.0)"
)
"$PY" -m pip download -q "${PLATFORM[@]}" -d "$OUT" "${WHEELS[@]}"
# DeepSpeed publishes only a source archive: build it here without ops (pure Python, any platform).
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "$(pin deepspeed 0.19.8)"
ls -la "$OUT"
du -sh "$OUT"
total=$(du -sb "$OUT" | cut -f1)
if [ "$total" -gt $((40 << 20)) ]; then
  echo "gpu_wheelhouse: $OUT is $((total >> 20)) MiB; with the repository it must stay under 64 MiB" >&2
  exit 1
fi
