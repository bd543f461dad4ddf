#!/usr/bin/env bash
# Run Z13, second call: the whole GPU test suite on the branch (-n 8 on an H200, -n 4 otherwise).
set -uo pipefail
R=/tmp/resZ13b; mkdir -p $R
pack() { tar czf $OUT/resZ13b.tgz -C /tmp resZ13b; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
J=8; grep -q H200 $R/gpu.txt || J=4
echo "suite $(date -u +%T)"
timeout ${SUITE_S:-420} python3 -m pytest -q -m gpu -n $J -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
tail -3 $R/pytest_gpu.log; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -20; pack
echo "done $(date -u +%T)"
