#!/usr/bin/env bash
# Run Z10, call 3 (H200, right after the suite and the 70b re-tune): (1) re-tune, into a copy of the
# H200 table with run Z10's 70b entries, the llama3-8b fp16 B = 1 buckets at 1k / 4k / 16k (issue 15's
# bar: 4.5 / 7.0 / 18.5 us), 40 trials each, seeded with the table's plans; (2) bench shipped vs
# re-tuned with cuDNN, flash and FlashInfer; (3) probe_int4, HND cache, more split counts and shapes.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-560}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ10c; mkdir -p $R/tuning /tmp/no_tables
pack() { tar czf $OUT/resZ10c.tgz -C /tmp resZ10c; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
cp $TABLE $R/tuning/NVIDIA_H200.json
echo "tune 8b $(date -u +%T)"
timeout $(left 200) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --batch 1 --seqlens 1k,4k,16k \
  --trials 40 --out-dir $R/tuning --no-plots --seed 12 --results-dir $R/tune_8b > $R/tune_8b.log 2>&1
tr '\r' '\n' < $R/tune_8b.log | grep 'fdpp.tune:' | tail -3; pack
for side in shipped retuned; do
  dir=/tmp/no_tables; [ $side = retuned ] && dir=$R/tuning
  echo "bench $side $(date -u +%T)"
  FDPP_TUNING_DIR=$dir timeout $(left 70) python3 -m fdpp.bench attn --model llama3-8b --batch 1 \
    --seqlens 1k,4k,16k --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/bench_$side.csv > $R/bench_$side.log 2>&1
  python3 -c "import sys, pandas as pd; d = pd.read_csv(sys.argv[1]); print(d.pivot_table(index='seqlen', columns='impl', values='time_us').round(2).to_string())" $R/bench_$side.csv
  pack
done
echo "probe int4 $(date -u +%T)"
timeout $(left 150) python3 scripts/probe_int4.py --kv-layout HND --batch 1 --seqlens 16384,65536 --splits 16,33,50,66 \
  --shapes w4s2u1,w4s3u1,w4s4u2,w8s3u1 > $R/probe_int4_hnd.log 2>&1
grep -v "^ *$" $R/probe_int4_hnd.log | tail -40
echo "done $(date -u +%T)"; pack
