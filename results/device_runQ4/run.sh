#!/usr/bin/env bash
# Run Q4: the 8-bit path's Q.K MMAs in two accumulation chains (--variant qk-2chains) against the
# shipped source, FP8 E4M3 (scripts/probe_pipeline.py); Nsight Compute stall reasons of the shipped
# FP8 split kernel at B = 1, 64k (results/device_runG4/ncu_int4.py, the table's plan).
set -uo pipefail
END=$((SECONDS + ${BUDGET:-300}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resQ4; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
M=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' barrier long_scoreboard short_scoreboard \
  math_pipe_throttle mio_throttle wait not_selected selected dispatch_stall lg_throttle no_instruction branch_resolving \
  tex_throttle drain imc_miss membar sleeping misc)
echo "ncu $(date -u +%T)"; timeout $(left 90) ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:decode_split_mma \
  --metrics ${M}smsp__inst_executed.sum,smsp__cycles_active.avg,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum \
  python3 results/device_runG4/ncu_int4.py fp8_e4m3 > $R/ncu_fp8_stalls.txt 2>&1; grep -E "smsp__|dram__|gpu__" $R/ncu_fp8_stalls.txt
cd scripts
P="--batch 1,8 --seqlens 16384,65536 --shapes w4s3u1,w8s3u1,w4s4u2,w8s4u1 --splits 16,33"
for v in shipped qk-2chains; do
  echo "$v $(date -u +%T)"; timeout $(left 90) python3 probe_pipeline.py --kv fp8_e4m3 --variant $v $P > $R/probe_fp8_e4m3_$v.log 2>&1; cat $R/probe_fp8_e4m3_$v.log
done
echo "done $(date -u +%T)"
tar czf $OUT/resQ4.tgz -C /tmp resQ4
