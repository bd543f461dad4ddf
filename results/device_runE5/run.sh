#!/usr/bin/env bash
# Run E5: lazy rescaling + padded FP8 V rows: GPU tests of the attention families, Nsight Compute
# on the B=1 64k split kernel (FP8 and fp16), FP8 tune and sweep with FlashInfer.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-420}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resE5; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
echo "tests $(date -u +%T)"; timeout $(left 150) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_fp8.py tests/test_gpu_attention.py tests/test_gpu_paged.py tests/test_gpu_fused.py tests/test_hostile_gpu.py > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -20
for cfg in "fp8_e4m3 4 3 1 32" "fp8_e4m3 8 3 1 16" "fp8_e4m3 4 3 2 32" "fp16 4 3 1 16"; do
  set -- $cfg
  timeout $(left 40) ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:decode_split_mma --section SpeedOfLight --section LaunchStats --section InstructionStats --section Occupancy \
    python3 -c "import sys; sys.argv=['x', '$1', '$2', '$3', '$4', '$5']; exec(open('.dev/ncu_fp8.py').read())" > $R/ncu_$1_$2_$3_$4_$5.txt 2>&1
  echo "== $cfg $(grep -E '^    (Duration|DRAM Throughput|Executed Instructions|Registers Per Thread) ' $R/ncu_$1_$2_$3_$4_$5.txt | awk '{print $1,$(NF)}' | tr '\n' ' ')"
done
echo "tune $(date -u +%T)"; timeout $(left 120) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype fp8_e4m3 \
  --seqlens 4k,16k,64k --batch 1,8 --page-size 0,16,64 --trials 24 --out-dir $R/tune --results-dir $R/tune_results --no-plots > $R/tune.log 2>&1
tail -1 $R/tune.log
export FDPP_TUNING_DIR=$R/tune
echo "bench fp8 $(date -u +%T)"; timeout $(left 150) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --page-size 0,16,64 --kv-dtype fp8_e4m3 --impls fdpp,floor,flashinfer --out $R/attn_fp8_llama3-8b_h200.csv > $R/bench_fp8.log 2>&1
grep -v "Traceback\|driver.pyx\|Exception\|excepthook\|Original\|it/s\|run/s" $R/bench_fp8.log | tail -40
echo "done $(date -u +%T)"
tar czf $OUT/resE5.tgz -C /tmp resE5
