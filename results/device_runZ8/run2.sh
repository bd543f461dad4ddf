#!/usr/bin/env bash
# Run Z8, H200 call: (1) the whole GPU suite on the H200 (the tree's tests last ran there in run Y1,
# at 28f3645; every run since came on an H100); (2) re-tune, into a copy of the shipped H200 table,
# the llama3-70b TP-8 B = 1 buckets (fp16, bf16) with half groups in the search, as the H100 table
# was in run Z5; (3) bench the shipped and the re-tuned table, interleaved with cuDNN, flash and
# FlashInfer. Does nothing on an H100 (its suite ran in run Z7; its table is another file).
set -uo pipefail
END=$((SECONDS + ${BUDGET:-570}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ8b; mkdir -p $R/tuning /tmp/no_tables
pack() { tar czf $OUT/resZ8b.tgz -C /tmp resZ8b; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
grep -q H100 $R/gpu.txt && { echo "an H100: nothing to do"; exit 0; }
echo "suite $(date -u +%T)"
timeout $(left 250) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30; pack
echo "tune 70b $(date -u +%T)"
cp tuning/NVIDIA_H200.json $R/tuning/
timeout $(left 130) python3 -m fdpp.tune --model llama3-70b:8 --dtype fp16,bf16 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --trials 30 --out-dir $R/tuning --no-plots --seed 11 --results-dir $R/tune_70b > $R/tune_70b.log 2>&1
tr '\r' '\n' < $R/tune_70b.log | grep 'fdpp.tune:' | tail -3; pack
for side in shipped retuned; do
  dir=/tmp/no_tables; [ $side = retuned ] && dir=$R/tuning
  echo "bench $side $(date -u +%T)"
  FDPP_TUNING_DIR=$dir timeout $(left 70) python3 -m fdpp.bench attn --model llama3-70b --tp 8 --batch 1 \
    --seqlens 1k,4k,16k,64k,256k --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/bench_$side.csv > $R/bench_$side.log 2>&1
  python3 -c "import sys, pandas as pd; d = pd.read_csv(sys.argv[1]); print(d.pivot_table(index='seqlen', columns='impl', values='time_us').round(2).to_string())" $R/bench_$side.csv
  pack
done
echo "done $(date -u +%T)"; pack
