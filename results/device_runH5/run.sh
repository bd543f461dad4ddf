#!/usr/bin/env bash
# Run H5: the 4 buckets H4's re-tune ran out of time for (--skip-tuned), then the sweeps with the
# re-tuned table: llama3-8b fp16 (contiguous, pages of 1 and 16) and llama3-70b TP-8 with cuDNN,
# flash and FlashInfer; FP8 and INT4 sweeps; the end-to-end step; the eager host-cost bench.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-585}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resH5; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "fill $(date -u +%T)"
timeout $(left 25) python3 -m fdpp.tune --model llama3-70b:8 --dtype bf16 --seqlens 256k --batch 1,8 --trials 16 --skip-tuned \
  --out-dir tuning --results-dir $R/tune_fill70 --no-plots > $R/tune_fill70.log 2>&1
timeout $(left 20) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype fp8_e4m3 --page-size 64 --batch 8 --seqlens 64k \
  --trials 16 --skip-tuned --out-dir tuning --results-dir $R/tune_fillfp8 --no-plots > $R/tune_fillfp8.log 2>&1
timeout $(left 20) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype int4 --page-size 16 --batch 8 --seqlens 64k \
  --trials 12 --skip-tuned --out-dir tuning --results-dir $R/tune_fillint4 --no-plots > $R/tune_fillint4.log 2>&1
cp tuning/NVIDIA_H200.json $R/; tail -qn1 $R/tune_fill*.log
echo "bench8b $(date -u +%T)"; timeout $(left 110) python3 -m fdpp.bench --model llama3-8b --batch 1,8,64 --seqlens 1k,4k,16k,64k \
  --page-size 0,1,16 --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-8b_h200.csv > $R/bench8b.log 2>&1
echo "bench70b $(date -u +%T)"; timeout $(left 40) python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-70b-tp8_h200.csv > $R/bench70b.log 2>&1
echo "bench fp8 $(date -u +%T)"; timeout $(left 50) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --page-size 0,16,64 --kv-dtype fp8_e4m3 --impls fdpp,floor,flashinfer --out $R/attn_fp8_llama3-8b_h200.csv > $R/bench_fp8.log 2>&1
echo "bench int4 $(date -u +%T)"; timeout $(left 40) python3 -m fdpp.bench --model llama3-8b --batch 1,8 \
  --seqlens 4k,16k,64k --page-size 0,16,64 --kv-dtype int4 --out $R/attn_int4_llama3-8b_h200.csv > $R/bench_int4.log 2>&1
echo "e2e $(date -u +%T)"; timeout $(left 120) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k,128k --batch 1 \
  --kv fp16,fp8,int4 --no-breakdown --out $R/e2e_llama3-8b_b1_h200.csv > $R/e2e.log 2>&1
echo "eager $(date -u +%T)"; timeout $(left 45) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k \
  --impls eager --out $R/eager_llama3-8b_h200.csv > $R/eager.log 2>&1
echo "done $(date -u +%T)"
tar czf $OUT/resH5.tgz -C /tmp resH5
for f in bench8b bench70b bench_fp8 bench_int4; do [ -f $R/$f.log ] && grep -A14 "B=1  time_us" $R/$f.log | head -16; done
tail -22 $R/e2e.log; grep -E "eager|plan" $R/eager.log | head -12
