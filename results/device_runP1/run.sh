#!/usr/bin/env bash
# Run P1: the factored INT4 kernel (K's scale / zero applied per group to the dot products, V's
# folded into P; kernels_cu/decode_split.cu). INT4 GPU tests; the INT4 probe (scripts/probe_int4.py)
# on the old kernel (.dev/old = HEAD's decode_split.cu, kv_cache.cuh) and the new one, same plans;
# the 12 INT4 buckets re-tuned (--skip-tuned; the other entries re-stamped by compare_ptx.py,
# their instructions unchanged); the INT4 bench with fp16 beside it.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-500}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resP1; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "tests $(date -u +%T)"; timeout $(left 150) python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_gpu_int4.py \
  > $R/pytest_int4.log 2>&1; grep -E "passed|failed" $R/pytest_int4.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_int4.log | head -20
P="--batch 1,8 --seqlens 4096,16384,65536 --splits 16,33 --shapes w4s2u1,w8s3u1"
echo "probe old $(date -u +%T)"; timeout $(left 70) python3 scripts/probe_int4.py --kernel-dir .dev/old $P > $R/probe_int4_old.log 2>&1; cat $R/probe_int4_old.log
echo "probe new $(date -u +%T)"; timeout $(left 70) python3 scripts/probe_int4.py $P > $R/probe_int4_new.log 2>&1; cat $R/probe_int4_new.log
timeout $(left 30) python3 scripts/probe_int4.py --batch 1 --seqlens 65536 --vscale 8 > $R/probe_int4_new_vscale8.log 2>&1; cat $R/probe_int4_new_vscale8.log
if grep -q " failed" $R/pytest_int4.log || ! grep -q " passed" $R/pytest_int4.log; then echo "tests failed: no tune"; else
echo "tune $(date -u +%T)"; timeout $(left 170) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype int4 --page-size 0,16 \
  --batch 1,8 --seqlens 4k,16k,64k --trials 12 --out-dir tuning --no-plots --skip-tuned --results-dir $R/tune_int4 > $R/tune_int4.log 2>&1
cp tuning/NVIDIA_H200.json $R/; tr '\r' '\n' < $R/tune_int4.log | grep 'fdpp.tune:' | tail -14
echo "bench $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench --model llama3-8b --batch 1,8 \
  --seqlens 4k,16k,64k --page-size 0,16 --kv-dtype int4 --out $R/attn_int4_llama3-8b_h200.csv > $R/bench_int4.log 2>&1
grep -A5 "time_us" $R/bench_int4.log | head -40; fi
echo "done $(date -u +%T)"
tar czf $OUT/resP1.tgz -C /tmp resP1
