#!/usr/bin/env bash
# Run Z15, call 4 (any card): FP8 E4M3 and fp16 at B = 1 over shapes the B = 8 table entries use (u2,
# 4 stages) and deeper pipelines, at 8-33 splits (scripts/probe_pipeline.py, llama3-8b heads,
# contiguous NHD, two-launch merge unless the table plan says otherwise). Call 3 saw FP8 reach 1.04 x
# its floor at B = 8, 64k (1 CTA per SM, w4s4u2) and 1.16 x at B = 1 (the table's w4s3u1, 33 splits).
set -uo pipefail
R=/tmp/resZ15d; mkdir -p $R
pack() { tar czf $OUT/resZ15d.tgz -C /tmp resZ15d; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
echo "fp8 $(date -u +%T)"
timeout 240 python3 scripts/probe_pipeline.py --kv fp8_e4m3 --batch 1 --seqlens 16384,65536 \
  --shapes w4s4u2,w4s3u2,w4s2u2,w4s5u1,w4s6u1,w8s4u1,w8s5u1,w8s3u2 --splits 8,16,24,33 > $R/fp8.log 2>&1
sort -k4 -n <(grep -v "^#" $R/fp8.log | grep " 65536 ") | head -8; pack
echo "fp16 $(date -u +%T)"
timeout 200 python3 scripts/probe_pipeline.py --kv fp16 --batch 1 --seqlens 16384 \
  --shapes w4s4u2,w4s3u2,w4s5u1,w8s4u1,w8s3u2 --splits 8,12,16,24 > $R/fp16.log 2>&1
sort -k4 -n <(grep -v "^#" $R/fp16.log | grep " 16384 ") | head -6; pack
echo "done $(date -u +%T)"
