#!/usr/bin/env bash
# Run U1: FP8 weights in flat_gemm (W8A16, the bulk-copy kernel's w8 variants). Their GPU tests
# (and every GEMM / model / host-path GPU test, the kernel's 16-bit path having a new argument),
# then the GEMM table re-tuned (16-bit weights: flat_gemm.cu changed; FP8 weights: new entries) with
# the bench, the model step with FP8 weights against fp16 weights and the torch reference, and the
# whole GPU suite last.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-560}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resU1; mkdir -p $R
pack() { tar czf $OUT/resU1.tgz -C /tmp resU1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "gemm tests $(date -u +%T)"
timeout $(left 150) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests/test_gemm_fp8.py tests/test_gemm.py \
  tests/test_gpu_host.py tests/test_gpu_prefetch.py tests/test_gpu_model.py > $R/pytest_gemm.log 2>&1
grep -E "passed|failed" $R/pytest_gemm.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gemm.log | head -20; pack
echo "gemm tune $(date -u +%T)"; timeout $(left 150) python3 -m fdpp.bench gemm --model llama3-8b --m 1,2,4,8,16 --tune \
  --weights fp8 --table $R/NVIDIA_H200_gemm.json --repeats 7 --out $R/gemm_llama3-8b_h200.csv > $R/gemm.log 2>&1
grep -A60 "^layer" $R/gemm.log | head -50; pack
echo "e2e $(date -u +%T)"; FDPP_GEMM_TABLE=$R/NVIDIA_H200_gemm.json timeout $(left 120) python3 -m fdpp.bench e2e \
  --model llama3-8b --seqlens 4k,16k,64k --batch 1,8 --kv fp16 --impls fdpp,fdpp-w8,torch-ref \
  --out $R/e2e_w8.csv > $R/e2e_w8.log 2>&1; tail -12 $R/e2e_w8.log; pack
echo "tests $(date -u +%T)"; FDPP_GEMM_TABLE=$R/NVIDIA_H200_gemm.json timeout $(left 200) python3 -m pytest -q -m gpu -n 8 \
  -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
echo "done $(date -u +%T)"; pack
