#!/usr/bin/env bash
# Run Z14. (1) On an H100 only: run Z13's run4.sh (re-tune the H100 table's 12 INT4 entries for run
# Z13's kernel; they are re-stamped plans until then). (2) On any card: INT4 split counts x kernel
# shapes at B = 1 16k / 64k and B = 8 16k / 64k (scripts/probe_int4.py, llama3-8b heads, g64, two-launch
# plans). Run Z13's Nsight Compute found the B = 1, 64k split kernel latency-bound with 2 warps per
# scheduler; this asks whether more CTAs per SM (66 splits: 4 per SM at B = 1) or other shapes pay.
# (3) On an H200: FP8's llama3-8b entries re-tuned with 40 trials, bench, Nsight Compute (below).
set -uo pipefail
R=/tmp/resZ14a; mkdir -p $R
pack() { tar czf $OUT/resZ14a.tgz -C /tmp resZ14a; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
if ! grep -q H200 $R/gpu.txt; then BUDGET=${BUDGET:-300} bash results/device_runZ13/run4.sh; fi
echo "probe $(date -u +%T)"
timeout 120 python3 scripts/probe_int4.py --batch 1,8 --seqlens 16384,65536 --group 64 --splits 33,49,66,99,132 \
  --shapes w4s3u1,w4s2u1,w8s3u1 > $R/probe_splits.log 2>&1
grep -v "^#" $R/probe_splits.log | head -80; pack
# (2b) the same with one-byte K/V kernels of 4 warps compiled for 4 CTAs per SM (__launch_bounds__(128, 4):
# at most 128 registers; on the CPU, sm_90: contiguous INT4 w4 s3 u1 128 -> 111 registers, loop 460 -> 475
# instructions; pages of 16, w4 s2 u1: 138 -> 127 registers, loop 508 -> 526; no spills), one process.
rm -rf /tmp/lbk && cp -r kernels_cu /tmp/lbk
sed -i 's/__launch_bounds__(NUM_WARPS \* 32, 1) decode_split_mma(const DecodeParams p)/__launch_bounds__(NUM_WARPS * 32, (sizeof(DTypeKV) == 1 \&\& NUM_WARPS == 4) ? 4 : 1) decode_split_mma(const DecodeParams p)/' /tmp/lbk/decode_split.cu
grep -c "? 4 : 1) decode_split_mma(" /tmp/lbk/decode_split.cu > $R/lbk_patched.txt
echo "probe lb4 $(date -u +%T) (patched: $(cat $R/lbk_patched.txt))"
timeout 90 python3 scripts/probe_int4.py --kernel-dir /tmp/lbk --batch 1,8 --seqlens 16384,65536 --group 64 --splits 49,66,99,132 \
  --shapes w4s3u1,w4s2u1 > $R/probe_splits_lb4.log 2>&1
grep -v "^#" $R/probe_splits_lb4.log | head -50; pack
grep -q H200 $R/gpu.txt || { echo "done $(date -u +%T)"; exit 0; }
# (3) H200 only: FP8 E4M3's 18 llama3-8b entries re-tuned with 40 trials (run Q8 tuned them with 16; the
# B = 1, 64k plan runs 33 splits, 2 CTAs per SM) into a copy of the table, the bench with FlashInfer
# beside, and Nsight Compute on the B = 1, 64k split kernel as run Z13's call 5 did for INT4.
mkdir -p $R/tuning; cp tuning/NVIDIA_H200.json $R/tuning/
echo "tune fp8 $(date -u +%T)"
timeout 140 python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype fp8_e4m3 --page-size 0,16,64 --batch 1,8 \
  --seqlens 4k,16k,64k --trials 40 --out-dir $R/tuning --seed-table tuning/NVIDIA_H200.json --no-plots --seed 29 \
  --results-dir $R/tune_fp8 > $R/tune_fp8.log 2>&1
tr '\r' '\n' < $R/tune_fp8.log | grep 'fdpp.tune:' | tail -2; grep kve4m3 $R/tune_fp8/tune_NVIDIA_H200.csv | cut -d, -f4,6,7,8,9,12,15,16; pack
for side in shipped retuned; do dir=tuning; [ $side = retuned ] && dir=$R/tuning
  echo "bench fp8 $side $(date -u +%T)"
  FDPP_TUNING_DIR=$dir timeout 70 python3 -m fdpp.bench attn --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k --kv-dtype fp8_e4m3 \
    --page-size 0,16,64 --impls fdpp,flashinfer,floor --out $R/bench_fp8_$side.csv > $R/bench_fp8_$side.log 2>&1
  python3 -c "import sys, pandas as pd; d = pd.read_csv(sys.argv[1]); print(d.pivot_table(index=['batch', 'seqlen', 'page_size'], columns='impl', values='time_us').round(2).to_string())" $R/bench_fp8_$side.csv; pack
done
echo "ncu fp8 $(date -u +%T)"
timeout 60 ncu --clock-control none -k regex:decode_split --launch-skip 20 --launch-count 1 --section SpeedOfLight --section SchedulerStats \
  --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \
  python3 -m fdpp.bench attn --model llama3-8b --batch 1 --seqlens 64k --kv-dtype fp8_e4m3 --page-size 0 --impls fdpp \
  --out $R/ncu_bench.csv > $R/ncu_fp8_b1_64k.txt 2>&1
grep -E "Duration|DRAM Throughput|Issued Ipc|No Eligible|Active Warps|Eligible Warps|Registers|Grid Size|Block Size" $R/ncu_fp8_b1_64k.txt | head -20; pack
echo "done $(date -u +%T)"
