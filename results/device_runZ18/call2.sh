#!/usr/bin/env bash
# Run Z18, call 2 (any card): the cluster merge's GPU tests, with the new sizes 3, 11, 12 and 14
# (tests/test_gpu_fused.py CLUSTER_CASES), and the rest of that file.
set -uo pipefail
R=/tmp/resZ18b; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
timeout 400 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_gpu_fused.py > $R/pytest_fused.log 2>&1
echo "rc $?" >> $R/pytest_fused.log; tail -5 $R/pytest_fused.log; cp $R/* $OUT/
echo "done $(date -u +%T)"
