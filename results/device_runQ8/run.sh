#!/usr/bin/env bash
# Run Q8: the VT FP8 kernel (run Q6) shipped: the whole GPU test suite; the 18 FP8 buckets re-tuned
# (--skip-tuned: the other 88 entries were re-stamped by scripts/compare_ptx.py, their PTX unchanged);
# the FP8 sweep with FlashInfer's FP8 decode and the floor, and fdpp fp16 beside it.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-540}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resQ8; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "tune $(date -u +%T)"; timeout $(left 200) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype fp8_e4m3 --page-size 0,16,64 \
  --batch 1,8 --seqlens 4k,16k,64k --trials 16 --out-dir tuning --no-plots --skip-tuned --results-dir $R/tune_fp8 > $R/tune_fp8.log 2>&1
cp tuning/NVIDIA_H200.json $R/; tr '\r' '\n' < $R/tune_fp8.log | grep 'fdpp.tune:' | tail -3
echo "tests $(date -u +%T)"; timeout $(left 170) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
echo "bench fp8 $(date -u +%T)"; timeout $(left 90) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --page-size 0,16,64 --kv-dtype fp8_e4m3 --impls fdpp,floor,flashinfer --out $R/attn_fp8_llama3-8b_h200.csv > $R/bench_fp8.log 2>&1
grep -A5 "time_us" $R/bench_fp8.log | head -60
echo "bench fp16 $(date -u +%T)"; timeout $(left 40) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --impls fdpp,floor --out $R/attn_fp16_llama3-8b_h200.csv > $R/bench_fp16.log 2>&1; grep -A5 "time_us" $R/bench_fp16.log | head -20
echo "done $(date -u +%T)"
tar czf $OUT/resQ8.tgz -C /tmp resQ8
