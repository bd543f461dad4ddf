#!/usr/bin/env bash
# Run H7: what a paged call's fixed extra cost at B=1 is (.dev/probe_h7.py, results/device_runH7).
set -uo pipefail
R=/tmp/resH7; mkdir -p $R
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
timeout 200 python3 .dev/probe_h7.py w8s3u1,w4s3u1 > $R/probe_h7.log 2>&1; cat $R/probe_h7.log | tail -30
cp .dev/probe_h7.py $R/
tar czf $OUT/resH7.tgz -C /tmp resH7
