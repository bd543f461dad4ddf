#!/usr/bin/env bash
# Run X2 (run 2026-12-05 on an H100; apply results/device_runX1/push_merge_warps.patch first): the cluster merge pushing every warp's state (no CTA merge first; merge.cuh ClusterPush, the
# working tree) against the pull it replaces (the previous commit's kernels, carried as .old_kernels/),
# shipped table plans, timed without marks, alternated twice; then the push merge's steps (marks 6, 7);
# then the L2 prefetch of every CTA's first budget/kv_bytes share at
# budgets 0/2/4/8 MiB (probe_phases --prefetch-share); then cluster sizes against the combine at 1k/4k/16k with the push merge (probe_cluster.py).
set -uo pipefail
END=$((SECONDS + ${BUDGET:-500}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resX2; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
mkdir -p /tmp/empty_tuning; export FDPP_TUNING_DIR=/tmp/empty_tuning
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
P="--points 32/8:1:1024,32/8:1:4096,32/8:1:16384,8/1:1:1024,8/1:1:4096,32/8:8:1024,8/1:8:1024"
for i in 1 2; do
  timeout $(left 70) python3 scripts/probe_phases.py $P --no-marks > $R/new_$i.log 2>&1
  timeout $(left 70) python3 scripts/probe_phases.py $P --no-marks --kernels .old_kernels > $R/old_$i.log 2>&1
done
for f in new_1 old_1 new_2 old_2; do echo "== $f"; grep -h "us per call" $R/$f.log | sed -E 's/: table .*no marks: / /; s/ \(graph.*error / err /'; done
tar czf $OUT/resX2.tgz -C /tmp resX2
timeout $(left 60) python3 scripts/probe_phases.py $P > $R/marks.log 2>&1
grep -E "^[0-9]|push|merge \+ end|KV loop" $R/marks.log | head -60
tar czf $OUT/resX2.tgz -C /tmp resX2
Q="--points 32/8:1:1024,32/8:1:4096,32/8:1:16384,32/8:8:1024,32/8:8:4096,8/1:1:4096,8/1:1:16384,8/1:1:65536"
timeout $(left 120) python3 scripts/probe_phases.py $Q --no-marks --prefetch-share --prefetch-mb 0,2,4,8 > $R/prefetch.log 2>&1
grep -E "===|us per call" $R/prefetch.log | sed -E 's/: table .*no marks: / /; s/ \(graph.*error / err /'
tar czf $OUT/resX2.tgz -C /tmp resX2
timeout $(left 150) python3 scripts/probe_cluster.py --heads 32/8 --batch 1 --seqlens 1024,4096,16384 \
  --shapes w4s2u1,w4s3u1,w4s4u1 --clusters 4,8 --splits 16 > $R/cluster.log 2>&1
cat $R/cluster.log | grep -v "^$" | head -60
echo "done $(date -u +%T)"; tar czf $OUT/resX2.tgz -C /tmp resX2
