#!/usr/bin/env bash
# Run M2: the tree of run M1 and its table. The buckets M1's tune limits cut re-tuned with
# --skip-tuned (same commands); the eager host cost; the llama3-8b model step (fp16, FP8, INT4 KV)
# against the PyTorch reference; the FP8 / INT4 KV sweeps with FlashInfer's FP8 decode; the
# unified-max upper bound (scripts/probe_unified_max.py, exact vs --no-max kernels); the cluster
# family under compute-sanitizer's memcheck and racecheck.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-540}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resM2; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "fill $(date -u +%T)"; T="--out-dir tuning --no-plots --skip-tuned"
timeout $(left 90) python3 -m fdpp.tune --model llama3-8b llama2-7b llama3-70b:8 --dtype fp16,bf16 --trials 20 $T \
  --results-dir $R/tune_fill > $R/tune_fill.log 2>&1
timeout $(left 50) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype fp8_e4m3 --page-size 0,16,64 --batch 1,8 \
  --seqlens 4k,16k,64k --trials 16 $T --results-dir $R/tune_fill_fp8 > $R/tune_fill_fp8.log 2>&1
timeout $(left 30) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype int4 --page-size 0,16 \
  --batch 1,8 --seqlens 4k,16k,64k --trials 12 $T --results-dir $R/tune_fill_int4 > $R/tune_fill_int4.log 2>&1
cp tuning/NVIDIA_H200.json $R/; for f in $R/tune*.log; do echo "$(basename $f): $(tr '\r' '\n' < $f | grep 'fdpp.tune:' | tail -1)"; done
echo "eager $(date -u +%T)"; timeout $(left 45) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k \
  --impls eager --out $R/eager_llama3-8b_h200.csv > $R/eager.log 2>&1; grep -A14 "B=1  time_us" $R/eager.log | head -14
echo "e2e $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k,128k --batch 1 \
  --kv fp16,fp8,int4 --no-breakdown --out $R/e2e_llama3-8b_b1_h200.csv > $R/e2e.log 2>&1; tail -8 $R/e2e.log
echo "bench fp8 $(date -u +%T)"; timeout $(left 50) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --page-size 0,16,64 --kv-dtype fp8_e4m3 --impls fdpp,floor,flashinfer --out $R/attn_fp8_llama3-8b_h200.csv > $R/bench_fp8.log 2>&1
grep -B1 -A5 "time_us" $R/bench_fp8.log | head -60
echo "bench int4 $(date -u +%T)"; timeout $(left 30) python3 -m fdpp.bench --model llama3-8b --batch 1,8 \
  --seqlens 4k,16k,64k --page-size 0,16 --kv-dtype int4 --out $R/attn_int4_llama3-8b_h200.csv > $R/bench_int4.log 2>&1
grep -B1 -A5 "time_us" $R/bench_int4.log | head -40
echo "unified-max probe $(date -u +%T)"
for m in "" --no-max; do timeout $(left 40) python3 scripts/probe_unified_max.py --heads 32/8,8/1 --batch 1,8 \
  --seqlens 1024,4096,16384,65536 $m > $R/probe_unified_max${m:+_nomax}.log 2>&1; cat $R/probe_unified_max${m:+_nomax}.log; done
echo "sanitize $(date -u +%T)"; OUT=$R/sanitize PYTHON=python3 FAMILIES=cluster TOOLS="memcheck racecheck" TOOL_TIMEOUT=$(( ( $(left 200) - 10 ) / 2 )) \
  timeout $(left 200) bash scripts/sanitize.sh > $R/sanitize.log 2>&1; echo "sanitize rc $?"; grep -E "^==|summary|RESULT|fdpp kernels|ERROR SUMMARY" $R/sanitize/sanitize_report.txt | head -20
echo "done $(date -u +%T)"
tar czf $OUT/resM2.tgz -C /tmp resM2
