#!/usr/bin/env bash
# Run Q7: what bounds the FP8 kernel at B = 1, 64k now (the VT kernel of run Q6)? Nsight Compute pipe
# utilisation and stall reasons of the table's plan (results/device_runG4/ncu_int4.py), and the probe
# with E4M3 "decoded" by an and / a shift instead of the cvt pair (--variant e4m3-lop: wrong values,
# timing only) beside the shipped source (scripts/probe_pipeline.py).
set -uo pipefail
END=$((SECONDS + ${BUDGET:-300}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resQ7; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
M=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' barrier long_scoreboard short_scoreboard \
  math_pipe_throttle mio_throttle wait not_selected selected dispatch_stall lg_throttle no_instruction)
for f in fp8_e4m3 fp16; do
echo "ncu $f $(date -u +%T)"; timeout $(left 60) ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:decode_split_mma \
  --metrics "${M}regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,lts__t_sectors_srcunit_tex_op_read.sum,dram__sectors_read.sum" \
  python3 results/device_runG4/ncu_int4.py $f > $R/ncu_${f}.txt 2>&1; grep -E "^\s+(smsp__|sm__|dram__|gpu__|l1tex|lts)" $R/ncu_${f}.txt | awk '$NF+0 > 0.5 || /dram|gpu__|lts|l1tex/'
done
cd scripts
P="--kv fp8_e4m3 --batch 1 --seqlens 16384,65536 --shapes w4s3u1,w8s3u1,w4s4u1 --splits 16,33"
for v in shipped e4m3-lop; do
  echo "$v $(date -u +%T)"; timeout $(left 60) python3 probe_pipeline.py --variant $v $P > $R/probe_fp8_$v.log 2>&1; cat $R/probe_fp8_$v.log
done
echo "done $(date -u +%T)"
tar czf $OUT/resQ7.tgz -C /tmp resQ7
