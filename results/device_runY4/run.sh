#!/usr/bin/env bash
# Run Y4 (an H100 80GB HBM3): the H100 table completed to the H200 table's bucket list (run M1's
# commands: llama3-8b at B = 64, pages of 16 at B = 1 / 8 / 64, FP8 E4M3 with pages of 64, INT4
# groups of 64 contiguous and with pages of 16), added to tuning/NVIDIA_H100_80GB_HBM3.json (run
# Y3's 72 entries kept: --skip-tuned), then the sweeps those buckets serve against the peers.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-575}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resY4; mkdir -p $R/tuning
pack() { tar czf $OUT/resY4.tgz -C /tmp resY4; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
grep -q "H100" $R/gpu.txt || { echo "not an H100: nothing run"; exit 0; }
cp tuning/NVIDIA_H100_80GB_HBM3.json $R/tuning/
T="--out-dir $R/tuning --no-plots --skip-tuned --seed 11"
echo "tune $(date -u +%T)"
timeout $(left 60) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --batch 64 --seqlens 1k,4k,16k,64k --trials 12 $T \
  --results-dir $R/tune_b64 > $R/tune_b64.log 2>&1
timeout $(left 70) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --page-size 16 --batch 1,8,64 --seqlens 1k,4k,16k,64k \
  --trials 12 $T --results-dir $R/tune_paged > $R/tune_paged.log 2>&1
timeout $(left 50) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype fp8_e4m3 --page-size 64 --batch 1,8 \
  --seqlens 4k,16k,64k --trials 16 $T --results-dir $R/tune_fp8 > $R/tune_fp8.log 2>&1
timeout $(left 70) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype int4 --page-size 0,16 \
  --batch 1,8 --seqlens 4k,16k,64k --trials 12 $T --results-dir $R/tune_int4 > $R/tune_int4.log 2>&1
for f in $R/tune*.log; do tr '\r' '\n' < $f | grep 'fdpp.tune:' | tail -1; done; pack
export FDPP_TUNING_DIR=$R/tuning
I="fdpp,floor,torch-cudnn,torch-flash,flashinfer"
echo "bench $(date -u +%T)"
timeout $(left 70) python3 -m fdpp.bench attn --model llama3-8b --batch 64 --seqlens 1k,4k,16k --impls $I \
  --out $R/attn_llama3-8b_b64_h100.csv > $R/bench_b64.log 2>&1
grep -A7 "time_us" $R/bench_b64.log | head -8; pack
timeout $(left 70) python3 -m fdpp.bench attn --model llama3-8b --batch 1,8 --seqlens 1k,4k,16k,64k --page-size 16 \
  --impls fdpp-paged,floor,flashinfer-paged --out $R/attn_paged_llama3-8b_h100.csv > $R/bench_paged.log 2>&1
grep -A6 "time_us" $R/bench_paged.log | head -14; pack
timeout $(left 80) python3 -m fdpp.bench attn --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k --kv-dtype fp8_e4m3 \
  --page-size 0,16,64 --impls fdpp,fdpp-paged,floor,flashinfer,flashinfer-paged --out $R/attn_fp8_llama3-8b_h100.csv > $R/bench_fp8.log 2>&1
grep -A8 "time_us" $R/bench_fp8.log | head -30; pack
timeout $(left 60) python3 -m fdpp.bench attn --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k --kv-dtype int4 --page-size 0,16 \
  --out $R/attn_int4_llama3-8b_h100.csv > $R/bench_int4.log 2>&1
grep -A8 "time_us" $R/bench_int4.log | head -30
echo "done $(date -u +%T)"; pack
