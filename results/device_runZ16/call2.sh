#!/usr/bin/env bash
# Run Z16, call 2 (the warm machine of call 1): the whole GPU suite (scripts/device_run.sh test: one
# worker per 17 GiB, at most 8) on this tree, then, on an H200 only, issue 15's headline points again
# (llama3-8b and the llama3-70b TP-8 share, fp16, B = 1, with cuDNN, flash and FlashInfer in the same
# process).
set -uo pipefail
R=/tmp/resZ16b; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
TEST_TIMEOUT=330 OUT=$R bash scripts/device_run.sh test > $R/test_step.log 2>&1; echo "test step rc $?" >> $R/test_step.log
tail -5 $R/pytest_gpu.log; cp $R/*.txt $R/*.log $OUT/ 2>/dev/null
if grep -q H200 $R/gpu.txt; then
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
  timeout 100 python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k,4k,16k \
    --out $R/attn_llama3-8b_b1.csv > $R/bench_8b.log 2>&1; tail -12 $R/bench_8b.log
  timeout 130 python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k..256k \
    --out $R/attn_llama3-70b-tp8_b1.csv > $R/bench_70b.log 2>&1; tail -20 $R/bench_70b.log
  cp $R/*.csv $R/*.log $OUT/ 2>/dev/null
fi
echo "done $(date -u +%T)"
