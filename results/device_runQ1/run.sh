#!/usr/bin/env bash
# Run Q1: pipeline depth of the tensor-core split kernel beyond the tuner's space (stages 5-8),
# FP8 (E4M3) and fp16 caches, llama3-8b heads, B = 1 (scripts/probe_pipeline.py); the cluster merge
# with deeper stages at 1k / 4k (scripts/probe_cluster.py). Shipped kernels and table.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-420}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resQ1; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
cd scripts
echo "fp8 $(date -u +%T)"; timeout $(left 170) python3 probe_pipeline.py --kv fp8_e4m3 --batch 1 --seqlens 16384,65536 \
  --shapes w4s3u1,w4s4u1,w4s5u1,w4s6u1,w4s8u1,w4s3u2,w4s4u2,w8s3u1,w8s4u1,w8s6u1 --splits 16,33,49 > $R/probe_fp8.log 2>&1; cat $R/probe_fp8.log
echo "fp16 $(date -u +%T)"; timeout $(left 120) python3 probe_pipeline.py --kv fp16 --batch 1 --seqlens 16384,65536 \
  --shapes w4s3u1,w4s4u1,w4s5u1,w4s6u1,w8s3u1 --splits 16,33 > $R/probe_fp16.log 2>&1; cat $R/probe_fp16.log
echo "cluster $(date -u +%T)"; timeout $(left 100) python3 probe_cluster.py --heads 32/8 --batch 1 --seqlens 1024,4096,16384 \
  --shapes w4s2u1,w4s3u1,w4s4u1,w4s6u1 > $R/probe_cluster.log 2>&1; cat $R/probe_cluster.log
echo "done $(date -u +%T)"
tar czf $OUT/resQ1.tgz -C /tmp resQ1
