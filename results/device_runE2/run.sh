#!/usr/bin/env bash
# Run E2: FP8 kernels with cvt (sm_90): GPU tests of the attention families, sanitizer on an FP8 workload,
# an FP8 tune (llama3-8b heads) and the FP8 sweep with FlashInfer's batch decode as the peer.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-400}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resE2; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
echo "tests $(date -u +%T)"; timeout $(left 150) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_fp8.py tests/test_gpu_attention.py tests/test_gpu_paged.py tests/test_gpu_fused.py > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
echo "sanitize $(date -u +%T)"; timeout $(left 60) compute-sanitizer --tool memcheck --print-limit 5 python3 -c "exec(open('.dev/fp8_sanitize.py').read())" > $R/sanitize_fp8.log 2>&1; tail -4 $R/sanitize_fp8.log
echo "tune $(date -u +%T)"; timeout $(left 120) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype fp8_e4m3 \
  --seqlens 4k,16k,64k --batch 1,8 --page-size 0,16,64 --trials 24 --out-dir $R/tune --results-dir $R/tune_results --no-plots > $R/tune.log 2>&1
tail -2 $R/tune.log
export FDPP_TUNING_DIR=$R/tune
echo "bench fp8 $(date -u +%T)"; timeout $(left 120) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --page-size 0,16,64 --kv-dtype fp8_e4m3 --impls fdpp,floor,flashinfer --out $R/attn_fp8_llama3-8b_h200.csv > $R/bench_fp8.log 2>&1
grep -v "Traceback\|driver.pyx\|Error\|Exception\|excepthook\|Original" $R/bench_fp8.log | tail -40
echo "done $(date -u +%T)"
tar czf $OUT/resE2.tgz -C /tmp resE2
