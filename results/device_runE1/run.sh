#!/usr/bin/env bash
# Run E1: the whole GPU test suite with the FP8 kernels; a small FP8 tune (llama3-8b heads) into
# its own table dir; FP8 and fp16 sweeps with FlashInfer at B 1, 8 x N 4k, 16k, 64k x page 0, 16, 64.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-560}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resE1; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "tests $(date -u +%T)"; timeout $(left 200) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
echo "tune $(date -u +%T)"; timeout $(left 150) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype fp8_e4m3 \
  --seqlens 4k,16k,64k --batch 1,8 --page-size 0,16,64 --trials 24 --out-dir $R/tune --results-dir $R/tune_results --no-plots > $R/tune.log 2>&1
tail -5 $R/tune.log
export FDPP_TUNING_DIR=$R/tune
echo "bench fp8 $(date -u +%T)"; timeout $(left 120) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --page-size 0,16,64 --kv-dtype fp8_e4m3 --impls fdpp,floor,flashinfer --out $R/attn_fp8_llama3-8b_h200.csv > $R/bench_fp8.log 2>&1
tail -30 $R/bench_fp8.log
echo "bench fp16 $(date -u +%T)"; timeout $(left 80) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --impls fdpp,floor,flashinfer,torch-cudnn --out $R/attn_fp16_llama3-8b_h200.csv > $R/bench_fp16.log 2>&1
tail -16 $R/bench_fp16.log
echo "done $(date -u +%T)"
tar czf $OUT/resE1.tgz -C /tmp resE1
