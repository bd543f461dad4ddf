#!/usr/bin/env bash
# Run F1 (final): the whole GPU suite (attention, FP8, paged, host, merge, quantizers, model, HF,
# distributed on one GPU); the shipped table re-tuned (fp16/bf16 contiguous for llama3-8b,
# llama2-7b, llama3-70b TP-8; B=64; pages of 16; FP8 E4M3 contiguous and pages of 16/64); the
# llama3-8b fp16 sweep and the llama3-70b TP-8 sweep with cuDNN, flash and FlashInfer; the FP8
# sweep with FlashInfer's FP8 decode; the end-to-end decode step (llama3-8b, B=1). One deadline.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-585}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resF1; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "tests $(date -u +%T)"; timeout $(left 170) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
echo "tune $(date -u +%T)"; rm -f tuning/NVIDIA_H200.json
timeout $(left 110) python3 -m fdpp.tune --model llama3-8b llama2-7b llama3-70b:8 --dtype fp16,bf16 --trials 16 \
  --out-dir tuning --results-dir $R/tune --no-plots > $R/tune.log 2>&1
timeout $(left 20) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --batch 64 --seqlens 1k,4k,16k,64k --trials 12 \
  --out-dir tuning --results-dir $R/tune_b64 --no-plots > $R/tune_b64.log 2>&1
timeout $(left 30) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --page-size 16 --batch 1,8,64 --seqlens 1k,4k,16k,64k \
  --trials 12 --out-dir tuning --results-dir $R/tune_paged --no-plots > $R/tune_paged.log 2>&1
timeout $(left 50) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype fp8_e4m3 --page-size 0,16,64 --batch 1,8 \
  --seqlens 4k,16k,64k --trials 20 --out-dir tuning --results-dir $R/tune_fp8 --no-plots > $R/tune_fp8.log 2>&1
cp tuning/NVIDIA_H200.json $R/; tail -1 $R/tune.log $R/tune_b64.log $R/tune_paged.log $R/tune_fp8.log
echo "bench8b $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench --model llama3-8b --batch 1,8,64 --seqlens 1k,4k,16k,64k \
  --page-size 0,16 --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-8b_h200.csv > $R/bench8b.log 2>&1
echo "bench70b $(date -u +%T)"; timeout $(left 30) python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-70b-tp8_h200.csv > $R/bench70b.log 2>&1
echo "bench fp8 $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --page-size 0,16,64 --kv-dtype fp8_e4m3 --impls fdpp,floor,flashinfer --out $R/attn_fp8_llama3-8b_h200.csv > $R/bench_fp8.log 2>&1
echo "e2e $(date -u +%T)"; timeout $(left 200) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k,128k --batch 1 \
  --kv fp16,fp8 --no-breakdown --out $R/e2e_llama3-8b_b1_h200.csv > $R/e2e.log 2>&1
echo "done $(date -u +%T)"
tar czf $OUT/resF1.tgz -C /tmp resF1
for f in bench8b bench70b bench_fp8; do grep -A12 "B=1  time_us" $R/$f.log | head -14; done; tail -25 $R/e2e.log
