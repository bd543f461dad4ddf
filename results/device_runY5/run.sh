#!/usr/bin/env bash
# Run Y5 (an H100 80GB HBM3): the llama3-8b decode step on the shipped H100 tables (run Y3 + Y4),
# fdpp (paged fp16 KV, pages of 16) against the graph-captured torch reference (cuBLAS + cuDNN SDPA).
set -uo pipefail
R=/tmp/resY5; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
timeout 280 python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k --batch 1 --impls fdpp,torch-ref \
  --out $R/e2e_llama3-8b_h100.csv > $R/e2e.log 2>&1
grep "ITL" $R/e2e.log; tail -3 $R/e2e.log
tar czf $OUT/resY5.tgz -C /tmp resY5
