#!/usr/bin/env bash
# Run Z14, call 3 (any card): where the warps of the B = 1, 64k split kernels wait. Nsight Compute's
# stall reasons (smsp__average_warps_issue_stalled_*_per_issue_active: cycles a warp spends in each state
# per issued instruction) for INT4 g64, FP8 E4M3 and fp16 on the shipped table's plans, llama3-8b heads,
# contiguous. Run Z13's call 5 had only the totals (an instruction every 2.1 cycles, 0.66 eligible warps
# of 1.97).
set -uo pipefail
R=/tmp/resZ14c; mkdir -p $R
pack() { tar czf $OUT/resZ14c.tgz -C /tmp resZ14c; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
ST=""
for s in barrier branch_resolving dispatch_stall drain imc_miss lg_throttle long_scoreboard math_pipe_throttle membar \
         mio_throttle misc no_instruction not_selected selected short_scoreboard sleeping tex_throttle wait; do
  ST="$ST,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"; done
ST="${ST#,},smsp__warps_active.avg.per_cycle_active,smsp__issue_active.avg.per_cycle_active,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed"
ST="$ST,smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed_pipe_lsu.sum"
for kv in int4 fp8_e4m3 fp16; do  # the probes time only the table's plan for the point (no other kernels)
  echo "ncu $kv $(date -u +%T)"
  P="scripts/probe_pipeline.py --kv $kv --batch 1 --seqlens 65536 --shapes="
  [ $kv = int4 ] && P="scripts/probe_int4.py --batch 1 --seqlens 65536 --group 64"
  timeout 100 ncu --clock-control none -k regex:decode_split --launch-skip 20 --launch-count 1 --metrics $ST \
    python3 $P > $R/ncu_stalls_$kv.txt 2>&1
  grep -E "decode_split|stalled|warps_active|issue_active|duration|dram__|inst_executed|wavefronts" $R/ncu_stalls_$kv.txt \
    | sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | head -32; pack
done
echo "done $(date -u +%T)"
