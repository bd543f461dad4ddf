#!/usr/bin/env bash
set -uo pipefail
R=/tmp/resG5; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
timeout 200 python3 .dev/probe_splits.py > $R/probe_splits.log 2>&1; grep -E "best|tuned" $R/probe_splits.log
tar czf $OUT/resG5.tgz -C /tmp resG5
