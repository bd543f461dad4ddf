#!/usr/bin/env bash
# Run G3: compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over the quantized caches
# (FP8 and INT4, contiguous and paged), the combine and fused merges (batched merge loads); the
# end-to-end llama3-8b step with fp16, FP8 and INT4 KV caches; the tuned plan against its one-launch
# form at 1k / 4k (graph-timed).
set -uo pipefail
END=$((SECONDS + ${BUDGET:-470}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resG3; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
echo "probe $(date -u +%T)"; timeout $(left 60) python3 .dev/probe_fused.py > $R/probe_fused.log 2>&1; cat $R/probe_fused.log | tail -8
echo "e2e $(date -u +%T)"; timeout $(left 150) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k,128k --batch 1 \
  --kv fp16,fp8,int4 --no-breakdown --out $R/e2e_llama3-8b_b1_h200.csv > $R/e2e.log 2>&1; tail -22 $R/e2e.log
echo "sanitize $(date -u +%T)"; OUT=$R FAMILIES=quantized,decode_combine,fused TOOL_TIMEOUT=$(left 200) \
  timeout $(left 260) bash scripts/sanitize.sh > $R/sanitize.log 2>&1; echo "sanitize rc=$?"; grep -E "ERROR SUMMARY|errors|rc|status" $R/sanitize_report.txt | head -20
echo "done $(date -u +%T)"
tar czf $OUT/resG3.tgz -C /tmp resG3
