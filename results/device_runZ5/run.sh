#!/usr/bin/env bash
# Run Z5: does the split-KV access pattern cost bandwidth by itself? scripts/probe_read_pattern.py
# reads llama3-8b-shaped NHD caches with nothing but loads, one CTA per (split, head), in the
# kernels' contiguous-chunk order and in interleaved tiles, against the stream-read floor; then the
# attention kernels' table plans at the same points (probe_pipeline.py, shapes of the table only).
set -uo pipefail
END=$((SECONDS + ${BUDGET:-240}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ5; mkdir -p $R
pack() { tar czf $OUT/resZ5.tgz -C /tmp resZ5; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
echo "pattern $(date -u +%T)"
timeout $(left 150) python3 scripts/probe_read_pattern.py > $R/read_pattern.log 2>&1; cat $R/read_pattern.log; pack
echo "table plans $(date -u +%T)"
cd scripts
timeout $(left 80) python3 probe_pipeline.py --kv fp16,fp8_e4m3 --batch 1 --seqlens 16384,65536 --shapes w4s3u1 --splits 16 \
  > $R/pipeline.log 2>&1; grep -v Warning $R/pipeline.log
cd ..; echo "done $(date -u +%T)"; pack
