#!/usr/bin/env bash
# Run Q6: FP8's Q.K and P.V both transposed (S^T = K Q^T, O^T += V^T P^T; kernels_cu/decode_split.cu,
# VT): the FP8 GPU tests and the FP8 cases of the fused / cluster tests; the FP8 probe on the old
# kernel (.dev/old = HEAD's decode_split.cu, kv_cache.cuh) and the new one, same plans
# (scripts/probe_pipeline.py).
set -uo pipefail
END=$((SECONDS + ${BUDGET:-420}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resQ6; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "tests $(date -u +%T)"; timeout $(left 150) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_fp8.py \
  > $R/pytest_fp8.log 2>&1; grep -E "passed|failed" $R/pytest_fp8.log | tail -1
timeout $(left 100) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_fused.py tests/test_gpu_paged.py \
  tests/test_hostile_gpu.py -k "fp8 or e4m3 or e5m2 or quant" >> $R/pytest_fp8.log 2>&1; grep -E "passed|failed" $R/pytest_fp8.log | tail -1
grep -E "^FAILED|^ERROR" $R/pytest_fp8.log | head -20
cd scripts
P="--kv fp8_e4m3 --batch 1,8 --seqlens 16384,65536 --shapes w4s3u1,w8s3u1,w4s4u2,w8s4u1,w4s4u1 --splits 16,33,66"
echo "probe old $(date -u +%T)"; timeout $(left 90) python3 probe_pipeline.py --kernel-dir ../.dev/old $P > $R/probe_fp8_old.log 2>&1; cat $R/probe_fp8_old.log
echo "probe new $(date -u +%T)"; timeout $(left 90) python3 probe_pipeline.py $P > $R/probe_fp8_new.log 2>&1; cat $R/probe_fp8_new.log
echo "done $(date -u +%T)"
tar czf $OUT/resQ6.tgz -C /tmp resQ6
