#!/usr/bin/env bash
# Run Z15, call 1 (any card): the whole GPU suite (-m gpu) on the tree of this session (NVRTC-13.0 fix
# in flat_gemm.cu; the previous session's hardening of the quantize_weight / dequantize_kv device
# paths had not met a GPU), then the offline-NVRTC compile tests that failed on this machine's
# NVRTC 13.0 in run Z14 (call 7).
set -uo pipefail
R=/tmp/resZ15a; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
python3 -c "from cuda.bindings import nvrtc; print('offline NVRTC', nvrtc.nvrtcVersion()[1:])" >> $R/gpu.txt 2>&1
echo "gpu suite $(date -u +%T)"
timeout 420 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests > $R/pytest_gpu.log 2>&1; echo "rc $?" >> $R/pytest_gpu.log
tail -4 $R/pytest_gpu.log; cp $R/*.txt $R/*.log $OUT/ 2>/dev/null
echo "nvrtc compile tests $(date -u +%T)"
timeout 120 python3 -m pytest -q -p no:cacheprovider "tests/test_gemm_fp8.py::test_w8_variants_compile_without_spills" \
  tests/test_compile.py -k "mirror or generic or w8_variants" > $R/pytest_nvrtc.log 2>&1; echo "rc $?" >> $R/pytest_nvrtc.log
tail -3 $R/pytest_nvrtc.log; cp $R/* $OUT/ 2>/dev/null
echo "done $(date -u +%T)"
