#!/usr/bin/env bash
# Run T4: is the L2 prefetch a loss in the model step without the model ops' early trigger (runs T1 /
# T2 had it)? llama3-8b step at 1k / 4k / 16k, interleaved twice: prefetch off, 4 MiB (attention and
# flat_gemm), 4 MiB with flat_gemm's off; then the GEMM bench at 4 MiB.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-200}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resT4; mkdir -p $R
pack() { tar czf $OUT/resT4.tgz -C /tmp resT4; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
OFF="import sys; import fdpp.launch as L; L.prefetch_units = lambda *a, **k: 0; from fdpp import bench; sys.exit(bench.main(sys.argv[1:]))"
E2E="e2e --model llama3-8b --seqlens 1k,4k,16k --batch 1 --kv fp16 --impls fdpp --no-breakdown"
for rep in 1 2; do for v in off pf4 pf4gemmoff; do
  echo "e2e $v $rep $(date -u +%T)"
  case $v in
    off) FDPP_L2_PREFETCH_MB=0 timeout $(left 30) python3 -m fdpp.bench $E2E --out $R/e2e_${v}_$rep.csv > $R/e2e_${v}_$rep.log 2>&1 ;;
    pf4) FDPP_L2_PREFETCH_MB=4 timeout $(left 30) python3 -m fdpp.bench $E2E --out $R/e2e_${v}_$rep.csv > $R/e2e_${v}_$rep.log 2>&1 ;;
    pf4gemmoff) FDPP_L2_PREFETCH_MB=4 timeout $(left 30) python3 -c "$OFF" $E2E --out $R/e2e_${v}_$rep.csv > $R/e2e_${v}_$rep.log 2>&1 ;;
  esac
  grep ITL $R/e2e_${v}_$rep.log
done; done; pack
echo "gemm 4 MiB $(date -u +%T)"; FDPP_L2_PREFETCH_MB=4 timeout $(left 40) python3 -m fdpp.bench gemm --model llama3-8b --m 1,2,4,8,16 \
  --repeats 7 --out $R/gemm_pf4_llama3-8b_h200.csv > $R/gemm_pf4.log 2>&1; grep -A24 "^layer" $R/gemm_pf4.log | head -26
echo "done $(date -u +%T)"; pack
