#!/usr/bin/env bash
# Run Q10: the llama3-8b model step (B = 1) with the run-Q8 FP8 kernel and table, fp16 and FP8 KV
# (the other columns of the README's table are run M3's).
set -uo pipefail
R=/tmp/resQ10; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
timeout 150 python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k,128k --batch 1 \
  --kv fp16,fp8 --no-breakdown --out $R/e2e_llama3-8b_b1_h200.csv > $R/e2e.log 2>&1; tail -12 $R/e2e.log
tar czf $OUT/resQ10.tgz -C /tmp resQ10
