#!/usr/bin/env bash
# Run H6: where paged B=1 loses to contiguous: shuffled vs sequential pages, plans forced.
set -uo pipefail
R=/tmp/resH6; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
P="--batch 1 --seqlens 16384,65536 --pages 0,16,64 --plans w4s3u1,w8s3u1,w4s4u1,w8s4u1,w8s2u1"
timeout 150 python3 scripts/probe_paged.py $P > $R/probe_shuffled.log 2>&1; cat $R/probe_shuffled.log
timeout 150 python3 scripts/probe_paged.py $P --sequential > $R/probe_sequential.log 2>&1; cat $R/probe_sequential.log
tar czf $OUT/resH6.tgz -C /tmp resH6
