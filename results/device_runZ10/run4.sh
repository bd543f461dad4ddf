#!/usr/bin/env bash
# Run Z10, call 4 (H200): the tuner's split candidates now hold the largest count within each wave
# (49 for llama3-8b heads at B = 1: one wave at 3 CTAs per SM). Re-tune, into a copy of the H200
# table with run Z10's 70b entries (TABLE; on an H100 its shipped table), llama3-8b INT4 (contiguous, pages of 16) and fp16,
# B = 1 and 8, 4k / 16k / 64k, seeded with the table's plans; bench shipped vs re-tuned.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-420}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ10d; mkdir -p $R/tuning /tmp/no_tables
pack() { tar czf $OUT/resZ10d.tgz -C /tmp resZ10d; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
# an H100: its shipped table instead of TABLE
grep -q H200 $R/gpu.txt || TABLE=tuning/NVIDIA_H100_80GB_HBM3.json
cp $TABLE $R/tuning/
for kv in int4 same; do
  echo "tune $kv $(date -u +%T)"
  ps="0,16"; [ $kv = same ] && ps=0
  timeout $(left 140) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype $kv --page-size $ps --batch 1,8 \
    --seqlens 4k,16k,64k --trials 30 --out-dir $R/tuning --no-plots --seed 13 --results-dir $R/tune_$kv > $R/tune_$kv.log 2>&1
  tr '\r' '\n' < $R/tune_$kv.log | grep 'fdpp.tune:' | tail -2; pack
done
for side in shipped retuned; do
  dir=/tmp/no_tables; [ $side = retuned ] && dir=$R/tuning
  for kv in int4 same; do
    echo "bench $side $kv $(date -u +%T)"
    ps="0,16"; [ $kv = same ] && ps=0
    FDPP_TUNING_DIR=$dir timeout $(left 50) python3 -m fdpp.bench attn --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
      --kv-dtype $kv --page-size $ps --impls fdpp,floor --out $R/bench_${side}_$kv.csv > $R/bench_${side}_$kv.log 2>&1
    python3 -c "import sys, pandas as pd; d = pd.read_csv(sys.argv[1]); print(d.pivot_table(index=['batch', 'seqlen', 'page_size'], columns='impl', values='time_us').round(2).to_string())" $R/bench_${side}_$kv.csv
    pack
  done
done
echo "done $(date -u +%T)"; pack
