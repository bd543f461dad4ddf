#!/usr/bin/env bash
# Run N1: the ctypes cuLaunchKernelEx PDL launcher (FDPP_PDL_LAUNCH=ctypes) against cuda.bindings'
# one: the changed GPU tests (PDL chains for both launchers, the host path), the host profile with
# the launch matrix (PDL on through each launcher, PDL off through each plain launcher), and the
# eager bench (B = 1, N = 1k, llama3-8b heads) four times, alternating the default PDL launcher.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-420}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resN1; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
lscpu | grep -E "Model name|^CPU\(s\)|MHz" >> $R/gpu.txt 2>&1
echo "tests $(date -u +%T)"; timeout $(left 120) python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_gpu_pdl.py \
  tests/test_gpu_host.py > $R/pytest_gpu.log 2>&1; grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head
echo "host profile $(date -u +%T)"; timeout $(left 120) python3 scripts/host_profile.py --matrix --out $R/host_profile_h200.csv \
  > $R/host_profile.log 2>&1; grep -E "launch |PDL|DecodePlan.run, launch" $R/host_profile.log | head -40
for i in 1 2; do for pl in bindings ctypes; do
  echo "eager $pl $i $(date -u +%T)"; FDPP_PDL_LAUNCH=$pl timeout $(left 60) python3 -m fdpp.bench --model llama3-8b --batch 1 \
    --seqlens 1k --impls eager --out $R/eager_${pl}_$i.csv > $R/eager_${pl}_$i.log 2>&1; grep -A22 "B=1  time_us" $R/eager_${pl}_$i.log | head -22
done; done
echo "done $(date -u +%T)"
tar czf $OUT/resN1.tgz -C /tmp resN1
