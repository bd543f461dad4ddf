#!/usr/bin/env bash
# Run Z12, the H200 call that never came (every H200 start failed); for the next H200, which exits at once on another card:
# (1) results/device_runZ11/run4.sh: the INT4 GPU tests, the H200 table's INT4 plans on main's kernels
#     before run Z11 (.oldk) against the transposed INT4 kernel, the re-tune of those 12 entries, the bench;
# (2) run Z10's fp16 re-tune (llama3-8b, B = 1 and 8, 4k / 16k / 64k, the split candidates of run Z10)
#     into a copy of the table step (1) wrote, and the bench of shipped against re-tuned.
set -uo pipefail
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { nvidia-smi --query-gpu=name --format=csv,noheader; echo "not an H200: nothing to do"; exit 0; }
BUDGET=${BUDGET1:-300} bash results/device_runZ11/run4.sh
END=$((SECONDS + ${BUDGET2:-250}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ12a; mkdir -p $R/tuning
pack() { tar czf $OUT/resZ12a.tgz -C /tmp resZ12a; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
cp /tmp/resZ11d/tuning/NVIDIA_H200.json $R/tuning/
echo "tune fp16 $(date -u +%T)"
timeout $(left 140) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype same --page-size 0 --batch 1,8 \
  --seqlens 4k,16k,64k --trials 30 --out-dir $R/tuning --seed-table /tmp/resZ11d/tuning/NVIDIA_H200.json --no-plots --seed 13 \
  --results-dir $R/tune_fp16 > $R/tune_fp16.log 2>&1
tr '\r' '\n' < $R/tune_fp16.log | grep 'fdpp.tune:' | tail -2; pack
for side in shipped retuned; do
  echo "bench $side $(date -u +%T)"
  dir=/tmp/resZ11d/tuning; [ $side = retuned ] && dir=$R/tuning
  FDPP_TUNING_DIR=$dir timeout $(left 50) python3 -m fdpp.bench attn --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
    --kv-dtype same --page-size 0 --impls fdpp,floor --out $R/bench_$side.csv > $R/bench_$side.log 2>&1
  python3 -c "import sys, pandas as pd; d = pd.read_csv(sys.argv[1]); print(d.pivot_table(index=['batch', 'seqlen'], columns='impl', values='time_us').round(2).to_string())" $R/bench_$side.csv; pack
done
echo "done $(date -u +%T)"; pack
