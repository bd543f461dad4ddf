#!/usr/bin/env bash
# Run S1: the committed unified-max twin kernels on the GPU (tests/test_gpu_unified.py first, then
# the whole GPU suite, which also runs the fused add_rmsnorm against the two kernels it replaces);
# the llama3-8b and llama3-70b TP-8 B = 1 sweeps with fdpp-umax and the peers; the
# llama3-8b model step with the residual add fused into the RMSNorm after it (add_rmsnorm), against
# run Q10's step (fdpp fp16 KV 4.638 / 5.246 ms at 4k / 16k).
# Written 2026-12-04 in a session that had no device time left: not run yet.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-570}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resS1; mkdir -p $R
pack() { tar czf $OUT/resS1.tgz -C /tmp resS1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)" >> $R/gpu.txt 2>&1
echo "unified tests $(date -u +%T)"
timeout $(left 100) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_unified.py > $R/pytest_unified.log 2>&1
grep -E "passed|failed" $R/pytest_unified.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_unified.log | head; pack
echo "tests $(date -u +%T)"; timeout $(left 160) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30; pack
I="fdpp,fdpp-umax,floor,torch-cudnn,torch-flash,flashinfer"
echo "bench8b $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k,4k,16k,64k \
  --impls $I --out $R/attn_llama3-8b_h200.csv > $R/bench8b.log 2>&1
grep -A6 "B=1  time_us" $R/bench8b.log | head -7; pack
echo "bench70b $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --impls $I --out $R/attn_llama3-70b-tp8_h200.csv > $R/bench70b.log 2>&1
grep -A7 "B=1  time_us" $R/bench70b.log | head -8
pack
echo "e2e $(date -u +%T)"; timeout $(left 90) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k --batch 1 --kv fp16 \
  --out $R/e2e_llama3-8b_b1_h200.csv > $R/e2e.log 2>&1; tail -25 $R/e2e.log
echo "done $(date -u +%T)"; pack
