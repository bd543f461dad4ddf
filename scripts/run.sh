#!/usr/bin/env bash
# Sets up a virtual environment and runs the main job.
#  - with a GPU: tunes the default model (llama3-8b, fp16: attention and its flat GEMMs) and benchmarks it against the memory
#    floor and PyTorch SDPA, writing results/*.csv and results/*.png;
#  - without one: says so, and runs the NumPy split-KV emulator instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${FDPP_VENV:-.venv}
MODEL=${FDPP_MODEL:-llama3-8b}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  EXTRA=$(bash scripts/cuda_extra.sh)  # CuPy's wheel for the driver's CUDA major version
  echo "fdpp: GPU found: installing .[$EXTRA,torch]"
  "$VENV/bin/python" -m pip install -q -e ".[$EXTRA,torch]"
  "$VENV/bin/python" -m fdpp.tune --model "$MODEL" --dtype fp16 --gemm
  "$VENV/bin/python" -m fdpp.bench --model "$MODEL" --batch 1,8 --out "results/bench_${MODEL}_local.csv"
  "$VENV/bin/python" -m fdpp.plot "results/bench_${MODEL}_local.csv" --out-dir results/
else
  echo "fdpp: no GPU found (nvidia-smi sees no device): running the NumPy split-KV emulator instead."
  "$VENV/bin/python" -m pip install -q -e .
  "$VENV/bin/python" -m fdpp.bench --emulator --model "$MODEL" --out "results/emulator_${MODEL}.csv"
fi
