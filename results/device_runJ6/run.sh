#!/usr/bin/env bash
# Run J6: the shipped defaults after run J5 (PDL for flat_gemm; attention launched plainly unless
# FDPP_PDL=all): the PDL / GEMM / attention GPU tests, the sweeps with cuDNN, flash and FlashInfer
# (llama3-8b contiguous and paged, llama3-70b TP-8, FP8, INT4), the GEMM bench on the shipped GEMM
# table (J3's tune with the cuBLAS margin applied), the end-to-end step, the eager host cost.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-330}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resJ6; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
echo "tests $(date -u +%T)"; timeout $(left 60) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_pdl.py \
  tests/test_gemm.py tests/test_gpu_attention.py tests/test_gpu_model.py > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head
echo "bench8b $(date -u +%T)"; timeout $(left 75) python3 -m fdpp.bench --model llama3-8b --batch 1,8,64 --seqlens 1k,4k,16k,64k \
  --page-size 0,1,16 --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-8b_h200.csv > $R/bench8b.log 2>&1
echo "bench70b $(date -u +%T)"; timeout $(left 25) python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-70b-tp8_h200.csv > $R/bench70b.log 2>&1
echo "bench fp8 $(date -u +%T)"; timeout $(left 45) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --page-size 0,16,64 --kv-dtype fp8_e4m3 --impls fdpp,floor,flashinfer --out $R/attn_fp8_llama3-8b_h200.csv > $R/bench_fp8.log 2>&1
echo "bench int4 $(date -u +%T)"; timeout $(left 25) python3 -m fdpp.bench --model llama3-8b --batch 1,8 \
  --seqlens 4k,16k,64k --page-size 0,16,64 --kv-dtype int4 --out $R/attn_int4_llama3-8b_h200.csv > $R/bench_int4.log 2>&1
echo "gemm $(date -u +%T)"; timeout $(left 30) python3 -m fdpp.bench gemm --model llama3-8b --m 1,2,4,8,16 --repeats 7 --plot \
  --out $R/gemm_llama3-8b_h200.csv > $R/gemm.log 2>&1; grep -A24 "^layer" $R/gemm.log | head -26
echo "e2e $(date -u +%T)"; timeout $(left 50) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k,128k --batch 1 \
  --kv fp16,fp8,int4 --no-breakdown --out $R/e2e_llama3-8b_b1_h200.csv > $R/e2e.log 2>&1; tail -6 $R/e2e.log
echo "eager $(date -u +%T)"; timeout $(left 20) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k \
  --impls eager --out $R/eager_llama3-8b_h200.csv > $R/eager.log 2>&1; grep -E "eager|plan" $R/eager.log | head -8
echo "done $(date -u +%T)"
tar czf $OUT/resJ6.tgz -C /tmp resJ6
