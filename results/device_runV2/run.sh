#!/usr/bin/env bash
# Run V2: the final code of this session (the GEMM engine work of run V1, plus the attention bench timing every
# implementation of a point interleaved, fdpp.timing.time_round_robin): the whole GPU suite, then the llama3-8b
# (B = 1, 8) and llama3-70b TP-8 sweeps with the peers, interleaved; a short GEMM bench.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-540}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resV2; mkdir -p $R
pack() { tar czf $OUT/resV2.tgz -C /tmp resV2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
export FDPP_TUNING_DIR=$R/user_empty  # the shipped tables only
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "tests $(date -u +%T)"; timeout $(left 220) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30; pack
I="fdpp,fdpp-prefetch,floor,torch-cudnn,torch-flash,flashinfer"
echo "bench8b $(date -u +%T)"; timeout $(left 110) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 1k,4k,16k,64k \
  --impls $I --out $R/attn_llama3-8b_h200.csv > $R/bench8b.log 2>&1
grep -A8 "time_us" $R/bench8b.log | head -20; grep -i "interleaved timing failed\|failed at" $R/bench8b.log | head -5; pack
echo "bench70b $(date -u +%T)"; timeout $(left 70) python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --impls $I --out $R/attn_llama3-70b-tp8_h200.csv > $R/bench70b.log 2>&1
grep -A8 "B=1  time_us" $R/bench70b.log | head -9; grep -i "interleaved timing failed\|failed at" $R/bench70b.log | head -5; pack
echo "gemm $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench gemm --model llama3-8b --layers qkv,o --m 1,8 --weights fp8 \
  --repeats 7 --out $R/gemm.csv > $R/gemm.log 2>&1; grep -A12 "^layer" $R/gemm.log | head -14
echo "done $(date -u +%T)"; pack
