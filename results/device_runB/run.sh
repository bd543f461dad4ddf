#!/usr/bin/env bash
# Run B (final): GPU tests, paged re-tune, bench, eager host cost, sanitizer; one deadline.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-555}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/res; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
tar xzf .cupy_cache.tgz
echo "tests $(date -u +%T)"; timeout $(left 150) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests > $R/pytest_gpu.log 2>&1
echo "tune $(date -u +%T)"; timeout $(left 150) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --page-size 1,16,64 --batch 1,8,64 \
  --seqlens 1k,4k,16k,64k --trials 16 --skip-tuned --out-dir tuning --results-dir $R/tune_paged > $R/tune_paged.log 2>&1
cp tuning/NVIDIA_H200.json $R/
echo "bench $(date -u +%T)"; timeout $(left 110) python3 -m fdpp.bench --model llama3-8b --batch 1,8,64 --seqlens 1k,4k,16k,64k --page-size 0,1,16,64 \
  --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-8b_paged_h200.csv > $R/bench.log 2>&1
echo "eager $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k --impls eager \
  --out $R/eager_llama3-8b_h200.csv > $R/eager.log 2>&1
timeout $(left 40) python3 -m fdpp.bench gemm --eager > $R/gemm_eager.log 2>&1
echo "sanitize $(date -u +%T)"; OUT=$R PYTHON=python3 TOOL_TIMEOUT=$(( ( $(left 400) - 10 ) / 4 )) timeout $(left 400) bash scripts/sanitize.sh > $R/sanitize.log 2>&1
echo "done $(date -u +%T)"
tar czf $OUT/res.tgz -C /tmp res
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED" $R/pytest_gpu.log | head -20
tail -3 $R/tune_paged.log; grep -E "eager|plan-run" $R/eager.log | head; cat $R/gemm_eager.log; tail -15 $R/sanitize.log
