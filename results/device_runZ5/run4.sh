#!/usr/bin/env bash
# Run Z5, fourth call: half groups in the tuner (fdpp.tune.group_candidates: group_size_for(ratio)
# and half of it where batch x KV heads <= 4). (1) the GPU tests of half-group plans and the tiny
# GPU tune; (2) the llama3-70b TP-8 (8 / 1) B = 1 buckets, fp16 and bf16, re-tuned into a copy of
# this GPU's table (seeded with the table's plan); (3) the bench at those points with the shipped
# table and with the re-tuned one (FDPP_TUNING_DIR), cuDNN and FlashInfer in each process.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-480}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ5d; mkdir -p $R/tuning /tmp/no_tables
pack() { tar czf $OUT/resZ5d.tgz -C /tmp resZ5d; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
TABLE=tuning/NVIDIA_H200.json; grep -q H100 $R/gpu.txt && TABLE=tuning/NVIDIA_H100_80GB_HBM3.json
echo "tests $(date -u +%T)"
timeout $(left 90) python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -rs tests/test_gpu_fused.py -k "half or cluster_merge_matches" \
  > $R/pytest_half.log 2>&1; grep -E "passed|failed" $R/pytest_half.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_half.log | head
timeout $(left 60) python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_tune_cpu.py > $R/pytest_tune.log 2>&1
grep -E "passed|failed" $R/pytest_tune.log | tail -1; pack
echo "tune $(date -u +%T)"
cp $TABLE $R/tuning/
timeout $(left 250) python3 -m fdpp.tune --model llama3-70b:8 --dtype fp16,bf16 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --trials 30 --out-dir $R/tuning --no-plots --seed 11 --results-dir $R/tune_70b > $R/tune.log 2>&1
tr '\r' '\n' < $R/tune.log | grep 'fdpp.tune:' | tail -3; pack
for side in shipped retuned; do
  echo "bench $side $(date -u +%T)"
  dir=/tmp/no_tables; [ $side = retuned ] && dir=$R/tuning
  FDPP_TUNING_DIR=$dir timeout $(left 60) python3 -m fdpp.bench attn --model llama3-70b --tp 8 --batch 1 \
    --seqlens 1k,4k,16k,64k,256k --impls fdpp,floor,torch-cudnn,flashinfer --out $R/bench_$side.csv > $R/bench_$side.log 2>&1
  python3 - $R/bench_$side.csv <<'PY'
import sys, pandas as pd
d = pd.read_csv(sys.argv[1])
print(d.pivot_table(index="seqlen", columns="impl", values="time_us").round(2).to_string())
PY
  pack
done
echo "done $(date -u +%T)"; pack
