#!/usr/bin/env bash
# Run D1: GPU tests, then re-tune the contiguous fp16 entries (kernels changed: fused merge).
set -uo pipefail
END=$((SECONDS + ${BUDGET:-570}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/res; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $R/gpu.txt 2>&1
echo "tests $(date -u +%T)"; timeout $(left 200) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --maxfail=40 tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
echo "tune $(date -u +%T)"; timeout $(left 330) python3 -m fdpp.tune --model llama3-8b llama2-7b llama3-70b:8 --dtype fp16 \
  --trials 16 --out-dir tuning --results-dir $R/tune > $R/tune.log 2>&1
timeout $(left 60) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --batch 64 --seqlens 1k,4k,16k,64k \
  --trials 12 --out-dir tuning --results-dir $R/tune_b64 > $R/tune_b64.log 2>&1
cp tuning/NVIDIA_H200.json $R/
echo "done $(date -u +%T)"
tar czf $OUT/res.tgz -C /tmp res
tail -4 $R/tune.log; tail -2 $R/tune_b64.log
