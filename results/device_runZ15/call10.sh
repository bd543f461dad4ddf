#!/usr/bin/env bash
# Run Z15, call 10 (any card): the device FP8 quantizer's new descale floor (2^-149; quantize_kv.cu)
# against the NumPy one, and the second audit's CPU tests run where NumPy inputs go through the GPU.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 300 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_gpu_quant.py tests/test_gemm_fp8.py tests/test_gpu_fp8.py \
  "tests/test_quant_cpu.py::test_tiny_float32_amax_never_gives_a_zero_descale" \
  "tests/test_api_validation.py::test_emulator_batch_invariant_whatever_n_max" > $OUT/pytest_audit2.log 2>&1
echo "rc $?" >> $OUT/pytest_audit2.log; tail -3 $OUT/pytest_audit2.log
