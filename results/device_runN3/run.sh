#!/usr/bin/env bash
# Run N3: the eager host cost at the bench point (B = 1, N = 1k, llama3-8b heads), three benches
# back to back, and flat_gemm's eager cost (o projection, M = 1), on the tree of run N2.
set -uo pipefail
R=/tmp/resN3; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt 2>&1; lscpu | grep -E "Model name|^CPU\(s\)" >> $R/gpu.txt
for i in 1 2 3; do
  timeout 90 python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k --impls eager --out $R/eager_llama3-8b_h200_$i.csv \
    > $R/eager_$i.log 2>&1; echo "bench $i"; grep -E "^(fdpp-eager|fdpp-eager-torch|fdpp-plan-run|fdpp-plan-run-torch|torch-cudnn-eager|flashinfer-eager) " $R/eager_$i.log | head -6
  timeout 60 python3 -m fdpp.bench gemm --eager --model llama3-8b --out $R/gemm_eager_llama3-8b_h200_$i.csv > $R/gemm_eager_$i.log 2>&1
  grep "per eager call" $R/gemm_eager_$i.log
done
tar czf $OUT/resN3.tgz -C /tmp resN3
