#!/usr/bin/env bash
# Run W2 (after W1): a fused call where the table says cuBLAS takes the fastest kernel the tuner measured for
# the bucket; a heuristic kernel runs on one wave. The fused-GEMM / GEMM / model / prefetch GPU tests, then the
# model step fused (fdpp) against unfused (fdpp-unfused).
set -uo pipefail
END=$((SECONDS + ${BUDGET:-400}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resW2; mkdir -p $R
pack() { tar czf $OUT/resW2.tgz -C /tmp resW2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
export FDPP_TUNING_DIR=$R/user_empty  # the shipped tables only
echo "tests $(date -u +%T)"
timeout $(left 150) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests/test_gemm_fused.py tests/test_gemm.py \
  tests/test_gpu_model.py tests/test_gpu_prefetch.py > $R/pytest.log 2>&1
grep -E "passed|failed" $R/pytest.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest.log | head -20; pack
echo "e2e $(date -u +%T)"; timeout $(left 200) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k --batch 1,8 \
  --impls fdpp,fdpp-unfused --out $R/e2e.csv > $R/e2e.log 2>&1; tail -8 $R/e2e.log
echo "done $(date -u +%T)"; pack
