#!/usr/bin/env bash
# Run Y1b (H200 only): the attention sweeps of results/attn_*_nvidia-h200.csv redone on this tree with
# the peers (the files at results/ were from 2026-11-30, before the cluster merge and the re-tunes),
# and their plots.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-560}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resY1b; mkdir -p $R
pack() { tar czf $OUT/resY1b.tgz -C /tmp resY1b; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
grep -q H200 $R/gpu.txt || { echo "not an H200: nothing run"; exit 0; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
mkdir -p /tmp/empty_tuning; export FDPP_TUNING_DIR=/tmp/empty_tuning
I="fdpp,floor,torch-cudnn,torch-flash,flashinfer"
timeout $(left 330) python3 -m fdpp.bench attn --model llama3-8b --batch 1,8 --impls $I \
  --out $R/attn_llama3-8b_fp16_nvidia-h200.csv > $R/bench8b.log 2>&1; tail -30 $R/bench8b.log; pack
timeout $(left 150) python3 -m fdpp.bench attn --model llama3-70b --tp 8 --batch 1 --impls $I \
  --out $R/attn_llama3-70b-tp8_fp16_nvidia-h200.csv > $R/bench70b.log 2>&1; tail -14 $R/bench70b.log
for f in $R/attn_*.csv; do timeout $(left 30) python3 -m fdpp.plot $f --out-dir $R > /dev/null 2>&1; done
ls $R; echo "done $(date -u +%T)"; pack
