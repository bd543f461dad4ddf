#!/usr/bin/env bash
# Run D4: GPU tests; llama3-8b sweep (contiguous + paged, peers, two-launch), llama3-70b TP-8 share
# sweep 1k-256k (peers); eager host cost; host profile; sanitizer. One deadline.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-570}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/res4; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "tests $(date -u +%T)"; timeout $(left 150) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -20
echo "bench8b $(date -u +%T)"; timeout $(left 200) python3 -m fdpp.bench --model llama3-8b --batch 1,8,64 --seqlens 1k,4k,16k,64k \
  --page-size 0,1,16,64 --impls fdpp,fdpp-two-launch,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-8b_h200.csv > $R/bench8b.log 2>&1
echo "bench70b $(date -u +%T)"; timeout $(left 90) python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --impls fdpp,fdpp-two-launch,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-70b-tp8_h200.csv > $R/bench70b.log 2>&1
echo "eager $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k --impls eager \
  --out $R/eager_llama3-8b_h200.csv > $R/eager.log 2>&1
timeout $(left 30) python3 -m fdpp.bench gemm --eager --out $R/gemm_eager_h200.csv > $R/gemm_eager.log 2>&1
echo "profile $(date -u +%T)"; timeout $(left 70) python3 scripts/host_profile.py --out $R/host_profile_h200.csv > $R/host_profile.log 2>&1
echo "sanitize $(date -u +%T)"; OUT=$R PYTHON=python3 TOOL_TIMEOUT=$(( ( $(left 300) - 10 ) / 4 )) timeout $(left 300) bash scripts/sanitize.sh > $R/sanitize.log 2>&1
echo "done $(date -u +%T)"
tar czf $OUT/res4.tgz -C /tmp res4
grep -E "eager|plan" $R/eager.log | head -12; tail -4 $R/gemm_eager.log; tail -12 $R/sanitize.log
