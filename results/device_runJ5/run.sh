#!/usr/bin/env bash
# Run J5 (diagnostic): the end-to-end step at 4k/16k/64k with PDL for all kernels, none, attention
# only, flat_gemm only (.dev/pdl_split.py overrides KernelCall's flag by config type), twice each.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-150}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resJ5; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
for rep in 1 2; do for w in all none attention gemm; do
  timeout $(left 25) python3 results/device_runJ5/pdl_split.py $w --model llama3-8b --seqlens 4k,16k,64k --batch 1 --kv fp16 --impls fdpp \
    --no-breakdown --out $R/e2e_${w}_$rep.csv > $R/e2e_${w}_$rep.log 2>&1
  echo "$w $rep: $(grep -oE 'N=[0-9]+ +ITL +[0-9.]+' $R/e2e_${w}_$rep.log | tr -s ' ' | tr '\n' ' ')"
done; done
tar czf $OUT/resJ5.tgz -C /tmp resJ5
