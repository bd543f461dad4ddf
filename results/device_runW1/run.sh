#!/usr/bin/env bash
# Run W1: flat_gemm's decode-step fusions (RMSNorm prologue `rms_eps`, residual epilogue `residual`) and the
# llama step that uses them (LlamaDecoder(fuse_norms=True), the default).
#   PART=a: re-tune the shipped GEMM table (flat_gemm.cu changed: its entries are stale), 16-bit and FP8 weights,
#           with the interleaved GEMM bench of each; the GEMM / fused-GEMM / model GPU tests on the new table;
#   PART=b: the whole GPU suite on the new table, then the model step: fused (fdpp) against unfused
#           (fdpp-unfused) and the PyTorch reference, with the per-op breakdown.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-560}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resW1${PART}; mkdir -p $R
pack() { tar czf $OUT/resW1${PART}.tgz -C /tmp resW1${PART}; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
if [ "$PART" = a ]; then
  export FDPP_TUNING_DIR=$R/tuning; mkdir -p $R/tuning
  echo "gemm tune (16-bit and FP8 weights) $(date -u +%T)"
  timeout $(left 330) python3 -m fdpp.bench gemm --model llama3-8b --m 1,2,4,8,16 --weights fp8 --tune \
    --out-dir $R/tuning --repeats 7 --out $R/gemm_llama3-8b_h200.csv > $R/gemm_tune.log 2>&1
  echo "rc=$?"; grep -A50 "^layer" $R/gemm_tune.log | head -50; pack
  ls -la $R/tuning
  echo "gemm + model tests $(date -u +%T)"
  timeout $(left 200) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests/test_gemm_fused.py \
    tests/test_gemm_fp8.py tests/test_gemm.py tests/test_gpu_model.py tests/test_gpu_host.py > $R/pytest_gemm.log 2>&1
  grep -E "passed|failed" $R/pytest_gemm.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gemm.log | head -20
else
  mkdir -p $R/tuning; cp tuning/NVIDIA_H200_gemm.json $R/tuning/ 2>/dev/null
  export FDPP_TUNING_DIR=$R/user_empty  # the shipped tables only (the new GEMM table is committed before this part)
  echo "tests $(date -u +%T)"; timeout $(left 300) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
  grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30; pack
  echo "e2e $(date -u +%T)"; timeout $(left 240) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k --batch 1,8 \
    --impls fdpp,fdpp-unfused,torch-ref --out $R/e2e.csv > $R/e2e.log 2>&1; tail -14 $R/e2e.log
fi
echo "done $(date -u +%T)"; pack
