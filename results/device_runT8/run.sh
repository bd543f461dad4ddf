#!/usr/bin/env bash
# Run T8: the quantized sweeps on the shipped state (the cluster merge's split barrier changed the
# FP8 / INT4 cluster variants too; their entries were re-stamped): FP8 E4M3 against FlashInfer's
# FP8 decode at B = 1, 8 x 4k / 16k / 64k x contiguous / pages of 16 / 64, INT4 against fdpp fp16.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-150}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resT8; mkdir -p $R
pack() { tar czf $OUT/resT8.tgz -C /tmp resT8; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
echo "fp8 $(date -u +%T)"; timeout $(left 75) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --page-size 0,16,64 --kv-dtype fp8_e4m3 --impls fdpp,floor,flashinfer --out $R/attn_fp8_llama3-8b_h200.csv > $R/bench_fp8.log 2>&1
grep -A5 "time_us" $R/bench_fp8.log | head -40; pack
echo "int4 $(date -u +%T)"; timeout $(left 45) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --page-size 0,16 --kv-dtype int4 --out $R/attn_int4_llama3-8b_h200.csv > $R/bench_int4.log 2>&1
tail -25 $R/bench_int4.log
echo "done $(date -u +%T)"; pack
