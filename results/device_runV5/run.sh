#!/usr/bin/env bash
# Run V5: after the final review: both benches' "interleaved, else each alone" written once
# (fdpp.timing.time_interleaved; gemm_tune.plan_impls). Short interleaved attention and GEMM benches and the
# GEMM / FP8-GEMM GPU tests.
set -uo pipefail
R=/tmp/resV5; mkdir -p $R
pack() { tar czf $OUT/resV5.tgz -C /tmp resV5; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache FDPP_TUNING_DIR=/tmp/resV5/user_empty
timeout 60 python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k,4k --impls fdpp,floor,torch-cudnn,flashinfer \
  --out $R/attn.csv > $R/bench8b.log 2>&1; grep -A6 "time_us" $R/bench8b.log | head -8; grep -i "interleaved timing failed\|failed at" $R/bench8b.log | head -3
timeout 60 python3 -m fdpp.bench gemm --model llama3-8b --layers o,qkv --m 1 --weights fp8 --out $R/gemm.csv > $R/gemm.log 2>&1
grep -A4 "^layer" $R/gemm.log | head -10; grep -i "timed alone\|failed" $R/gemm.log | head -3; pack
timeout 120 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gemm.py tests/test_gemm_fp8.py > $R/pytest.log 2>&1
grep -E "passed|failed" $R/pytest.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest.log | head; pack
