#!/usr/bin/env bash
# Run Z16, call 4 (any card): the quantizers' float32 operations as PTX without .ftz (quant.cuh's f32_*;
# CuPy compiles with -ftz=true, which flushed a float32 K of 1e-44 to code 0 in call 2): the tiny-amax
# diagnostic again, then the device quantizers' GPU tests (KV FP8 / INT4, paged append, FP8 weights' tiny row).
set -uo pipefail
R=/tmp/resZ16d; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
timeout 60 python3 results/device_runZ16/diag_tiny.py > $R/diag_tiny.log 2>&1; head -8 $R/diag_tiny.log
timeout 120 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_gpu_quant.py > $R/pytest_quant.log 2>&1; echo "rc $?" >> $R/pytest_quant.log; tail -4 $R/pytest_quant.log
cp $R/* $OUT/; echo "done $(date -u +%T)"
