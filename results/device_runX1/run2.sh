#!/usr/bin/env bash
# Run X2 (NOT RUN: no device could be started; apply push_merge_warps.patch first): the cluster merge pushing every warp's state (no CTA merge first; merge.cuh ClusterPush)
# against the pull it replaced (commit 661efc6's kernels, carried as .old_kernels/), shipped table
# plans, timed without marks, alternated twice; then the push merge's steps (marks 6 and 7).
set -uo pipefail
R=/tmp/resX2; mkdir -p $R
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
mkdir -p /tmp/empty_tuning; export FDPP_TUNING_DIR=/tmp/empty_tuning
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $R/gpu.txt 2>&1
P="--points 32/8:1:1024,32/8:1:4096,8/1:1:1024,8/1:1:4096,32/8:8:1024"
for i in 1 2; do
  timeout 60 python3 scripts/probe_phases.py $P --no-marks > $R/new_$i.log 2>&1
  timeout 60 python3 scripts/probe_phases.py $P --no-marks --kernels .old_kernels > $R/old_$i.log 2>&1
done
for f in new_1 old_1 new_2 old_2; do echo "== $f"; grep -h "us per call" $R/$f.log | sed -E 's/: table .*no marks: / /; s/ \(graph.*error / err /'; done
timeout 60 python3 scripts/probe_phases.py $P > $R/marks.log 2>&1
grep -E "^[0-9]|push|merge \+ end|KV loop" $R/marks.log
tar czf $OUT/resX2.tgz -C /tmp resX2
