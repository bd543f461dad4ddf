#!/usr/bin/env bash
# Run H10 (final): the whole GPU suite on the final tree (role-word fix, helper merges: the CTA max
# and append-slot helpers in quantize_kv.cu / paged_append.cu, shared test helpers, GEMM tables on
# the shared table layer); compute-sanitizer over the fused merge (new role-word place), the
# quantizers, the cache appends, paged and tensor-core split kernels.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-330}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resH10; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
echo "tests $(date -u +%T)"; timeout $(left 170) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
echo "sanitize $(date -u +%T)"; OUT=$R FAMILIES=fused,quantized,cache,paged,decode_split_mma TOOL_TIMEOUT=$(left 60) \
  timeout $(left 150) bash scripts/sanitize.sh > $R/sanitize.log 2>&1; echo "sanitize rc=$?"
grep -E "^==|time:|workload:|ERROR SUMMARY" $R/sanitize_report.txt | head -30
echo "done $(date -u +%T)"
tar czf $OUT/resH10.tgz -C /tmp resH10
