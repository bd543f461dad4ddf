#!/usr/bin/env bash
# Run Z2: on an H200, the whole GPU suite with the heuristic's cluster merge for every GQA ratio
# (run Z1 ran it on an H100) and the heuristic probe of run Z1 on the H200. Its first call came on
# an H100 and ran results/device_runY4/run.sh (the H100 table completed); since Y4 shipped, an
# H100 runs nothing here.
set -uo pipefail
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then echo "an H100: nothing to run (Z1, Y4 ran there)"; exit 0; fi
END=$((SECONDS + ${BUDGET:-575}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ2; mkdir -p $R
pack() { tar czf $OUT/resZ2.tgz -C /tmp resZ2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
echo "suite $(date -u +%T)"
timeout $(left 330) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30; pack
echo "probe $(date -u +%T)"
timeout $(left 170) python3 scripts/probe_cluster.py --heuristic --heads 28/4,16/8,40/8,12/2,32/8 --batch 1,8 \
  --seqlens 1024,2048,4096 > $R/probe_heuristic.log 2>&1; grep -v Warning $R/probe_heuristic.log
echo "done $(date -u +%T)"; pack
