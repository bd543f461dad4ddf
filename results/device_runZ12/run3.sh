#!/usr/bin/env bash
# Run Z12, call 3, an H200 only (exits at once on another card), with little device time left: run
# Z11's run4.sh steps for the H200 table's INT4 entries, most needed first: (1) re-tune the 12
# llama3-8b INT4 entries (re-stamped, not re-tuned, in run Z11) into a copy of the table; (2) bench
# INT4 with it, fdpp fp16 beside; (3) the INT4 GPU tests; (4) old (.oldk) against new kernels on the
# shipped plans. Each step's limit is capped by BUDGET.
set -uo pipefail
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { nvidia-smi --query-gpu=name --format=csv,noheader; echo "not an H200: nothing to do"; exit 0; }
END=$((SECONDS + ${BUDGET:-250}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ12c; mkdir -p $R/tuning
pack() { tar czf $OUT/resZ12c.tgz -C /tmp resZ12c; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
TABLE=tuning/NVIDIA_H200.json; cp $TABLE $R/tuning/
echo "tune int4 $(date -u +%T)"
timeout $(left 120) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype int4 --page-size 0,16 --batch 1,8 \
  --seqlens 4k,16k,64k --trials 16 --out-dir $R/tuning --seed-table $TABLE --no-plots --seed 17 --results-dir $R/tune_int4 > $R/tune_int4.log 2>&1
tr '\r' '\n' < $R/tune_int4.log | grep 'fdpp.tune:' | tail -2; pack
for kv in int4 same; do
  echo "bench $kv $(date -u +%T)"
  ps="0,16"; [ $kv = same ] && ps=0
  FDPP_TUNING_DIR=$R/tuning timeout $(left 50) python3 -m fdpp.bench attn --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
    --kv-dtype $kv --page-size $ps --impls fdpp,floor --out $R/bench_$kv.csv > $R/bench_$kv.log 2>&1
  python3 -c "import sys, pandas as pd; d = pd.read_csv(sys.argv[1]); print(d.pivot_table(index=['batch', 'seqlen', 'page_size'], columns='impl', values='time_us').round(2).to_string())" $R/bench_$kv.csv; pack
done
echo "int4 tests $(date -u +%T)"
timeout $(left 100) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests/test_gpu_int4.py tests/test_gpu_quant.py \
  tests/test_gpu_unified.py tests/test_gpu_fused.py tests/test_gpu_prefetch.py -k "int4 or i4 or quant" > $R/pytest_int4.log 2>&1
grep -E "passed|failed" $R/pytest_int4.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_int4.log | head -20; pack
for side in old new; do
  kd=""; [ $side = old ] && kd="--kernel-dir .oldk"
  echo "probe $side $(date -u +%T)"
  timeout $(left 45) python3 scripts/probe_int4.py $kd --batch 1,8 --seqlens 4096,16384,65536 --group 64 > $R/probe_$side.log 2>&1
  grep -v "^#" $R/probe_$side.log | tail -8; pack
done
echo "done $(date -u +%T)"; pack
