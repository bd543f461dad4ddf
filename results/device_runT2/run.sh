#!/usr/bin/env bash
# Run T2: the L2 prefetch as shipped after run T1 (attention: whole chunks of calls of at most
# FDPP_L2_PREFETCH_MB = 8 MiB of K/V, else none; flat_gemm: each CTA at least its first weight tile;
# the GEMM table of run T1's tune, made with the prefetch on). Prefetch / PDL GPU tests, same-process
# A/B sweeps (fdpp against fdpp-nopf), the GEMM bench, the model step three ways (default; GEMM
# prefetch off; every prefetch off), the whole GPU suite.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-480}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resT2; mkdir -p $R
pack() { tar czf $OUT/resT2.tgz -C /tmp resT2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "prefetch tests $(date -u +%T)"
timeout $(left 90) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_prefetch.py tests/test_gpu_pdl.py tests/test_pdl_cpu.py > $R/pytest_prefetch.log 2>&1
grep -E "passed|failed" $R/pytest_prefetch.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_prefetch.log | head; pack
I="fdpp,fdpp-nopf,floor,torch-cudnn,torch-flash,flashinfer"
echo "bench8b $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 1k,4k,16k,64k \
  --impls $I --out $R/attn_llama3-8b_h200.csv > $R/bench8b.log 2>&1
grep -A7 "time_us" $R/bench8b.log | head -18; pack
echo "bench70b $(date -u +%T)"; timeout $(left 50) python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --impls $I --out $R/attn_llama3-70b-tp8_h200.csv > $R/bench70b.log 2>&1
grep -A8 "B=1  time_us" $R/bench70b.log | head -9; pack
echo "gemm $(date -u +%T)"; timeout $(left 40) python3 -m fdpp.bench gemm --model llama3-8b --m 1,2,4,8,16 --repeats 7 --plot \
  --out $R/gemm_llama3-8b_h200.csv > $R/gemm.log 2>&1; grep -A24 "^layer" $R/gemm.log | head -26; pack
OFF="import sys; import fdpp.launch as L; L.prefetch_units = lambda *a, **k: 0; from fdpp import bench; sys.exit(bench.main(sys.argv[1:]))"
E2E="e2e --model llama3-8b --seqlens 1k,4k,16k --batch 1 --kv fp16 --impls fdpp"
for v in default gemmoff alloff default2; do
  echo "e2e $v $(date -u +%T)"
  case $v in
    default*) timeout $(left 40) python3 -m fdpp.bench $E2E --out $R/e2e_$v.csv > $R/e2e_$v.log 2>&1 ;;
    gemmoff) timeout $(left 40) python3 -c "$OFF" $E2E --out $R/e2e_$v.csv > $R/e2e_$v.log 2>&1 ;;
    alloff) FDPP_L2_PREFETCH_MB=0 timeout $(left 40) python3 -m fdpp.bench $E2E --out $R/e2e_$v.csv > $R/e2e_$v.log 2>&1 ;;
  esac
  grep -E "ITL" $R/e2e_$v.log | head -3
done; pack
echo "tests $(date -u +%T)"; timeout $(left 170) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
echo "done $(date -u +%T)"; pack
