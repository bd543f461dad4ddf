#!/usr/bin/env bash
# Run K3: the shipped defaults after run K2 (attention's PDL trigger after the KV loop, PDL for
# attention and flat_gemm, K2's re-tuned table, the model-step elementwise ops as fdpp kernels,
# the cupy-driver launcher): the sweeps with cuDNN, flash and FlashInfer (llama3-8b contiguous and
# paged, llama3-70b TP-8, FP8, INT4), the model step against the PyTorch reference (and with
# FDPP_PDL=gemm), its per-op breakdown, the eager host cost.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-400}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resK3; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "bench8b $(date -u +%T)"; timeout $(left 70) python3 -m fdpp.bench --model llama3-8b --batch 1,8,64 --seqlens 1k,4k,16k,64k \
  --page-size 0,16 --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-8b_h200.csv > $R/bench8b.log 2>&1
grep -A8 "B=1  time_us" $R/bench8b.log | head -9
echo "bench70b $(date -u +%T)"; timeout $(left 25) python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-70b-tp8_h200.csv > $R/bench70b.log 2>&1
grep -A8 "B=1  time_us" $R/bench70b.log | head -9
echo "bench fp8 $(date -u +%T)"; timeout $(left 45) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --page-size 0,16,64 --kv-dtype fp8_e4m3 --impls fdpp,floor,flashinfer --out $R/attn_fp8_llama3-8b_h200.csv > $R/bench_fp8.log 2>&1
echo "bench int4 $(date -u +%T)"; timeout $(left 25) python3 -m fdpp.bench --model llama3-8b --batch 1,8 \
  --seqlens 4k,16k,64k --page-size 0,16,64 --kv-dtype int4 --out $R/attn_int4_llama3-8b_h200.csv > $R/bench_int4.log 2>&1
echo "e2e $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k,128k --batch 1 \
  --kv fp16,fp8,int4 --no-breakdown --out $R/e2e_llama3-8b_b1_h200.csv > $R/e2e.log 2>&1; tail -8 $R/e2e.log
echo "e2e gemm-only $(date -u +%T)"; FDPP_PDL=gemm timeout $(left 25) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k --batch 1 \
  --kv fp16 --impls fdpp --no-breakdown --out $R/e2e_pdl_gemm.csv > $R/e2e_pdl_gemm.log 2>&1
echo "  $(grep -oE 'N=[0-9]+ +ITL +[0-9.]+' $R/e2e_pdl_gemm.log | tr -s ' ' | tr '\n' ' ')"
echo "e2e breakdown $(date -u +%T)"; timeout $(left 40) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,64k --batch 1 \
  --kv fp16 --impls fdpp,torch-ref --out $R/e2e_breakdown_h200.csv > $R/e2e_breakdown.log 2>&1
echo "eager $(date -u +%T)"; timeout $(left 50) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k \
  --impls eager --out $R/eager_llama3-8b_h200.csv > $R/eager.log 2>&1; grep -A14 "B=1  time_us" $R/eager.log | head -14
timeout $(left 25) python3 -m fdpp.bench gemm --eager --model llama3-8b --out $R/gemm_eager_h200.csv > $R/gemm_eager.log 2>&1
grep -E "fdpp|torch|cupy" $R/gemm_eager.log | tail -4
echo "done $(date -u +%T)"
tar czf $OUT/resK3.tgz -C /tmp resK3
