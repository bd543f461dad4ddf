#!/usr/bin/env bash
# Run Z1: the cluster merge with 2, 5, 6 and 7 query heads per CTA (tests/test_gpu_fused.py's
# CLUSTER_CASES), then the whole GPU suite with the heuristic taking the cluster merge for every
# group size (configs.CLUSTER_HEURISTIC_GROUPS = 1..8), then the heuristic's cluster plan against
# its fused twin at head configurations no table holds (scripts/probe_cluster.py --heuristic).
set -uo pipefail
END=$((SECONDS + ${BUDGET:-585}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ1; mkdir -p $R
pack() { tar czf $OUT/resZ1.tgz -C /tmp resZ1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
N=8; grep -q "H100" $R/gpu.txt && N=4  # 80 GB: the model tests ran out of memory with 8 workers (run X1)
echo "cluster tests $(date -u +%T)"
timeout $(left 150) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_fused.py -k cluster > $R/pytest_cluster.log 2>&1
grep -E "passed|failed" $R/pytest_cluster.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_cluster.log | head -20; pack
echo "probe $(date -u +%T)"
timeout $(left 170) python3 scripts/probe_cluster.py --heuristic --heads 28/4,16/8,40/8,12/2,32/8 --batch 1,8 \
  --seqlens 1024,2048,4096 > $R/probe_heuristic.log 2>&1; cat $R/probe_heuristic.log | grep -v Warning; pack
echo "suite $(date -u +%T)"
timeout $(left 330) python3 -m pytest -q -m gpu -n $N -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
echo "done $(date -u +%T)"; pack
