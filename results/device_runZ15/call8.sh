#!/usr/bin/env bash
# Run Z15, call 8 (any card; the table of the card it runs on): fp16 contiguous, 8
# llama3-8b entries re-tuned with 40 trials into a copy of the table, seeded
# with the shipped plans, then the bench of shipped against re-tuned (fdpp and the floor).
set -uo pipefail
R=/tmp/resZ15h; mkdir -p $R
pack() { tar czf $OUT/resZ15h.tgz -C /tmp resZ15h; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
T=$(python3 -c "import cupy as cp; from fdpp import tables; print(tables.table_filename(cp.cuda.runtime.getDeviceProperties(0)['name'].decode()))")
mkdir -p $R/tuning; cp tuning/$T $R/tuning/
echo "tune fp16 $(date -u +%T)"
timeout 260 python3 -m fdpp.tune --model llama3-8b --dtype fp16 --page-size 0 --batch 1,8 \
  --seqlens 1k,4k,16k,64k --trials 40 --out-dir $R/tuning --seed-table tuning/$T --no-plots --seed 29 \
  --results-dir $R/tune_fp16 > $R/tune_fp16.log 2>&1
tr '\r' '\n' < $R/tune_fp16.log | grep 'fdpp.tune:' | tail -2; pack
for side in shipped retuned; do dir=tuning; [ $side = retuned ] && dir=$R/tuning
  echo "bench fp16 $side $(date -u +%T)"
  FDPP_TUNING_DIR=$dir timeout 75 python3 -m fdpp.bench attn --model llama3-8b --batch 1,8 --seqlens 1k,4k,16k,64k \
    --impls fdpp,floor --out $R/bench_fp16_$side.csv > $R/bench_fp16_$side.log 2>&1
  python3 -c "import sys, pandas as pd; d = pd.read_csv(sys.argv[1]); print(d.pivot_table(index=['batch', 'seqlen', 'page_size'], columns='impl', values='time_us').round(2).to_string())" $R/bench_fp16_$side.csv; pack
done
echo "done $(date -u +%T)"
