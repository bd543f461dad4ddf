#!/usr/bin/env bash
# Run Z13, the least that answers the question when little device time is left: the INT4 GPU tests
# on the branch, then the probe of main's kernels (.mainK) against the branch's on the table's INT4
# plans (B = 1 and 8, 4k / 16k / 64k, groups of 64), one process each. No re-tune, no bench.
set -uo pipefail
R=/tmp/resZ13c; mkdir -p $R
pack() { tar czf $OUT/resZ13c.tgz -C /tmp resZ13c; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
J=8; grep -q H200 $R/gpu.txt || J=4
echo "int4 tests $(date -u +%T)"
timeout ${TESTS_S:-100} python3 -m pytest -q -m gpu -n $J -p no:cacheprovider -rs tests/test_gpu_int4.py tests/test_gpu_quant.py \
  -k "int4 or i4 or quant" > $R/pytest_int4.log 2>&1
grep -E "passed|failed" $R/pytest_int4.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_int4.log | head -20; pack
for side in old new; do
  kd=""; [ $side = old ] && kd="--kernel-dir .mainK"
  echo "probe $side $(date -u +%T)"
  timeout ${PROBE_S:-50} python3 scripts/probe_int4.py $kd --batch 1,8 --seqlens 4096,16384,65536 --group 64 > $R/probe_$side.log 2>&1
  grep -v "^#" $R/probe_$side.log | tail -8; pack
done
echo "done $(date -u +%T)"; pack
