#!/usr/bin/env bash
# Run Z11, one call for what run2.sh and run3.sh would have done (device time ran short after failed
# starts), on branch z11-int4-vt: INT4 runs the FP8 kernels' transposed layout (S^T = K Q^T,
# O^T += V^T P^T: half the MMAs). (1) the INT4 GPU tests; (2) scripts/probe_int4.py on the table's
# INT4 plans, main's kernels (.oldk) against the branch's, one process each; (3) re-tune the
# llama3-8b INT4 entries (contiguous, pages of 16; B = 1, 8; 4k / 16k / 64k; stale after the edit)
# into a copy of the table, seeded with their old plans; (4) bench INT4 with it, fdpp fp16 beside.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-480}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
# Reused by later runs: R (results folder under /tmp), OLDK (the older kernels) and TRIALS (per bucket) default to run Z11's.
R=${R:-/tmp/resZ11d}; OLDK=${OLDK:-.oldk}; mkdir -p $R/tuning
pack() { tar czf $OUT/$(basename $R).tgz -C /tmp $(basename $R); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
J=8; grep -q H200 $R/gpu.txt || J=4
TABLE=tuning/NVIDIA_H200.json; grep -q H200 $R/gpu.txt || TABLE=tuning/NVIDIA_H100_80GB_HBM3.json
echo "int4 tests $(date -u +%T)"
timeout $(left 110) python3 -m pytest -q -m gpu -n $J -p no:cacheprovider -rs tests/test_gpu_int4.py tests/test_gpu_quant.py \
  tests/test_gpu_unified.py tests/test_gpu_fused.py tests/test_gpu_prefetch.py -k "int4 or i4 or quant" > $R/pytest_int4.log 2>&1
grep -E "passed|failed" $R/pytest_int4.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_int4.log | head -20; pack
for side in old new; do
  kd=""; [ $side = old ] && kd="--kernel-dir $OLDK"
  echo "probe $side $(date -u +%T)"
  timeout $(left 50) python3 scripts/probe_int4.py $kd --batch 1,8 --seqlens 4096,16384,65536 --group 64 > $R/probe_$side.log 2>&1
  grep -v "^#" $R/probe_$side.log | tail -8; pack
done
cp $TABLE $R/tuning/
echo "tune int4 $(date -u +%T)"
timeout $(left 170) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype int4 --page-size 0,16 --batch 1,8 \
  --seqlens 4k,16k,64k --trials ${TRIALS:-16} --out-dir $R/tuning --seed-table $TABLE --no-plots --seed 17 --results-dir $R/tune_int4 > $R/tune_int4.log 2>&1
tr '\r' '\n' < $R/tune_int4.log | grep 'fdpp.tune:' | tail -2; pack
for kv in int4 same; do
  echo "bench $kv $(date -u +%T)"
  ps="0,16"; [ $kv = same ] && ps=0
  FDPP_TUNING_DIR=$R/tuning timeout $(left 50) python3 -m fdpp.bench attn --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
    --kv-dtype $kv --page-size $ps --impls fdpp,floor --out $R/bench_$kv.csv > $R/bench_$kv.log 2>&1
  python3 -c "import sys, pandas as pd; d = pd.read_csv(sys.argv[1]); print(d.pivot_table(index=['batch', 'seqlen', 'page_size'], columns='impl', values='time_us').round(2).to_string())" $R/bench_$kv.csv; pack
done
echo "done $(date -u +%T)"; pack
