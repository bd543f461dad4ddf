#!/usr/bin/env bash
# Run Z17, call 2. On an H200: run Z14's never-run call 4, FP8 E4M3's 18 llama3-8b entries re-tuned
# with 40 trials into a copy of the H200 table, then the bench of shipped against re-tuned, into resZ17b.
# Then, here: PYTHONPATH=. python3 results/device_runZ15/adopt_fp8.py results/device_runZ17/out/resZ17b tuning/NVIDIA_H200.json
# On another card: compute-sanitizer's memcheck and initcheck over the quantizer family (quantize_kv,
# the paged quantizing append, dequantizers: the kernels whose float32 arithmetic became inline PTX), into resZ17c.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  RES_NAME=resZ17b bash results/device_runZ14/call4.sh
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD CUPY_CACHE_DIR=$PWD/.cupy_cache PYTHON=python3
  mkdir -p /tmp/resZ17c; nvidia-smi --query-gpu=name,driver_version --format=csv > /tmp/resZ17c/gpu.txt
  OUT=/tmp/resZ17c TOOLS="memcheck initcheck" FAMILIES=quantized TOOL_TIMEOUT=130 bash scripts/sanitize.sh
  echo "sanitize rc $?"; cp /tmp/resZ17c/* $OUT/; echo "done $(date -u +%T)"
fi
