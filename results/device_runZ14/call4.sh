#!/usr/bin/env bash
# Run Z14, call 4 (an H200 only; split from call 3 when the session's device time ran short): FP8 E4M3's 18
# llama3-8b entries re-tuned with 40 trials (run Q8 tuned them with 16) into a copy of the table, seeded
# with the shipped plans, then the bench of shipped against re-tuned with FlashInfer beside.
set -uo pipefail
NAME=${RES_NAME:-resZ14d}; R=/tmp/$NAME; mkdir -p $R  # RES_NAME: a later run's folder (run Z17's call 2)
pack() { tar czf $OUT/$NAME.tgz -C /tmp $NAME; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
grep -q H200 $R/gpu.txt || { echo "done $(date -u +%T)"; exit 0; }
mkdir -p $R/tuning; cp tuning/NVIDIA_H200.json $R/tuning/
echo "tune fp8 $(date -u +%T)"
timeout 200 python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype fp8_e4m3 --page-size 0,16,64 --batch 1,8 \
  --seqlens 4k,16k,64k --trials 40 --out-dir $R/tuning --seed-table tuning/NVIDIA_H200.json --no-plots --seed 29 \
  --results-dir $R/tune_fp8 > $R/tune_fp8.log 2>&1
tr '\r' '\n' < $R/tune_fp8.log | grep 'fdpp.tune:' | tail -2; pack
for side in shipped retuned; do dir=tuning; [ $side = retuned ] && dir=$R/tuning
  echo "bench fp8 $side $(date -u +%T)"
  FDPP_TUNING_DIR=$dir timeout 75 python3 -m fdpp.bench attn --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k --kv-dtype fp8_e4m3 \
    --page-size 0,16,64 --impls fdpp,flashinfer,floor --out $R/bench_fp8_$side.csv > $R/bench_fp8_$side.log 2>&1
  python3 -c "import sys, pandas as pd; d = pd.read_csv(sys.argv[1]); print(d.pivot_table(index=['batch', 'seqlen', 'page_size'], columns='impl', values='time_us').round(2).to_string())" $R/bench_fp8_$side.csv; pack
done
echo "done $(date -u +%T)"
