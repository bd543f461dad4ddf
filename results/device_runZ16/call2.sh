#!/usr/bin/env bash
# Run Z16, call 2 (any card): the GPU test added after call 1 (the device FP8 quantizer's descale floor
# with a tiny float32 amax, bitwise against NumPy; quantize_weight too). On an H200 only, then the
# whole GPU suite (8 workers). Run Z14's call4.sh would follow on the warm machine as a call of its own.
set -uo pipefail
R=/tmp/resZ16b; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_quant.py -k tiny > $R/pytest_tiny.log 2>&1
echo "rc $?" >> $R/pytest_tiny.log; tail -3 $R/pytest_tiny.log; cp $R/*.txt $R/*.log $OUT/
if grep -q H200 $R/gpu.txt; then
  TEST_TIMEOUT=400 OUT=$R bash scripts/device_run.sh test > $R/test_step.log 2>&1; tail -3 $R/pytest_gpu.log; cp $R/*.log $OUT/
fi
echo "done $(date -u +%T)"
