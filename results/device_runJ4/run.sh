#!/usr/bin/env bash
# Run J4: the end-to-end step after run J3 showed fdpp ~0.4 ms slower at N >= 16k than run H11
# (and faster at 4k): the GEMM table with the cuBLAS margin applied, the per-op breakdown with PDL,
# and the step with FDPP_PDL=0, same tables.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-200}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resJ4; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
echo "e2e $(date -u +%T)"; timeout $(left 100) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k --batch 1 \
  --kv fp16 --impls fdpp,torch-ref --out $R/e2e_breakdown_h200.csv > $R/e2e.log 2>&1
echo "e2e nopdl $(date -u +%T)"; FDPP_PDL=0 timeout $(left 60) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k --batch 1 \
  --kv fp16 --impls fdpp --out $R/e2e_nopdl_h200.csv > $R/e2e_nopdl.log 2>&1
echo "done $(date -u +%T)"
tar czf $OUT/resJ4.tgz -C /tmp resJ4
grep -E "ITL|  [0-9]+k " $R/e2e.log | tail -12; grep -E "ITL" $R/e2e_nopdl.log | tail -4
