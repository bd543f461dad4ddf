#!/usr/bin/env bash
# Run Z14, call 6 (any card): the GPU tests nearest this session's hardening commits (argument checks,
# overlap checks, dequantize_kv's field checks, the NaN-lse assertion in tests/test_hostile_gpu.py).
set -uo pipefail
R=/tmp/resZ14f; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_hostile_gpu.py tests/test_gpu_quant.py \
  tests/test_gpu_int4.py tests/test_gpu_host.py tests/test_api_validation.py tests/test_quant_cpu.py > $R/pytest.log 2>&1
grep -E "passed|failed" $R/pytest.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest.log | head -20
tar czf $OUT/resZ14f.tgz -C /tmp resZ14f
