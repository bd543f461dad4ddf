#!/usr/bin/env bash
# Run N2: the session's final tree (the eager rows timed round-robin, fdpp.bench's PDL-off rows,
# host_profile's PDL launch row): the whole GPU test suite, the eager host cost at the bench point
# (B = 1, N = 1k, llama3-8b heads) twice, flat_gemm's eager cost (o projection, M = 1), and the
# llama3-8b model step at B = 8.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-480}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resN2; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
lscpu | grep -E "Model name|^CPU\(s\)|MHz" >> $R/gpu.txt 2>&1
echo "tests $(date -u +%T)"; timeout $(left 200) python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head
for i in 1 2; do
  echo "eager $i $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k --impls eager \
    --out $R/eager_llama3-8b_h200_$i.csv > $R/eager_$i.log 2>&1; grep -A16 "B=1  time_us" $R/eager_$i.log | head -16
done
echo "gemm eager $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench gemm --eager --model llama3-8b \
  --out $R/gemm_eager_llama3-8b_h200.csv > $R/gemm_eager.log 2>&1; tail -6 $R/gemm_eager.log
echo "e2e B=8 $(date -u +%T)"; timeout $(left 150) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,32k --batch 8 --impls fdpp,torch-ref \
  --kv fp16,fp8,int4 --no-breakdown --out $R/e2e_llama3-8b_b8_h200.csv > $R/e2e_b8.log 2>&1; tail -7 $R/e2e_b8.log
echo "done $(date -u +%T)"
tar czf $OUT/resN2.tgz -C /tmp resN2
