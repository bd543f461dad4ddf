#!/usr/bin/env bash
# Run Z7, third call (the tree of f1387b9 plus fdpp/cache.py's read-only-array fix): the GPU tests
# that append host arrays to torch caches (test_gpu_quant, test_gpu_rope_append, test_gpu_paged*),
# which warned "The given NumPy array is not writable" from cache.py in calls 1-2, with warnings
# shown. On an H200 also (3)-(4) of run.sh, the llama3-70b TP-8 B = 1 re-tune and the bench with
# both tables, then the whole suite in the time left. SKIP_APPEND=1: no append tests (they passed
# in call 3), and nothing at all on an H100.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-570}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ7d; mkdir -p $R/tuning /tmp/no_tables
pack() { tar czf $OUT/resZ7d.tgz -C /tmp resZ7d; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
J=8; grep -q H100 $R/gpu.txt && J=4
[ -n "${SKIP_APPEND:-}" ] && grep -q H100 $R/gpu.txt && { echo "an H100: nothing to do"; exit 0; }
if [ -z "${SKIP_APPEND:-}" ]; then
echo "append tests $(date -u +%T)"
timeout $(left 200) python3 -m pytest -q -m gpu -n $J -p no:cacheprovider tests/test_gpu_quant.py tests/test_gpu_rope_append.py \
  $(ls tests/test_gpu_paged*.py) > $R/pytest_append.log 2>&1
grep -E "passed|failed" $R/pytest_append.log | tail -1; grep -c "not writable" $R/pytest_append.log; pack
fi
grep -q H100 $R/gpu.txt && { echo "an H100: no tuning"; exit 0; }
echo "tune $(date -u +%T)"
cp tuning/NVIDIA_H200.json $R/tuning/
timeout $(left 110) python3 -m fdpp.tune --model llama3-70b:8 --dtype fp16,bf16 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --trials 30 --out-dir $R/tuning --no-plots --seed 11 --results-dir $R/tune_70b > $R/tune.log 2>&1
tr '\r' '\n' < $R/tune.log | grep 'fdpp.tune:' | tail -3; pack
for side in shipped retuned; do
  echo "bench $side $(date -u +%T)"
  dir=/tmp/no_tables; [ $side = retuned ] && dir=$R/tuning
  FDPP_TUNING_DIR=$dir timeout $(left 50) python3 -m fdpp.bench attn --model llama3-70b --tp 8 --batch 1 \
    --seqlens 1k,4k,16k,64k,256k --impls fdpp,floor,torch-cudnn,flashinfer --out $R/bench_$side.csv > $R/bench_$side.log 2>&1
  python3 -c "import sys, pandas as pd; d = pd.read_csv(sys.argv[1]); print(d.pivot_table(index='seqlen', columns='impl', values='time_us').round(2).to_string())" $R/bench_$side.csv
  pack
done
echo "suite $(date -u +%T)"
timeout $(left 300) python3 -m pytest -q -m gpu -n $J -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30; pack
echo "done $(date -u +%T)"; pack
