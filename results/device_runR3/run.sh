#!/usr/bin/env bash
# Run R3: on run R2's re-tuned table, the whole GPU suite, then the sweeps with fdpp-umax
# (softmax_mode="unified_max", phi from fdpp.calibrate_unified_max) beside fdpp and the peers:
# llama3-8b B = 1, 8, 64 and llama3-70b TP-8 (fp16), llama3-8b FP8 E4M3 K/V.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-575}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resR3; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)" >> $R/gpu.txt 2>&1
echo "tests $(date -u +%T)"; timeout $(left 200) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
I="fdpp,fdpp-umax,floor,torch-cudnn,torch-flash,flashinfer"
echo "bench8b $(date -u +%T)"; timeout $(left 160) python3 -m fdpp.bench --model llama3-8b --batch 1,8,64 --seqlens 1k,4k,16k,64k \
  --impls $I --out $R/attn_llama3-8b_h200.csv > $R/bench8b.log 2>&1
grep -A8 "B=1  time_us" $R/bench8b.log | head -9; grep -A8 "B=8  time_us" $R/bench8b.log | head -9; grep -A8 "B=64  time_us" $R/bench8b.log | head -9
echo "bench70b $(date -u +%T)"; timeout $(left 80) python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --impls $I --out $R/attn_llama3-70b-tp8_h200.csv > $R/bench70b.log 2>&1
grep -A8 "B=1  time_us" $R/bench70b.log | head -9
echo "bench fp8 $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --kv-dtype fp8_e4m3 --impls fdpp,fdpp-umax,floor,flashinfer --out $R/attn_fp8_llama3-8b_h200.csv > $R/bench_fp8.log 2>&1
grep -A6 "time_us" $R/bench_fp8.log | head -20
echo "done $(date -u +%T)"
tar czf $OUT/resR3.tgz -C /tmp resR3
