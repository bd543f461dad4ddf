#!/usr/bin/env bash
# Run U8: after the GEMM tuner moved to fdpp/gemm_tune.py (no kernel change): the bench's GPU path
# (o and qkv, M = 1 and 8, 16-bit and FP8 weights, tuning into a scratch table) and the GEMM GPU tests.
set -uo pipefail
R=/tmp/resU8; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
timeout 100 python3 -m fdpp.bench gemm --model llama3-8b --layers o,qkv --m 1,8 --weights fp8 --tune --table $R/scratch.json \
  --repeats 5 --out $R/gemm.csv > $R/gemm.log 2>&1; grep -A14 "^layer" $R/gemm.log
timeout 120 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gemm_fp8.py tests/test_gemm.py > $R/pytest.log 2>&1
grep -E "passed|failed" $R/pytest.log | tail -1
tar czf $OUT/resU8.tgz -C /tmp resU8
