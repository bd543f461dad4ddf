#!/usr/bin/env bash
# Run D3: GPU tests; same-run before/after bench of contiguous decode (906880d in .base vs this tree).
set -uo pipefail
END=$((SECONDS + ${BUDGET:-400}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/res3; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
export PYTHONPATH=/tmp/site:$PWD
echo "tests $(date -u +%T)"; timeout $(left 150) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
B="--model llama3-8b --batch 1,8 --seqlens 1k,4k,16k,64k --impls fdpp,fdpp-two-launch,floor"
echo "bench new $(date -u +%T)"; timeout $(left 100) python3 -m fdpp.bench $B --out $R/attn_new.csv > $R/bench_new.log 2>&1
echo "bench base $(date -u +%T)"; PYTHONPATH=/tmp/site:$PWD/.base timeout $(left 100) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 1k,4k,16k,64k --impls fdpp,floor --out $R/attn_base.csv > $R/bench_base.log 2>&1
echo "done $(date -u +%T)"
tar czf $OUT/res3.tgz -C /tmp res3
grep -E "^fdpp|^floor|fdpp-two" $R/bench_new.log | head -30; echo BASE; grep -E "^fdpp|^floor" $R/bench_base.log | head -20; tail -5 $R/bench_new.log
