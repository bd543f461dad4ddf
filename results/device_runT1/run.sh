#!/usr/bin/env bash
# Run T1: the L2 prefetch before the PDL wait (attention: each CTA's first K/V rows; flat_gemm: each
# CTA's first weight tiles; model ops trigger their PDL successor at their start). GPU tests of the
# prefetch and of PDL first, then same-process A/B sweeps (fdpp against fdpp-nopf: the same plan
# with the prefetch off), the budget at 4 / 64 MiB, the GEMM table re-tuned with the prefetch on and
# benched with it off, the model step with it on and off, FP8, and the whole GPU suite last.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-560}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resT1; mkdir -p $R
pack() { tar czf $OUT/resT1.tgz -C /tmp resT1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "prefetch tests $(date -u +%T)"
timeout $(left 90) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_prefetch.py tests/test_gpu_pdl.py > $R/pytest_prefetch.log 2>&1
grep -E "passed|failed" $R/pytest_prefetch.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_prefetch.log | head; pack
I="fdpp,fdpp-nopf,floor,torch-cudnn,flashinfer"
echo "bench8b $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k,4k,16k,64k \
  --impls $I --out $R/attn_llama3-8b_h200.csv > $R/bench8b.log 2>&1
grep -A7 "B=1  time_us" $R/bench8b.log | head -8; pack
echo "bench70b $(date -u +%T)"; timeout $(left 50) python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --impls $I --out $R/attn_llama3-70b-tp8_h200.csv > $R/bench70b.log 2>&1
grep -A7 "B=1  time_us" $R/bench70b.log | head -8; pack
echo "bench8b B=8 $(date -u +%T)"; timeout $(left 50) python3 -m fdpp.bench --model llama3-8b --batch 8 --seqlens 1k,4k,16k \
  --impls $I --out $R/attn_llama3-8b_b8_h200.csv > $R/bench8b_b8.log 2>&1
grep -A7 "B=8  time_us" $R/bench8b_b8.log | head -8; pack
for MB in 4 64; do
  echo "bench8b budget $MB MiB $(date -u +%T)"; FDPP_L2_PREFETCH_MB=$MB timeout $(left 30) python3 -m fdpp.bench --model llama3-8b \
    --batch 1 --seqlens 1k,4k,16k,64k --impls fdpp,fdpp-nopf,floor --out $R/attn_llama3-8b_mb$MB.csv > $R/bench8b_mb$MB.log 2>&1
  grep -A5 "B=1  time_us" $R/bench8b_mb$MB.log | head -6
done; pack
echo "gemm tune $(date -u +%T)"; timeout $(left 100) python3 -m fdpp.bench gemm --model llama3-8b --m 1,2,4,8,16 --tune \
  --table $R/NVIDIA_H200_gemm.json --repeats 7 --out $R/gemm_llama3-8b_h200.csv > $R/gemm.log 2>&1
grep -A24 "^layer" $R/gemm.log | head -26; pack
echo "gemm no prefetch $(date -u +%T)"; FDPP_L2_PREFETCH_MB=0 timeout $(left 40) python3 -m fdpp.bench gemm --model llama3-8b \
  --m 1,2,4,8,16 --table $R/NVIDIA_H200_gemm.json --repeats 7 --out $R/gemm_nopf_llama3-8b_h200.csv > $R/gemm_nopf.log 2>&1
grep -A24 "^layer" $R/gemm_nopf.log | head -26; pack
for MB in 16 0; do
  echo "e2e prefetch $MB MiB $(date -u +%T)"; FDPP_GEMM_TABLE=$R/NVIDIA_H200_gemm.json FDPP_L2_PREFETCH_MB=$MB timeout $(left 60) \
    python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k --batch 1 --kv fp16 --impls fdpp,torch-ref \
    --out $R/e2e_mb$MB.csv > $R/e2e_mb$MB.log 2>&1; tail -5 $R/e2e_mb$MB.log
done; pack
echo "fp8 $(date -u +%T)"; timeout $(left 40) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 4k,16k,64k \
  --kv-dtype fp8_e4m3 --impls fdpp,fdpp-nopf,floor,flashinfer --out $R/attn_fp8_llama3-8b_h200.csv > $R/bench_fp8.log 2>&1
grep -A6 "B=1  time_us" $R/bench_fp8.log | head -7; pack
echo "tests $(date -u +%T)"; timeout $(left 170) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
echo "done $(date -u +%T)"; pack
