#!/usr/bin/env bash
# Run T3: the committed state after runs T1 / T2 (the L2 prefetch off by default; the bench's
# fdpp-prefetch row turns it on at 4 MiB; the model-op kernels without the early trigger; run J3's
# GEMM table re-stamped): prefetch / PDL GPU tests, llama3-8b B = 1 A/B, the model step.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-200}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resT3; mkdir -p $R
pack() { tar czf $OUT/resT3.tgz -C /tmp resT3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
echo "tests $(date -u +%T)"
timeout $(left 70) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_prefetch.py tests/test_gpu_pdl.py tests/test_gpu_model.py > $R/pytest.log 2>&1
grep -E "passed|failed" $R/pytest.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest.log | head; pack
echo "bench8b $(date -u +%T)"; timeout $(left 40) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k,4k,16k \
  --impls fdpp,fdpp-prefetch,floor,torch-cudnn --out $R/attn_llama3-8b_h200.csv > $R/bench8b.log 2>&1
grep -A6 "B=1  time_us" $R/bench8b.log | head -7; pack
echo "e2e $(date -u +%T)"; timeout $(left 40) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 1k,4k,16k --batch 1 --kv fp16 \
  --impls fdpp --no-breakdown --out $R/e2e.csv > $R/e2e.log 2>&1; grep ITL $R/e2e.log
echo "done $(date -u +%T)"; pack
