#!/usr/bin/env bash
# Run Q9: the probes after their timing loop moved into probe_cluster.time_rows, one small point each.
set -uo pipefail
R=/tmp/resQ9; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
cd scripts
timeout 60 python3 probe_cluster.py --heads 32/8 --batch 1 --seqlens 4096 --shapes w4s3u1 > $R/probe_cluster.log 2>&1; cat $R/probe_cluster.log
timeout 60 python3 probe_int4.py --batch 1 --seqlens 16384 --splits 16 > $R/probe_int4.log 2>&1; cat $R/probe_int4.log
timeout 60 python3 probe_pipeline.py --kv fp8_e4m3,fp16 --seqlens 16384 --shapes w4s3u1 --splits 16 > $R/probe_pipeline.log 2>&1; cat $R/probe_pipeline.log
timeout 60 python3 probe_softmax.py --heads 32/8 --batch 1 --seqlens 4096 > $R/probe_softmax.log 2>&1; cat $R/probe_softmax.log
tar czf $OUT/resQ9.tgz -C /tmp resQ9
