#!/usr/bin/env bash
# Run X3 (NOT RUN; after run2.sh shows a gain, with push_merge_warps.patch applied and the table re-stamped by
# scripts/compare_ptx.py 661efc6 --restamp tuning/NVIDIA_H200.json, and with --gemm/--restamp on tuning/NVIDIA_H200_gemm.json,
# whose entries the common.cuh edit stales too; their PTX does not change): the push cluster merge's table entries re-tuned (the 49 cluster entries, stale since
# decode_split.cu changed; --skip-tuned, seeded with the table's old plans; run R2's commands), then
# the whole GPU suite and the llama3-8b / llama3-70b TP-8 sweeps with the peers on the new table.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-585}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resX3; mkdir -p $R
pack() { cp tuning/NVIDIA_H200.json $R/ 2>/dev/null; tar czf $OUT/resX3.tgz -C /tmp resX3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
export FDPP_TUNING_DIR=$R/user_empty
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "tune $(date -u +%T)"; cp tuning/NVIDIA_H200.json $R/NVIDIA_H200_before.json
T="--out-dir tuning --no-plots --skip-tuned"
timeout $(left 90) python3 -m fdpp.tune --model llama3-8b llama2-7b llama3-70b:8 --dtype fp16,bf16 --trials 12 $T \
  --results-dir $R/tune > $R/tune.log 2>&1
timeout $(left 15) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --batch 64 --seqlens 1k,4k,16k,64k --trials 12 $T \
  --results-dir $R/tune_b64 > $R/tune_b64.log 2>&1
timeout $(left 30) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --page-size 16 --batch 1,8,64 --seqlens 1k,4k,16k,64k \
  --trials 12 $T --results-dir $R/tune_paged > $R/tune_paged.log 2>&1
timeout $(left 40) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype fp8_e4m3 --page-size 0,16,64 --batch 1,8 \
  --seqlens 4k,16k,64k --trials 12 $T --results-dir $R/tune_fp8 > $R/tune_fp8.log 2>&1
timeout $(left 25) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype int4 --page-size 0,16 \
  --batch 1,8 --seqlens 4k,16k,64k --trials 12 $T --results-dir $R/tune_int4 > $R/tune_int4.log 2>&1
for f in $R/tune*.log; do tr '\r' '\n' < $f | grep 'fdpp.tune:' | tail -1; done
python3 -c "
from pathlib import Path; from fdpp import tables, registry
t = tables.read_table(Path('tuning/NVIDIA_H200.json'), registry.device_limits(0))
print('table:', len(t.entries), 'entries kept,', len(t.rejected), 'rejected')" 2>&1 | tail -1; pack
echo "tests $(date -u +%T)"; timeout $(left 190) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30; pack
I="fdpp,floor,torch-cudnn,torch-flash,flashinfer"
echo "bench8b $(date -u +%T)"; timeout $(left 90) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k,4k,16k,64k \
  --impls $I --out $R/attn_llama3-8b_h200.csv > $R/bench8b.log 2>&1
grep -A6 "time_us" $R/bench8b.log | head -9; pack
echo "bench70b $(date -u +%T)"; timeout $(left 70) python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --impls $I --out $R/attn_llama3-70b-tp8_h200.csv > $R/bench70b.log 2>&1
grep -A8 "B=1  time_us" $R/bench70b.log | head -9
echo "done $(date -u +%T)"; pack
