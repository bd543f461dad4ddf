#!/usr/bin/env bash
# Run G2 (final): the whole GPU suite; the shipped table re-tuned (launch tie rule, any kernel
# change); the llama3-8b fp16 sweep and the llama3-70b TP-8 sweep with cuDNN, flash and FlashInfer;
# FP8 (and INT4 when built) sweeps; the eager host-cost bench and the host profile. One deadline.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-585}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resG2; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
INT4=${INT4:-0}
echo "tests $(date -u +%T)"; timeout $(left 150) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
echo "tune $(date -u +%T)"; rm -f tuning/NVIDIA_H200.json
timeout $(left 110) python3 -m fdpp.tune --model llama3-8b llama2-7b llama3-70b:8 --dtype fp16,bf16 --trials 16 \
  --out-dir tuning --results-dir $R/tune --no-plots > $R/tune.log 2>&1
timeout $(left 20) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --batch 64 --seqlens 1k,4k,16k,64k --trials 12 \
  --out-dir tuning --results-dir $R/tune_b64 --no-plots > $R/tune_b64.log 2>&1
timeout $(left 30) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --page-size 16 --batch 1,8,64 --seqlens 1k,4k,16k,64k \
  --trials 12 --out-dir tuning --results-dir $R/tune_paged --no-plots > $R/tune_paged.log 2>&1
timeout $(left 45) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype fp8_e4m3 --page-size 0,16,64 --batch 1,8 \
  --seqlens 4k,16k,64k --trials 16 --out-dir tuning --results-dir $R/tune_fp8 --no-plots > $R/tune_fp8.log 2>&1
if [ "$INT4" = 1 ]; then timeout $(left 30) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype int4 --page-size 0,16 \
  --batch 1,8 --seqlens 4k,16k,64k --trials 12 --out-dir tuning --results-dir $R/tune_int4 --no-plots > $R/tune_int4.log 2>&1; fi
cp tuning/NVIDIA_H200.json $R/; tail -n1 $R/tune*.log
echo "bench8b $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench --model llama3-8b --batch 1,8,64 --seqlens 1k,4k,16k,64k \
  --page-size 0,16 --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-8b_h200.csv > $R/bench8b.log 2>&1
echo "bench70b $(date -u +%T)"; timeout $(left 30) python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-70b-tp8_h200.csv > $R/bench70b.log 2>&1
echo "eager $(date -u +%T)"; timeout $(left 45) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k \
  --impls eager --out $R/eager_llama3-8b_h200.csv > $R/eager.log 2>&1
timeout $(left 30) python3 -m fdpp.bench gemm --eager --model llama3-8b --out $R/gemm_eager_h200.csv > $R/gemm_eager.log 2>&1
timeout $(left 50) python3 scripts/host_profile.py --profile-calls 5000 --out $R/host_profile_h200.csv > $R/host_profile.log 2>&1
echo "bench fp8 $(date -u +%T)"; timeout $(left 45) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --page-size 0,16,64 --kv-dtype fp8_e4m3 --impls fdpp,floor,flashinfer --out $R/attn_fp8_llama3-8b_h200.csv > $R/bench_fp8.log 2>&1
if [ "$INT4" = 1 ]; then echo "bench int4 $(date -u +%T)"; timeout $(left 40) python3 -m fdpp.bench --model llama3-8b --batch 1,8 \
  --seqlens 4k,16k,64k --page-size 0,16,64 --kv-dtype int4 --out $R/attn_int4_llama3-8b_h200.csv > $R/bench_int4.log 2>&1; fi
echo "bench HND $(date -u +%T)"; timeout $(left 25) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 16k,64k --kv-layout HND \
  --impls fdpp,floor,torch-cudnn,flashinfer --out $R/attn_hnd_llama3-8b_h200.csv > $R/bench_hnd.log 2>&1
echo "done $(date -u +%T)"
tar czf $OUT/resG2.tgz -C /tmp resG2
grep -E "eager|plan" $R/eager.log | head -12; grep -E "fdpp|torch" $R/gemm_eager.log | tail -4
tail -n 30 $R/bench_int4.log 2>/dev/null; grep -A6 "B=1  time_us" $R/bench_hnd.log
for f in bench8b bench70b bench_fp8; do [ -f $R/$f.log ] && grep -A12 "B=1  time_us" $R/$f.log | head -14; done
