#!/usr/bin/env bash
# Run Z9, call 1, for whatever card comes.
# Any card: (a) INT4 with the whole cache head-major (quantize_kv(..., kv_layout="HND"): codes,
# scales and zeros) against quantize_kv's NHD layout, scripts/probe_int4.py on the shipped table's
# plans, llama3-8b heads, g64 (run Z8 measured -3.6 % at 64k for head-major parameters alone).
# An H200 only: (b) the whole GPU suite (last on an H200 in run Y1, at 28f3645); (c) run Z8's
# unrun run2.sh, run as it is: the llama3-70b TP-8 half-group re-tune into a copy of the H200 table and
# the bench of shipped vs re-tuned, with cuDNN, flash and FlashInfer.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-560}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ9a; mkdir -p $R
pack() { tar czf $OUT/resZ9a.tgz -C /tmp resZ9a; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
probe() {  # name, probe arguments
  echo "== probe $1 $(date -u +%T)"
  timeout $(left 60) python3 scripts/probe_int4.py "${@:2}" --batch 1,8 --seqlens 16384,65536 > $R/probe_$1.log 2>&1
  grep -v "^ *$" $R/probe_$1.log | tail -5
}
probe nhd
probe hnd --kv-layout HND
probe nhd_again
pack
grep -q H200 $R/gpu.txt || { echo "not an H200: done"; exit 0; }
BUDGET=$((END - SECONDS)) bash results/device_runZ8/run2.sh  # (b) and (c): its output in $OUT/resZ8b.tgz
