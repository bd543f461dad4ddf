#!/usr/bin/env bash
# Run R1: softmax_mode="unified_max" in the tensor-core kernels (kernels_cu/decode_split.cu: the
# reference starts from phi, vote-first lazy max, the first-block low rule) and the 16-bit path's
# vote-first max in exact mode. The table's stale entries re-tuned (--skip-tuned, seeded with their
# old plans; run M1's commands), then the whole GPU suite on the new table.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-570}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resR1; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)" >> $R/gpu.txt 2>&1
echo "tune $(date -u +%T)"; cp tuning/NVIDIA_H200.json $R/NVIDIA_H200_before.json
T="--out-dir tuning --no-plots --skip-tuned"
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
cp tuning/NVIDIA_H200.json $R/; for f in $R/tune*.log; do tr '\r' '\n' < $f | grep 'fdpp.tune:' | tail -1; done
echo "tests $(date -u +%T)"; timeout $(left 200) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
echo "done $(date -u +%T)"
tar czf $OUT/resR1.tgz -C /tmp resR1
