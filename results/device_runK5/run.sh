#!/usr/bin/env bash
# Run K5: the attention trigger back at the kernel start (run J2's table), PDL for attention calls
# reading at most 64 MiB of K/V (fdpp.launch.PDL_ATTENTION_MAX_BYTES) and for flat_gemm, the
# model-step ops as fdpp kernels, the cupy-driver launcher: the PDL / host / model GPU tests, the
# model step against the PyTorch reference (and with FDPP_PDL=gemm), the llama3-8b B = 1, 8 and
# llama3-70b TP-8 sweeps with cuDNN, flash and FlashInfer, the eager host cost.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-290}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resK5; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
echo "tests $(date -u +%T)"; timeout $(left 75) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_pdl.py \
  tests/test_gpu_host.py tests/test_gpu_model.py > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head
echo "e2e $(date -u +%T)"; timeout $(left 50) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k,128k --batch 1 \
  --kv fp16,fp8,int4 --no-breakdown --out $R/e2e_llama3-8b_b1_h200.csv > $R/e2e.log 2>&1; tail -7 $R/e2e.log
echo "e2e gemm-only $(date -u +%T)"; FDPP_PDL=gemm timeout $(left 20) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k \
  --batch 1 --kv fp16 --impls fdpp --no-breakdown --out $R/e2e_pdl_gemm.csv > $R/e2e_pdl_gemm.log 2>&1
echo "  $(grep -oE 'N=[0-9]+ +ITL +[0-9.]+' $R/e2e_pdl_gemm.log | tr -s ' ' | tr '\n' ' ')"
echo "bench8b $(date -u +%T)"; timeout $(left 45) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 1k,4k,16k,64k \
  --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-8b_h200.csv > $R/bench8b.log 2>&1
grep -A7 "B=1  time_us" $R/bench8b.log | head -8; grep -A7 "B=8  time_us" $R/bench8b.log | head -8
echo "bench70b $(date -u +%T)"; timeout $(left 25) python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-70b-tp8_h200.csv > $R/bench70b.log 2>&1
grep -A8 "B=1  time_us" $R/bench70b.log | head -9
echo "eager $(date -u +%T)"; timeout $(left 45) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k \
  --impls eager --out $R/eager_llama3-8b_h200.csv > $R/eager.log 2>&1; grep -A14 "B=1  time_us" $R/eager.log | head -14
echo "done $(date -u +%T)"
tar czf $OUT/resK5.tgz -C /tmp resK5
