#!/usr/bin/env bash
set -uo pipefail
R=/tmp/res; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
tar xzf .cupy_cache.tgz
timeout 100 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests > $R/pytest_gpu.log 2>&1
OUT=$R PYTHON=python3 TOOL_TIMEOUT=60 timeout 250 bash scripts/sanitize.sh > $R/sanitize.log 2>&1
tar czf $OUT/res.tgz -C /tmp res
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED" $R/pytest_gpu.log | head; grep -E "^==|summary|RESULT|fdpp kernels" $R/sanitize_report.txt
