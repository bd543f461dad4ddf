#!/usr/bin/env bash
# Run Z14, call 1 (any card; run1.sh split in two after failed starts cut the session's device time):
# does a one-byte K/V split kernel run faster with 4 CTAs per SM? (a) scripts/probe_int4.py over split
# counts x shapes, shipped kernels; (b) the same with the one-byte K/V kernels of 4 warps compiled for
# 4 CTAs per SM (__launch_bounds__(128, 4), a sed patch of a copy of kernels_cu/); (c, d) FP8 E4M3 the
# same way (scripts/probe_pipeline.py). One process each; llama3-8b heads, two-launch plans.
set -uo pipefail
R=/tmp/resZ14a; mkdir -p $R
pack() { tar czf $OUT/resZ14a.tgz -C /tmp resZ14a; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
rm -rf /tmp/lbk && cp -r kernels_cu /tmp/lbk
sed -i 's/__launch_bounds__(NUM_WARPS \* 32, 1) decode_split_mma(const DecodeParams p)/__launch_bounds__(NUM_WARPS * 32, (sizeof(DTypeKV) == 1 \&\& NUM_WARPS == 4) ? 4 : 1) decode_split_mma(const DecodeParams p)/' /tmp/lbk/decode_split.cu
grep -c "? 4 : 1) decode_split_mma(" /tmp/lbk/decode_split.cu > $R/lbk_patched.txt
for side in shipped lb4; do
  kd=""; [ $side = lb4 ] && kd="--kernel-dir /tmp/lbk"
  echo "probe int4 $side $(date -u +%T) (patched: $(cat $R/lbk_patched.txt))"
  timeout 110 python3 scripts/probe_int4.py $kd --batch 1,8 --seqlens 16384,65536 --group 64 --splits 33,49,66,99 \
    --shapes w4s3u1,w4s2u1 > $R/probe_int4_$side.log 2>&1
  grep -v "^#" $R/probe_int4_$side.log | head -60; pack
done
for side in shipped lb4; do
  kd=""; [ $side = lb4 ] && kd="--kernel-dir /tmp/lbk"
  echo "probe fp8 $side $(date -u +%T)"
  timeout 90 python3 scripts/probe_pipeline.py $kd --kv fp8_e4m3 --batch 1,8 --seqlens 16384,65536 \
    --shapes w4s3u1,w4s2u1 --splits 33,66,99 > $R/probe_fp8_$side.log 2>&1
  grep -v "^#" $R/probe_fp8_$side.log | head -40; pack
done
echo "done $(date -u +%T)"
