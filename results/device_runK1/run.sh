#!/usr/bin/env bash
# Run K1: the whole GPU suite on the working tree (the cupy-driver launcher; commit 0ef1761's PDL
# launch path); the eager host cost and host profile; the PDL trigger experiment: the model step
# and the llama3-8b / 70b B=1 sweeps with the attention kernels' launch_dependents at the start
# (shipped), after the main KV loop (late), or absent (none), with FDPP_PDL=all and the default.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-540}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resK1; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
ROOT=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
export PYTHONPATH=/tmp/site:$ROOT
echo "tests $(date -u +%T)"; timeout $(left 170) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -20
echo "eager $(date -u +%T)"; timeout $(left 25) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k \
  --impls eager --out $R/eager_llama3-8b_h200.csv > $R/eager.log 2>&1; grep -A12 "B=1  time_us" $R/eager.log | head -14
timeout $(left 25) python3 -m fdpp.bench gemm --eager --model llama3-8b --out $R/gemm_eager_h200.csv > $R/gemm_eager.log 2>&1
grep -E "fdpp|torch|cupy" $R/gemm_eager.log | tail -6
timeout $(left 45) python3 scripts/host_profile.py --profile-calls 2000 --out $R/host_profile_h200.csv > $R/host_profile.log 2>&1
grep -E "empty kernel|^ *cupy +(fdpp|DecodePlan|LaunchRecord.run)|^ *torch +(fdpp|DecodePlan|LaunchRecord.run)" $R/host_profile.log | head -14
for v in base late none; do
  if [ $v = base ]; then D=$ROOT; else D=$ROOT/.dev/k1/v$v; fi
  export PYTHONPATH=/tmp/site:$D
  cd $D
  for pdl in all gemm; do
    [ $v != base ] && [ $pdl = gemm ] && continue
    echo "e2e $v pdl=$pdl $(date -u +%T)"
    FDPP_PDL=$pdl timeout $(left 30) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k --batch 1 --kv fp16 --impls fdpp \
      --no-breakdown --out $R/e2e_${v}_$pdl.csv > $R/e2e_${v}_$pdl.log 2>&1
    echo "  $(grep -oE 'N=[0-9]+ +ITL +[0-9.]+' $R/e2e_${v}_$pdl.log | tr -s ' ' | tr '\n' ' ')"
  done
  FDPP_PDL=all timeout $(left 25) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k,4k,16k,64k --impls fdpp,floor \
    --out $R/attn8b_${v}.csv > $R/attn8b_${v}.log 2>&1; grep -A4 "B=1  time_us" $R/attn8b_${v}.log | head -5
  FDPP_PDL=all timeout $(left 20) python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k,16k,64k --impls fdpp,floor \
    --out $R/attn70b_${v}.csv > $R/attn70b_${v}.log 2>&1; grep -A4 "B=1  time_us" $R/attn70b_${v}.log | head -5
  cd $ROOT
done
echo "done $(date -u +%T)"
tar czf $OUT/resK1.tgz -C /tmp resK1
