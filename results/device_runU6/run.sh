#!/usr/bin/env bash
# Run U6: flat_tma's 16-bit and FP8-weight k-step loops written once (one generic step loop; the
# 16-bit variants' PTX differs from run U4's in register numbering only, see
# scripts/compare_ptx.py --gemm): the GEMM GPU tests and the GEMM table re-tuned (16-bit and FP8
# weights) on that source, with the bench.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-300}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resU6; mkdir -p $R
pack() { tar czf $OUT/resU6.tgz -C /tmp resU6; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "gemm tune $(date -u +%T)"; timeout $(left 150) python3 -m fdpp.bench gemm --model llama3-8b --m 1,2,4,8,16 --tune \
  --weights fp8 --table $R/NVIDIA_H200_gemm.json --repeats 7 --out $R/gemm_llama3-8b_h200.csv > $R/gemm.log 2>&1
grep -A60 "^layer" $R/gemm.log | head -50; pack
echo "gemm tests $(date -u +%T)"; FDPP_GEMM_TABLE=$R/NVIDIA_H200_gemm.json timeout $(left 120) python3 -m pytest -q -m gpu -n 8 \
  -p no:cacheprovider -rs tests/test_gemm_fp8.py tests/test_gemm.py tests/test_gpu_host.py > $R/pytest_gemm.log 2>&1
grep -E "passed|failed" $R/pytest_gemm.log | tail -1; grep -E "^FAILED|^ERROR|^_____" $R/pytest_gemm.log | head -20
echo "done $(date -u +%T)"; pack
