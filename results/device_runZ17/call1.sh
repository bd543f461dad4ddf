#!/usr/bin/env bash
# Run Z17, call 1 (any card): run Z16's never-run call 4 (the quantizers' float32 operations as PTX without
# .ftz; CuPy compiles with -ftz=true, which flushed a float32 K of 1e-44 to code 0): the tiny-amax
# diagnostic and the device quantizers' GPU tests, then the whole GPU suite (one worker per 17 GiB, at most 8).
set -uo pipefail
R=/tmp/resZ17a; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
echo "tree $(git rev-parse --short HEAD 2>/dev/null)" >> $R/gpu.txt
timeout 60 python3 results/device_runZ16/diag_tiny.py > $R/diag_tiny.log 2>&1; head -12 $R/diag_tiny.log
timeout 150 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_gpu_quant.py > $R/pytest_quant.log 2>&1
echo "rc $?" >> $R/pytest_quant.log; tail -4 $R/pytest_quant.log; cp $R/* $OUT/
TEST_TIMEOUT=330 OUT=$R bash scripts/device_run.sh test > $R/test_step.log 2>&1; tail -3 $R/pytest_gpu.log; cp $R/*.log $OUT/
echo "done $(date -u +%T)"
