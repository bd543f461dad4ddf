#!/usr/bin/env bash
# Run Z18, call 3 (any card): run Q7's open question. The FP8 split kernel asked the L2 for 25 % more
# sectors than DRAM delivered (5.25 M for 4.20 M at B = 1, 64k; fp16: 8.40 M for 8.39 M). Which unit
# asks for them: the SMs (srcunit_tex) or the other L2 partition (srcunit_ltcfabric)? fp16 and FP8
# E4M3, table plans, llama3-8b heads, contiguous, one launch of the split kernel under Nsight Compute.
set -uo pipefail
R=/tmp/resZ18c; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
M="lts__t_sectors_op_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_ltcfabric_op_read.sum"
M="$M,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum"
M="$M,dram__sectors_read.sum,lts__t_requests_srcunit_tex_op_read.sum,l1tex__m_xbar2l1tex_read_sectors.sum"
M="$M,smsp__inst_executed_op_ldgsts.sum,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed"
for kv in fp8_e4m3 fp16; do
  echo "ncu $kv $(date -u +%T)"
  timeout 100 ncu --clock-control none -k regex:decode_split --launch-skip 20 --launch-count 1 --metrics $M \
    python3 scripts/probe_pipeline.py --kv $kv --batch 1 --seqlens 65536 --shapes= > $R/ncu_l2_$kv.txt 2>&1
  grep -E "decode_split|lts__|dram__|l1tex__|ldgsts|duration" $R/ncu_l2_$kv.txt | head -16
done
cp $R/* $OUT/; echo "done $(date -u +%T)"
