#!/usr/bin/env bash
# Run G7: the host-path GPU tests after the review commit (probe-based signatures, flat_gemm's one-pass repeat path).
set -uo pipefail
R=/tmp/resG7; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
timeout 200 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_host.py tests/test_gemm.py tests/test_gpu_attention.py \
  tests/test_gpu_model.py tests/test_gpu_paged.py tests/test_gpu_fused.py tests/test_gpu_int4.py > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -20
timeout 40 python3 -m fdpp.bench gemm --eager --model llama3-8b --out $R/gemm_eager_h200.csv > $R/gemm_eager.log 2>&1; grep -E "fdpp|torch" $R/gemm_eager.log | tail -3
tar czf $OUT/resG7.tgz -C /tmp resG7
