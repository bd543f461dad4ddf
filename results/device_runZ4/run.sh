#!/usr/bin/env bash
# Run Z4: FP8 V tiles without padding (decode_split.cu VSWZ: 8-bit V rows of >= 128 bytes keep their
# 128-byte shared-memory lines, 16-byte chunks swapped within them, instead of rows padded by 16
# bytes that straddle two lines; run Z3's Nsight Compute found 1.25 L2 sectors read per DRAM sector
# there). (1) the GPU tests of FP8 caches (test_gpu_fp8.py, test_gpu_quant.py, -k fp8 / e4m3 / e5m2 /
# quant of the other GPU files); (2) the FP8 kernel at the table's plans and at w4s3u1 / w8s3u1 x
# 16 / 33 splits, this tree against .old_kernels/ (commit 3eef859), one process each, with the
# stream-read floor; (3) Nsight Compute sectors of the new kernel; (4) with the time left, the 18 FP8 buckets the
# change left stale re-tuned into a copy of this GPU's table (the Y3 / Y4 FP8 commands, --skip-tuned).
set -uo pipefail
END=$((SECONDS + ${BUDGET:-580}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ4; mkdir -p $R/tuning
pack() { tar czf $OUT/resZ4.tgz -C /tmp resZ4; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
TABLE=tuning/NVIDIA_H200.json; J=8
grep -q H100 $R/gpu.txt && { TABLE=tuning/NVIDIA_H100_80GB_HBM3.json; J=4; }  # -n 8 ran out of memory on 80 GB (Z3)
echo "fp8 tests $(date -u +%T)"  # only the FP8 kernels' instructions changed (scripts/compare_ptx.py)
timeout $(left 120) python3 -m pytest -q -m gpu -n $J -p no:cacheprovider -rs tests/test_gpu_fp8.py tests/test_gpu_quant.py \
  > $R/pytest_fp8.log 2>&1
timeout $(left 120) python3 -m pytest -q -m gpu -n $J -p no:cacheprovider -rs -k "fp8 or e4m3 or e5m2 or quant" \
  $(ls tests/test_gpu*.py | grep -v -e test_gpu_fp8.py -e test_gpu_quant.py) > $R/pytest_fp8_other.log 2>&1
for f in $R/pytest_fp8*.log; do grep -E "passed|failed" $f | tail -1; grep -E "^FAILED|^ERROR" $f | head -20; done; pack
echo "fp8 a/b $(date -u +%T)"
cd scripts
for side in new old; do
  kd=""; [ $side = old ] && kd="--kernel-dir ../.old_kernels"
  timeout $(left 55) python3 probe_pipeline.py $kd --kv fp8_e4m3 --batch 1,8 --seqlens 16384,65536 --shapes w4s3u1 \
    --splits 33 > $R/fp8_$side.log 2>&1
  echo "== $side"; grep -v Warning $R/fp8_$side.log
done; cd ..; pack
echo "ncu $(date -u +%T)"
M=l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_read.sum,dram__sectors_read.sum,gpu__time_duration.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum
CUPY_CACHE_DIR=/tmp/cupy_lineinfo timeout $(left 60) ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:decode_split_mma \
  --metrics $M --section SourceCounters python3 results/device_runZ3/ncu_kv.py fp8_e4m3 NHD > $R/ncu_fp8_e4m3.txt 2>&1
grep -E "^\s+(l1tex|lts|dram|gpu__)|decode_split_mma<|Excessive" $R/ncu_fp8_e4m3.txt | head -12
echo "fp8 tune $(date -u +%T)"
cp $TABLE $R/tuning/
timeout $(left 200) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype fp8_e4m3 --page-size 0,16,64 --batch 1,8 \
  --seqlens 4k,16k,64k --trials 12 --out-dir $R/tuning --no-plots --skip-tuned --seed 11 --results-dir $R/tune_fp8 \
  > $R/tune_fp8.log 2>&1
tr '\r' '\n' < $R/tune_fp8.log | grep 'fdpp.tune:' | tail -2; pack
echo "done $(date -u +%T)"; pack
