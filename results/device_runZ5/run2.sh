#!/usr/bin/env bash
# Run Z5, second call. (1) Half groups: query heads per CTA below group_size_for, so each KV head is
# read by ratio / group CTAs (the second read mostly from L2) and a B = 1 call fills twice the SMs
# with clusters of 8 (probe_cluster.py --groups); (2) the kernels' cp.async loader without their
# math (probe_read_pattern.py's split_cpasync) at the fp16 16k / FP8 64k points, against the floor
# and the plain-load reader; (3) the FP8 kernel at 64k with up to 16 warps per SM.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-420}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ5b; mkdir -p $R
pack() { tar czf $OUT/resZ5b.tgz -C /tmp resZ5b; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
cd scripts
echo "groups $(date -u +%T)"
S="--batch 1 --seqlens 1024,4096,16384 --shapes w4s2u1,w4s3u1,w8s2u1 --clusters 8,16 --splits 16,32"
timeout $(left 150) python3 probe_cluster.py --heads 32/8 --groups 0,2 $S > $R/groups_32_8.log 2>&1; grep -v Warning $R/groups_32_8.log; pack
timeout $(left 90) python3 probe_cluster.py --heads 8/1 --groups 0,4 $S > $R/groups_8_1.log 2>&1; grep -v Warning $R/groups_8_1.log; pack
echo "cp.async $(date -u +%T)"
timeout $(left 60) python3 probe_read_pattern.py --points fp16:16384:16,fp8:65536:16 --tiles 64 > $R/cpasync.log 2>&1
cat $R/cpasync.log; pack
echo "fp8 $(date -u +%T)"  # FP8 at 64k with 16 warps per SM (w8, 2 CTAs per SM) and deeper stages
timeout $(left 90) python3 probe_pipeline.py --kv fp8_e4m3 --batch 1 --seqlens 65536 --shapes w4s3u1,w8s3u1,w8s4u1,w4s6u1 \
  --splits 16,33,66 > $R/pipeline_fp8.log 2>&1; grep -v Warning $R/pipeline_fp8.log
cd ..; echo "done $(date -u +%T)"; pack
