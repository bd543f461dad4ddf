#!/usr/bin/env bash
# Run D5: GPU tests with FDPP_LAUNCH=driver (ctypes) on the launch-record paths; eager host cost; host
# profile; SM clock sampled while fdpp and cuDNN run a bandwidth-bound point.
set -uo pipefail
R=/tmp/res5; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
echo "tests $(date -u +%T)"
FDPP_LAUNCH=driver timeout 150 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_host.py tests/test_gpu_fused.py \
  tests/test_gpu_attention.py tests/test_gpu_paged.py tests/test_hostile_gpu.py > $R/pytest_gpu_driver.log 2>&1
grep -E "passed|failed" $R/pytest_gpu_driver.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu_driver.log | head -20
echo "eager $(date -u +%T)"; timeout 60 python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k --impls eager \
  --out $R/eager_llama3-8b_h200.csv > $R/eager.log 2>&1
timeout 70 python3 scripts/host_profile.py --out $R/host_profile_h200.csv > $R/host_profile.log 2>&1
echo "clocks $(date -u +%T)"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 100 > $R/clocks.csv 2>&1 &
SMI=$!
timeout 90 python3 -m fdpp.bench --model llama3-8b --batch 8 --seqlens 64k --impls fdpp,torch-cudnn,floor --repeats 30 \
  --out $R/clock_probe.csv > $R/clock_probe.log 2>&1
kill $SMI
echo "done $(date -u +%T)"
tar czf $OUT/res5.tgz -C /tmp res5
grep -E "eager|plan" $R/eager.log | head -8; grep -E "decode_attention|launch|cuLaunch|alloc|empty" $R/host_profile.log | head -30
awk -F, 'NR>1{print $2}' $R/clocks.csv | sort | uniq -c | sort -rn | head -8; grep -E "^fdpp|^torch|^floor" $R/clock_probe.log | head -4
