#!/usr/bin/env bash
# Run H4: (1) flat_gemm with its dynamic shared memory 128-byte aligned vs as shipped (same table
# plans, hash rewritten), same run; (2) the whole GPU suite on the tree with the split kernels'
# role word moved out of static shared memory; (3) the shipped attention table re-tuned.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-585}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resH4; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
for t in gemm_base gemm_al gemm_base gemm_al; do
  d=$PWD/.dev/exp/$t
  ( cd $d && PYTHONPATH=/tmp/site:$d timeout $(left 45) python3 -m fdpp.bench gemm --model llama3-8b --m 1,2,4,8,16 --paths fdpp,cublas \
      --out $R/gemm_${t}_$SECONDS.csv > $R/gemm_${t}_$SECONDS.log 2>&1 )
  echo "== gemm $t $(date -u +%T)"
done
echo "tests $(date -u +%T)"; timeout $(left 150) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
echo "tune $(date -u +%T)"; rm -f tuning/NVIDIA_H200.json
timeout $(left 120) python3 -m fdpp.tune --model llama3-8b llama2-7b llama3-70b:8 --dtype fp16,bf16 --trials 16 \
  --out-dir tuning --results-dir $R/tune --no-plots > $R/tune.log 2>&1
timeout $(left 25) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --batch 64 --seqlens 1k,4k,16k,64k --trials 12 \
  --out-dir tuning --results-dir $R/tune_b64 --no-plots > $R/tune_b64.log 2>&1
timeout $(left 30) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --page-size 16 --batch 1,8,64 --seqlens 1k,4k,16k,64k \
  --trials 12 --out-dir tuning --results-dir $R/tune_paged --no-plots > $R/tune_paged.log 2>&1
timeout $(left 45) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype fp8_e4m3 --page-size 0,16,64 --batch 1,8 \
  --seqlens 4k,16k,64k --trials 16 --out-dir tuning --results-dir $R/tune_fp8 --no-plots > $R/tune_fp8.log 2>&1
timeout $(left 30) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype int4 --page-size 0,16 \
  --batch 1,8 --seqlens 4k,16k,64k --trials 12 --out-dir tuning --results-dir $R/tune_int4 --no-plots > $R/tune_int4.log 2>&1
cp tuning/NVIDIA_H200.json $R/; tail -qn1 $R/tune*.log
echo "done $(date -u +%T)"
tar czf $OUT/resH4.tgz -C /tmp resH4
for f in $R/gemm_*.log; do echo "== $f"; grep -iE "^ *(o|qkv|gate_up|down|layer|shape)|speedup|fdpp|cublas" $f | tail -12; done 2>/dev/null | head -80
