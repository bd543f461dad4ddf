#!/usr/bin/env bash
# Run U2: what bounds flat_gemm on FP8 weights (run U1: 60-70 % of its floor on qkv, gate_up, down
# at M = 1, where the 16-bit kernel reaches 87-95 %). The E4M3 conversion replaced by integer bit
# moves / by nothing (scripts/probe_gemm_w8.py --variant, timing only), Nsight Compute stall
# reasons of gate_up M = 1 with FP8 and 16-bit weights, and the fixed FP8 GEMM GPU test.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-300}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resU2; mkdir -p $R
pack() { tar czf $OUT/resU2.tgz -C /tmp resU2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
export FDPP_GEMM_TABLE=$PWD/results/device_runU1/NVIDIA_H200_gemm.json
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "test $(date -u +%T)"; timeout $(left 60) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gemm_fp8.py > $R/pytest_w8.log 2>&1
grep -E "passed|failed" $R/pytest_w8.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_w8.log | head; pack
for v in shipped alu none; do
  echo "probe $v $(date -u +%T)"; timeout $(left 60) python3 scripts/probe_gemm_w8.py --variant $v --m 1 --layers qkv,gate_up \
    --shapes w8s8r2x0g1,w4s16r2x0g1,w8s4r4x0g1 --grids wave > $R/probe_$v.log 2>&1; cat $R/probe_$v.log; pack
done
M=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' barrier long_scoreboard short_scoreboard \
  math_pipe_throttle mio_throttle wait not_selected selected dispatch_stall lg_throttle no_instruction membar sleeping tex_throttle)
for f in w8 f16; do
  echo "ncu $f $(date -u +%T)"; timeout $(left 60) ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:flat_tma \
    --metrics "${M}regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,lts__t_sectors_srcunit_tex_op_read.sum,dram__sectors_read.sum,smsp__issue_active.avg.pct_of_peak_sustained_active" \
    python3 results/device_runU2/ncu_w8.py gate_up $f > $R/ncu_$f.txt 2>&1
  grep -E "^\s+(smsp__|sm__|dram__|gpu__|l1tex|lts)" $R/ncu_$f.txt | awk '$NF+0 > 0.3 || /dram|gpu__|lts|inst_executed.sum/'
done
echo "done $(date -u +%T)"; pack
