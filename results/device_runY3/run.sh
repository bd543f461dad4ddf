#!/usr/bin/env bash
# Run Y3 (an H100 80GB HBM3): a shipped table for the H100. Run Y2 showed that an H100 without a
# table runs the heuristic, 1.4 x slower than a tuned plan at llama3-8b B = 1, 1k (8.1 against 5.8
# us) and slower than cuDNN there. Tunes the H200 table's head configurations (llama3-8b, llama2-7b,
# llama3-70b TP 8; fp16 and bf16; B = 1, 8; N 1k..256k) with the same search, then llama3-8b's
# FP8 KV and pages of 16, then benches the shipped models with the new table against the floor and
# the peers, then tunes llama3-8b's flat GEMMs (fp16, M = 1..16) if time is left.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-570}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resY3; mkdir -p $R/tuning
pack() { tar czf $OUT/resY3.tgz -C /tmp resY3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache FDPP_TUNING_DIR=$R/tuning
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
grep -q "H100" $R/gpu.txt || { echo "not an H100: nothing run"; exit 0; }
echo "tune $(date -u +%T)"
timeout $(left 300) python3 -m fdpp.tune --model llama3-8b llama2-7b llama3-70b:8 --dtype fp16,bf16 --batch 1,8 \
  --max-minutes 4.2 --seed 11 --out-dir $R/tuning --results-dir $R/tune --no-plots > $R/tune.log 2>&1
grep "fdpp.tune:" $R/tune.log | tail -3; pack
timeout $(left 110) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype fp8_e4m3 --page-size 0,16 --seqlens 4k,16k,64k \
  --batch 1,8 --max-minutes 1.4 --seed 11 --out-dir $R/tuning --results-dir $R/tune_fp8 --no-plots > $R/tune_fp8.log 2>&1
grep "fdpp.tune:" $R/tune_fp8.log | tail -2; pack
echo "bench $(date -u +%T)"
I="fdpp,floor,torch-cudnn,torch-flash,flashinfer"
timeout $(left 100) python3 -m fdpp.bench attn --model llama3-8b --batch 1,8 --impls $I \
  --out $R/attn_llama3-8b_fp16_nvidia-h100.csv > $R/bench8b.log 2>&1
grep -A7 "time_us" $R/bench8b.log; pack
timeout $(left 40) python3 -m fdpp.bench attn --model llama3-70b --tp 8 --batch 1 --impls $I \
  --out $R/attn_llama3-70b-tp8_fp16_nvidia-h100.csv > $R/bench70b.log 2>&1
grep -A7 "time_us" $R/bench70b.log; pack
echo "gemm $(date -u +%T)"
timeout $(left 150) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --seqlens 1k --batch 1 --skip-tuned --gemm \
  --out-dir $R/tuning --results-dir $R/tune_gemm --no-plots > $R/tune_gemm.log 2>&1
grep "fdpp.tune\|gemm" $R/tune_gemm.log | tail -4
ls -la $R/tuning; echo "done $(date -u +%T)"; pack
