#!/usr/bin/env bash
# Run X1: the cluster merge as a push (its first form: the CTA merge kept, then each rank's slice of
# the CTA state pushed with st.async into the receiver, completed on an mbarrier) against the pull it
# replaced (commit 661efc6's kernels, carried as .old_kernels/), on the shipped table's plans
# (probe_phases.py --no-marks, alternated twice), the variant's phases (marks), the whole GPU suite.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-570}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resX1; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
mkdir -p /tmp/empty_tuning; export FDPP_TUNING_DIR=/tmp/empty_tuning
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
P="--points 32/8:1:1024,32/8:1:4096,8/1:1:1024,8/1:1:4096,32/8:8:1024,8/1:8:1024"
for i in 1 2; do
  echo "A/B round $i $(date -u +%T)"
  timeout $(left 70) python3 scripts/probe_phases.py $P --no-marks > $R/new_$i.log 2>&1
  timeout $(left 70) python3 scripts/probe_phases.py $P --no-marks --kernels .old_kernels > $R/old_$i.log 2>&1
done
grep -h "us per call" $R/new_*.log $R/old_*.log | sed 's/^/  /'
timeout $(left 70) python3 scripts/probe_phases.py $P > $R/marks_new.log 2>&1
echo "gpu tests $(date -u +%T)"
timeout $(left 330) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -20
echo "done $(date -u +%T)"
tar czf $OUT/resX1.tgz -C /tmp resX1
