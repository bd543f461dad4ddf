#!/usr/bin/env bash
# Run K4: rmsnorm keeps the row in registers (one load pass); the model GPU tests, the model step
# against the PyTorch reference (fp16 / FP8 / INT4 KV, no-split) and its per-op breakdown again.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-300}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resK4; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
echo "tests $(date -u +%T)"; timeout $(left 90) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_model.py \
  tests/test_gpu_hf.py tests/test_gpu_pdl.py > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head
echo "e2e $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k,128k --batch 1 \
  --kv fp16,fp8,int4 --no-breakdown --out $R/e2e_llama3-8b_b1_h200.csv > $R/e2e.log 2>&1; tail -7 $R/e2e.log
echo "e2e breakdown $(date -u +%T)"; timeout $(left 40) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,64k --batch 1 \
  --kv fp16 --impls fdpp,torch-ref --out $R/e2e_breakdown_h200.csv > $R/e2e_breakdown.log 2>&1
grep -E "norms|step" $R/e2e_breakdown_h200.csv | cut -d, -f1,6,9,10
echo "done $(date -u +%T)"
tar czf $OUT/resK4.tgz -C /tmp resK4
