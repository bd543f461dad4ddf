#!/usr/bin/env bash
# Run Z3 (an H200, or an H100: its own table, and no heuristic probe: Z1 ran it there): (1) the whole GPU suite with the heuristic's cluster merge for every GQA ratio
# (run Z1 ran it on an H100; run Z2's script, never lent an H200) and with the INT4 kernels' code
# extraction of one shift per word (kv_cache.cuh KvDecode<int4_t>::codes); (2) run Z1's heuristic
# probe on the H200; (3) INT4 at the table's plans, this tree against .old_kernels/ (the kernels of
# commit 3eef859), one process each; (4) the 12 INT4 buckets the kernel change left stale re-tuned
# (--skip-tuned, run Y4's INT4 command) into a copy of the H200 table; (5) Nsight Compute on the
# table's FP8 kernel at llama3-8b B = 1, 64k (ncu_kv.py, -lineinfo): per-instruction L2 sectors and
# cp.async sectors per request, to find run Q7's 25 % extra L2 sector reads.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-580}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ3; mkdir -p $R/tuning
pack() { tar czf $OUT/resZ3.tgz -C /tmp resZ3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
echo "suite $(date -u +%T)"
timeout $(left 240) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30; pack
echo "int4 a/b $(date -u +%T)"
for side in new old; do
  kd=""; [ $side = old ] && kd="--kernel-dir .old_kernels"
  timeout $(left 45) python3 scripts/probe_int4.py $kd --batch 1,8 --seqlens 16384,65536 > $R/int4_$side.log 2>&1
  echo "== $side"; grep -v Warning $R/int4_$side.log
done; pack
echo "int4 tune $(date -u +%T)"
TABLE=tuning/NVIDIA_H200.json; grep -q H100 $R/gpu.txt && TABLE=tuning/NVIDIA_H100_80GB_HBM3.json
cp $TABLE $R/tuning/
timeout $(left 80) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype int4 --page-size 0,16 --batch 1,8 \
  --seqlens 4k,16k,64k --trials 12 --out-dir $R/tuning --no-plots --skip-tuned --seed 11 --results-dir $R/tune_int4 \
  > $R/tune_int4.log 2>&1
tr '\r' '\n' < $R/tune_int4.log | grep 'fdpp.tune:' | tail -2; pack
echo "ncu $(date -u +%T)"
M=l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ldgsts.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_read.sum,dram__sectors_read.sum,gpu__time_duration.sum
for f in fp8_e4m3 fp16; do
  CUPY_CACHE_DIR=/tmp/cupy_lineinfo timeout $(left 60) ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:decode_split_mma \
    --metrics $M --section SourceCounters --print-details all \
    python3 results/device_runZ3/ncu_kv.py $f NHD > $R/ncu_$f.txt 2>&1
  echo "== $f"; grep -E "ptr|^\s+(l1tex|lts|dram|gpu__)|decode_split_mma<" $R/ncu_$f.txt | head -12
  grep -B2 -A14 -iE "uncoalesced|excessive" $R/ncu_$f.txt | head -40; pack
done
grep -q H100 $R/gpu.txt && { echo "an H100: no probe (Z1 ran it)"; pack; exit 0; }
echo "probe $(date -u +%T)"
timeout $(left 150) python3 scripts/probe_cluster.py --heuristic --heads 28/4,16/8,40/8,12/2,32/8 --batch 1,8 \
  --seqlens 1024,2048,4096 > $R/probe_heuristic.log 2>&1; grep -v Warning $R/probe_heuristic.log
echo "done $(date -u +%T)"; pack
