#!/usr/bin/env bash
# Run Q3: is FP8's conversion the limit? The same plans with E4M3 (cvt.rn.f16x2.e4m3x2), E5M2 (one
# byte_perm per pair) and E4M3 decoded by the sm_80 bit moves on sm_90 (--variant e4m3-alu), each
# point with its stream_read floor (scripts/probe_pipeline.py); llama3-8b heads, contiguous NHD.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-300}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resQ3; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
cd scripts
P="--batch 1,8 --seqlens 16384,65536 --shapes w4s3u1,w8s3u1,w4s4u2,w8s4u1 --splits 16,33"
for v in "fp8_e4m3 shipped" "fp8_e5m2 shipped" "fp8_e4m3 e4m3-alu"; do set -- $v
  echo "$1 $2 $(date -u +%T)"; timeout $(left 90) python3 probe_pipeline.py --kv $1 --variant $2 $P > $R/probe_$1_$2.log 2>&1; cat $R/probe_$1_$2.log
done
echo "done $(date -u +%T)"
tar czf $OUT/resQ3.tgz -C /tmp resQ3
