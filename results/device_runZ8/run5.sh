#!/usr/bin/env bash
# Run Z8, last call: the whole GPU suite on an H200 only (the tree's tests last ran on one in run
# Y1, at 28f3645; every run since came on an H100). Nothing on an H100.
set -uo pipefail
R=/tmp/resZ8e; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $R/gpu.txt
grep -q H200 $R/gpu.txt || { echo "not an H200: nothing to do"; exit 0; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
timeout ${BUDGET:-330} python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
tar czf $OUT/resZ8e.tgz -C /tmp resZ8e
