#!/usr/bin/env bash
# Run Q2: does the order in which CTAs read the cache set the FP8 kernel's bandwidth? The same plans
# on NHD caches in the shipped block order, NHD with the CTAs of one split's KV heads adjacent
# (--order head, a source patch), and HND caches (each head's tokens contiguous); FP8 and fp16,
# llama3-8b heads, B = 1 (scripts/probe_pipeline.py). Shipped kernels and table.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-300}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resQ2; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
cd scripts
for v in "NHD split" "NHD head" "HND split" "HND head"; do set -- $v
  for kv in fp8_e4m3 fp16; do
    echo "$kv $1 $2 $(date -u +%T)"; timeout $(left 60) python3 probe_pipeline.py --kv $kv --batch 1,8 --seqlens 16384,65536 \
      --shapes w4s3u1,w8s3u1,w4s4u2 --splits 16,33 --layout $1 --order $2 > $R/probe_${kv}_$1_$2.log 2>&1; cat $R/probe_${kv}_$1_$2.log
  done
done
echo "done $(date -u +%T)"
tar czf $OUT/resQ2.tgz -C /tmp resQ2
