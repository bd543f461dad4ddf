#!/usr/bin/env bash
# Run V1: flat GEMM on the attention stack's engine (shared tables / dispatch / workspace / verify-then-time,
# no kernel change) and the interleaved (round-robin) GEMM bench.
#   PART=a: the GEMM, host-path, model, fused and PDL GPU tests (they exercise the shared scratch and the
#           forced plans), the GEMM bench on the shipped (converted) table with FP8 weights, a tune into a
#           scratch user dir, the model step;
#   PART=b: the whole GPU suite.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-560}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resV1${PART}; mkdir -p $R
pack() { tar czf $OUT/resV1${PART}.tgz -C /tmp resV1${PART}; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
export FDPP_TUNING_DIR=$R/user_empty  # the shipped tables only (no user layer)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
if [ "$PART" = a ]; then
  echo "gemm tests $(date -u +%T)"
  timeout $(left 170) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests/test_gemm_fp8.py tests/test_gemm.py \
    tests/test_gpu_host.py tests/test_gpu_model.py tests/test_gpu_fused.py tests/test_gpu_pdl.py > $R/pytest_first.log 2>&1
  grep -E "passed|failed" $R/pytest_first.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_first.log | head -20; pack
  echo "gemm bench $(date -u +%T)"
  timeout $(left 150) python3 -m fdpp.bench gemm --model llama3-8b --m 1,2,4,8,16 --weights fp8 --repeats 7 \
    --out $R/gemm_llama3-8b_h200.csv > $R/gemm.log 2>&1; grep -A50 "^layer" $R/gemm.log | head -45
  grep -i "fail\|error" $R/gemm.log | head -5; pack
  echo "gemm tune into a scratch dir $(date -u +%T)"
  timeout $(left 60) python3 -m fdpp.bench gemm --model llama3-8b --layers o --m 1,8 --weights fp8 --tune --out-dir $R/tuned \
    --repeats 5 --out $R/gemm_tuned.csv > $R/gemm_tuned.log 2>&1; grep -A10 "^layer" $R/gemm_tuned.log; ls $R/tuned; pack
  echo "e2e $(date -u +%T)"; timeout $(left 100) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,64k --batch 1 \
    --kv fp16,fp8 --impls fdpp,fdpp-w8,torch-ref --out $R/e2e.csv > $R/e2e.log 2>&1; tail -10 $R/e2e.log
else
  echo "tests $(date -u +%T)"; timeout $(left 540) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
  grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
fi
echo "done $(date -u +%T)"; pack
