#!/usr/bin/env bash
# (The --variant split-barrier patch was removed from scripts/probe_phases.py once the change shipped in
# kernels_cu/merge.cuh; run this script at commit 3fafaed to repeat it.)
# Run T6: the cluster merge with its last barrier split (scripts/probe_phases.py --variant
# split-barrier) against the shipped kernels, timed without marks, interleaved (shipped, variant,
# shipped, variant), then the variant's phase marks. Shipped table plans, L2 prefetch off.
set -uo pipefail
R=/tmp/resT6; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
P="--points 32/8:1:1024,32/8:1:4096,8/1:1:1024,8/1:1:4096,32/8:8:1024"
for r in 1 2; do
  timeout 60 python3 scripts/probe_phases.py $P --no-marks 2>&1 | tee $R/shipped_$r.log | grep "us per call"
  timeout 60 python3 scripts/probe_phases.py $P --no-marks --variant split-barrier 2>&1 | tee $R/split_$r.log | grep "us per call"
done
timeout 60 python3 scripts/probe_phases.py $P --variant split-barrier 2>&1 | tee $R/split_marks.log | tail -40
tar czf $OUT/resT6.tgz -C /tmp resT6
