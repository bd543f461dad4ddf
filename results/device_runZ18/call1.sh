#!/usr/bin/env bash
# Run Z18, call 1 (any card): cluster sizes outside 2 / 4 / 8 / 16. The cluster merge's size was a
# power of two; any 2..16 now runs (configs.MAX_CLUSTER). How many clusters of each size the GPU holds
# at once (cuOccupancyMaxActiveClusters), then llama3-8b heads at B = 1, 1k / 4k / 16k: the table's
# plan against clusters of 8..16 and against 16 splits merged by the combine kernel or fused.
set -uo pipefail
R=/tmp/resZ18a; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
timeout 120 python3 scripts/probe_cluster.py --occupancy --heads 32/8,8/1 --shapes w4s2u1,w4s3u1 \
  --clusters 2,4,6,8,9,10,11,12,13,14,15,16 > $R/occupancy.log 2>&1; cat $R/occupancy.log; cp $R/* $OUT/
timeout 300 python3 scripts/probe_cluster.py --heads 32/8 --batch 1 --seqlens 1024,4096,16384 \
  --shapes w4s2u1,w4s3u1 --clusters 8,10,11,12,14,16 --splits 16 > $R/clusters_8b.log 2>&1
cat $R/clusters_8b.log; cp $R/* $OUT/
echo "done $(date -u +%T)"
