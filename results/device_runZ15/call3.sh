#!/usr/bin/env bash
# Run Z15, call 3 (any card): warp-local K/V loading (wl.patch: each warp copies the rows it reads
# itself, so a tile waits on the warp's own cp.async groups and a __syncwarp instead of a CTA barrier)
# against the shipped kernels, on the table's plans: fp16 and FP8 E4M3 (probe_pipeline.py) and INT4 g64
# (probe_int4.py), llama3-8b heads, B = 1 and 8, contiguous NHD; one process per side, A B A B. Then the
# GPU tests of the attention kernels with the patch applied to the tree (table plans are stale there,
# so the dispatcher runs heuristic plans).
set -uo pipefail
R=/tmp/resZ15c; mkdir -p $R
pack() { tar czf $OUT/resZ15c.tgz -C /tmp resZ15c; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
rm -rf /tmp/wlk && cp -r kernels_cu /tmp/wlk && patch -s -d /tmp/wlk -p2 < results/device_runZ15/wl.patch
grep -c "Warp-local" /tmp/wlk/decode_split.cu > $R/wl_patched.txt
for side in shipped wl shipped2 wl2; do
  kd=""; case $side in wl*) kd="--kernel-dir /tmp/wlk";; esac
  echo "pipeline $side $(date -u +%T)"
  timeout 100 python3 scripts/probe_pipeline.py $kd --kv fp16,fp8_e4m3 --batch 1,8 --seqlens 4096,16384,65536 --shapes "" \
    > $R/pipe_$side.log 2>&1
  grep -v "^#" $R/pipe_$side.log | grep -v floor | tail -12; pack
  echo "int4 $side $(date -u +%T)"
  timeout 70 python3 scripts/probe_int4.py $kd --batch 1,8 --seqlens 16384,65536 --group 64 > $R/int4_$side.log 2>&1
  grep -v "^#" $R/int4_$side.log | tail -4; pack
done
grep floor $R/pipe_shipped.log
echo "tests with the patch $(date -u +%T)"
patch -s -p1 < results/device_runZ15/wl.patch && grep -c "Warp-local" kernels_cu/decode_split.cu
timeout 200 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_gpu_attention.py tests/test_gpu_paged.py \
  tests/test_gpu_fp8.py tests/test_gpu_int4.py tests/test_gpu_fused.py tests/test_gpu_unified.py > $R/pytest_wl.log 2>&1
echo "rc $?" >> $R/pytest_wl.log; tail -3 $R/pytest_wl.log; pack
patch -s -R -p1 < results/device_runZ15/wl.patch
echo "done $(date -u +%T)"
