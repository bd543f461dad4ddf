#!/usr/bin/env bash
# Run U3: the FP8-weight path of flat_tma without the K-tail predicates on whole column blocks and
# with two MMA accumulator chains (run U2: 11.4 M instructions and 'wait' / 'barrier' stalls on
# gate_up M = 1). Same probe as U2's shipped row (scripts/probe_gemm_w8.py), more shapes, all four
# projections, and Nsight Compute of gate_up M = 1 again.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-200}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resU3; mkdir -p $R
pack() { tar czf $OUT/resU3.tgz -C /tmp resU3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "probe $(date -u +%T)"; timeout $(left 120) python3 scripts/probe_gemm_w8.py --m 1,8 --layers qkv,o,gate_up,down \
  --shapes w8s8r2x0g1,w4s16r2x0g1,w8s8r3x0g1,w4s16r3x0g1,w8s8r2x0g2,w8s4r4x0g1 --grids wave,tiles > $R/probe.log 2>&1
cat $R/probe.log; pack
M=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' barrier long_scoreboard short_scoreboard \
  math_pipe_throttle mio_throttle wait not_selected selected dispatch_stall lg_throttle no_instruction membar sleeping tex_throttle)
echo "ncu $(date -u +%T)"; timeout $(left 60) ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:flat_tma \
  --metrics "${M}regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active" \
  python3 results/device_runU2/ncu_w8.py gate_up w8 > $R/ncu_w8.txt 2>&1
grep -E "^\s+(smsp__|sm__|dram__|gpu__)" $R/ncu_w8.txt | awk '$NF+0 > 0.3 || /dram|gpu__|inst_executed.sum/'
echo "done $(date -u +%T)"; pack
