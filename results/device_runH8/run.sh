#!/usr/bin/env bash
# Run H8: H7 again after the block-table reads moved two tiles ahead (AHEAD2).
set -uo pipefail
R=/tmp/resH8; mkdir -p $R
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
timeout 200 python3 .dev/probe_h7.py w8s3u1,w4s3u1 > $R/probe_h7.log 2>&1; cat $R/probe_h7.log | tail -30
# (the probe script is results/device_runH7/probe_h7.py)
tar czf $OUT/resH8.tgz -C /tmp resH8
