#!/usr/bin/env bash
# Run Z15, call 9 (any card): the GPU tests nearest the audit's argument checks (commit 7e42971): the model
# step and its front ends, Hugging Face, context parallel on one GPU, unified max, paged (set_checks).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 420 python3 -m pytest -q -m gpu -n 3 -p no:cacheprovider tests/test_gpu_model.py tests/test_gpu_hf.py \
  tests/test_gpu_distributed.py tests/test_gpu_unified.py tests/test_gpu_paged.py > $OUT/pytest_audit.log 2>&1
echo "rc $?" >> $OUT/pytest_audit.log; tail -3 $OUT/pytest_audit.log
