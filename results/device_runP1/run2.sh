#!/usr/bin/env bash
# Run P1b: after reverting the factored kernel (HEAD's decode_split.cu / kv_cache.cuh), the INT4 GPU
# tests, including the two new ones (scales outside the usual range; a NaN V scale).
set -uo pipefail
R=/tmp/resP1b; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
timeout 300 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_gpu_int4.py > $R/pytest_int4.log 2>&1
grep -E "passed|failed" $R/pytest_int4.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_int4.log | head -20
tar czf $OUT/resP1b.tgz -C /tmp resP1b
