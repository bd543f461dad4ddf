#!/usr/bin/env bash
# Run E3: which kernel faults in the FP8 sweep (launches serialised), and the two fixed FP8 tests.
set -uo pipefail
R=/tmp/resE3; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
timeout 100 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_fp8.py > $R/pytest_gpu.log 2>&1; tail -1 $R/pytest_gpu.log
for impl in fdpp flashinfer; do
  echo "== $impl"; CUDA_LAUNCH_BLOCKING=1 timeout 80 python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 4k,16k --kv-dtype fp8_e4m3 --quick \
    --impls $impl --out $R/$impl.csv > $R/bench_$impl.log 2>&1
  grep -i "failed\|wrote" $R/bench_$impl.log | grep -v Traceback | head -5
done
echo "== sanitizer on FlashInfer fp8"; timeout 120 compute-sanitizer --tool memcheck --print-limit 3 python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 4k --kv-dtype fp8_e4m3 --quick \
    --impls flashinfer --out $R/fi_san.csv > $R/fi_san.log 2>&1; grep -E "Invalid|ERROR SUMMARY|at 0x|by thread" $R/fi_san.log | head -8
tar czf $OUT/resE3.tgz -C /tmp resE3
