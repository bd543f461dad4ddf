#!/usr/bin/env bash
# Run Z14. (1) On an H100 only: run Z13's run4.sh (re-tune the H100 table's 12 INT4 entries for run
# Z13's kernel; they are re-stamped plans until then). (2) On any card: INT4 split counts x kernel
# shapes at B = 1 16k / 64k and B = 8 16k / 64k (scripts/probe_int4.py, llama3-8b heads, g64, two-launch
# plans). Run Z13's Nsight Compute found the B = 1, 64k split kernel latency-bound with 2 warps per
# scheduler; this asks whether more CTAs per SM (66 splits: 4 per SM at B = 1) or other shapes pay.
set -uo pipefail
R=/tmp/resZ14a; mkdir -p $R
pack() { tar czf $OUT/resZ14a.tgz -C /tmp resZ14a; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
if ! grep -q H200 $R/gpu.txt; then BUDGET=${BUDGET:-300} bash results/device_runZ13/run4.sh; fi
echo "probe $(date -u +%T)"
timeout 200 python3 scripts/probe_int4.py --batch 1,8 --seqlens 16384,65536 --group 64 --splits 16,33,49,66,99,132 \
  --shapes w4s3u1,w4s2u1,w8s3u1,w8s2u1 > $R/probe_splits.log 2>&1
grep -v "^#" $R/probe_splits.log | head -130; pack
echo "done $(date -u +%T)"
