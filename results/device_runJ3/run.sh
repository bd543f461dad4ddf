#!/usr/bin/env bash
# Run J3: with the table re-tuned under PDL (run J2): the PDL GPU tests (one failed in J2 on a stale
# record of an earlier test in its worker), the GEMM table re-tuned (flat_gemm.cu changed) and
# benched against cuBLAS, the sweeps with cuDNN / flash / FlashInfer (llama3-8b contiguous and
# paged, llama3-70b TP-8, FP8, INT4), fdpp with FDPP_PDL=0 on the same table, the end-to-end step
# and the eager host cost.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-540}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resJ3; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
echo "tests $(date -u +%T)"; timeout $(left 60) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_pdl.py > $R/pytest_pdl.log 2>&1
grep -E "passed|failed" $R/pytest_pdl.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_pdl.log | head
echo "gemm $(date -u +%T)"; rm -f tuning/NVIDIA_H200_gemm.json
timeout $(left 170) python3 -m fdpp.bench gemm --model llama3-8b --m 1,2,4,8,16 --tune --table tuning/NVIDIA_H200_gemm.json \
  --repeats 7 --plot --out $R/gemm_llama3-8b_h200.csv > $R/gemm.log 2>&1; cp tuning/NVIDIA_H200_gemm.json $R/ 2>/dev/null
tail -30 $R/gemm.log
echo "bench8b $(date -u +%T)"; timeout $(left 90) python3 -m fdpp.bench --model llama3-8b --batch 1,8,64 --seqlens 1k,4k,16k,64k \
  --page-size 0,1,16 --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-8b_h200.csv > $R/bench8b.log 2>&1
echo "bench70b $(date -u +%T)"; timeout $(left 30) python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-70b-tp8_h200.csv > $R/bench70b.log 2>&1
echo "nopdl $(date -u +%T)"; FDPP_PDL=0 timeout $(left 30) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 1k,4k,16k,64k \
  --impls fdpp --out $R/attn_llama3-8b_nopdl_h200.csv > $R/bench8b_nopdl.log 2>&1
FDPP_PDL=0 timeout $(left 15) python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --impls fdpp --out $R/attn_llama3-70b-tp8_nopdl_h200.csv > $R/bench70b_nopdl.log 2>&1
echo "bench fp8 $(date -u +%T)"; timeout $(left 50) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --page-size 0,16,64 --kv-dtype fp8_e4m3 --impls fdpp,floor,flashinfer --out $R/attn_fp8_llama3-8b_h200.csv > $R/bench_fp8.log 2>&1
echo "bench int4 $(date -u +%T)"; timeout $(left 30) python3 -m fdpp.bench --model llama3-8b --batch 1,8 \
  --seqlens 4k,16k,64k --page-size 0,16,64 --kv-dtype int4 --out $R/attn_int4_llama3-8b_h200.csv > $R/bench_int4.log 2>&1
echo "e2e $(date -u +%T)"; timeout $(left 80) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k,128k --batch 1 \
  --kv fp16,fp8,int4 --no-breakdown --out $R/e2e_llama3-8b_b1_h200.csv > $R/e2e.log 2>&1
echo "eager $(date -u +%T)"; timeout $(left 30) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k \
  --impls eager --out $R/eager_llama3-8b_h200.csv > $R/eager.log 2>&1
echo "done $(date -u +%T)"
tar czf $OUT/resJ3.tgz -C /tmp resJ3
tail -22 $R/e2e.log; grep -E "eager|plan" $R/eager.log | head -12
