#!/usr/bin/env bash
# Run K2: the attention split kernels trigger their dependents after the KV loop (run K1), PDL for
# attention by default, the model-step elementwise ops as fdpp kernels, the cupy-driver launcher: the whole
# GPU suite, then the shipped attention table re-tuned from scratch with the commands of run J2.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-540}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resK2; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "tests $(date -u +%T)"; timeout $(left 150) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
echo "tune $(date -u +%T)"; rm -f tuning/NVIDIA_H200.json
T="--out-dir tuning --no-plots"
timeout $(left 150) python3 -m fdpp.tune --model llama3-8b llama2-7b llama3-70b:8 --dtype fp16,bf16 --trials 16 $T \
  --results-dir $R/tune > $R/tune.log 2>&1
timeout $(left 25) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --batch 64 --seqlens 1k,4k,16k,64k --trials 12 $T \
  --results-dir $R/tune_b64 > $R/tune_b64.log 2>&1
timeout $(left 30) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --page-size 16 --batch 1,8,64 --seqlens 1k,4k,16k,64k \
  --trials 12 $T --results-dir $R/tune_paged > $R/tune_paged.log 2>&1
timeout $(left 45) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype fp8_e4m3 --page-size 0,16,64 --batch 1,8 \
  --seqlens 4k,16k,64k --trials 16 $T --results-dir $R/tune_fp8 > $R/tune_fp8.log 2>&1
timeout $(left 30) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype int4 --page-size 0,16 \
  --batch 1,8 --seqlens 4k,16k,64k --trials 12 $T --results-dir $R/tune_int4 > $R/tune_int4.log 2>&1
echo "fill $(date -u +%T)"  # buckets a limit cut, if time is left
timeout $(left 60) python3 -m fdpp.tune --model llama3-8b llama2-7b llama3-70b:8 --dtype fp16,bf16 --trials 16 --skip-tuned $T \
  --results-dir $R/tune_fill > $R/tune_fill.log 2>&1
cp tuning/NVIDIA_H200.json $R/; tail -qn1 $R/tune*.log
echo "done $(date -u +%T)"
tar czf $OUT/resK2.tgz -C /tmp resK2
