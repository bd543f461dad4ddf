#!/usr/bin/env bash
# Run H11: the paged loader with one address per page run (kernels_cu/decode_split.cu): the paged
# GPU test files, the stale paged buckets re-tuned (--skip-tuned; contiguous entries were
# re-stamped after scripts/compare_ptx.py found their instructions unchanged), paged vs contiguous
# at B 1 and 8, then the end-to-end step if time is left. One deadline.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-195}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resH11; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
echo "tests $(date -u +%T)"; timeout $(left 75) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_paged.py \
  tests/test_hostile_gpu.py tests/test_gpu_fp8.py tests/test_gpu_int4.py tests/test_cache_decode.py > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -20
echo "tune $(date -u +%T)"
T="--model llama3-8b --dtype fp16 --skip-tuned --out-dir tuning --no-plots"
timeout $(left 30) python3 -m fdpp.tune $T --page-size 16 --batch 1,8,64 --seqlens 1k,4k,16k,64k --trials 12 \
  --results-dir $R/tune_paged > $R/tune_paged.log 2>&1
timeout $(left 35) python3 -m fdpp.tune $T --kv-dtype fp8_e4m3 --page-size 16,64 --batch 1,8 --seqlens 4k,16k,64k --trials 12 \
  --results-dir $R/tune_fp8 > $R/tune_fp8.log 2>&1
timeout $(left 20) python3 -m fdpp.tune $T --kv-dtype int4 --page-size 16 --batch 1,8 --seqlens 4k,16k,64k --trials 10 \
  --results-dir $R/tune_int4 > $R/tune_int4.log 2>&1
cp tuning/NVIDIA_H200.json $R/; tail -qn1 $R/tune*.log
echo "bench $(date -u +%T)"; timeout $(left 30) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --page-size 0,16 --impls fdpp,floor,flashinfer --out $R/attn_paged_llama3-8b_h200.csv > $R/bench_paged.log 2>&1
grep -A8 "time_us" $R/bench_paged.log | grep -E "time_us|^fdpp|^floor|^flashinfer"
echo "e2e $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k,128k --batch 1 \
  --kv fp16 --impls fdpp,torch-ref --no-breakdown --out $R/e2e_llama3-8b_b1_h200.csv > $R/e2e.log 2>&1; tail -7 $R/e2e.log
echo "done $(date -u +%T)"
tar czf $OUT/resH11.tgz -C /tmp resH11
