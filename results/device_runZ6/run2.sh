#!/usr/bin/env bash
# Run Z6, second call (the committed tree with fdpp.hadamard): (1) the whole GPU suite (-n 8 on an
# H200, -n 4 on an H100), the first whole-suite run since the records' lock (31b274e); (2) the
# warp-stall profiles of ncu_stalls.sh (FP8 E4M3 and INT4 g64, llama3-8b heads, B = 1, 64k).
set -uo pipefail
END=$((SECONDS + ${BUDGET:-560}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ6b; mkdir -p $R
pack() { tar czf $OUT/resZ6b.tgz -C /tmp resZ6b; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee $R/gpu.txt
git log --oneline -1 > $R/commit.txt 2>/dev/null; cat $R/commit.txt
J=8; grep -q H100 $R/gpu.txt && J=4
echo "suite $(date -u +%T)"
timeout $(left 400) python3 -m pytest -q -m gpu -n $J -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30; pack
echo "ncu $(date -u +%T)"
BUDGET_LEFT=$(left 400); timeout $BUDGET_LEFT bash results/device_runZ6/ncu_stalls.sh $R; pack
echo "done $(date -u +%T)"; pack
