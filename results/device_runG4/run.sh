#!/usr/bin/env bash
# Run G4: Nsight Compute of the split kernel at llama3-8b heads, B=1, N=64k (shipped plans): INT4,
# FP8 E4M3 and fp16, for the next step on the quantized kernels.
set -uo pipefail
R=/tmp/resG4; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
for f in int4 fp8_e4m3 fp16; do
  timeout 100 ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:decode_split_mma --set full \
    python3 .dev/ncu_int4.py $f > $R/ncu_$f.txt 2>&1
  echo "== $f"; grep -E "^    (Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Executed Ipc Active|No Eligible|One or More Eligible|Block Limit Registers|Block Limit Shared Mem|Dynamic Shared Memory Per Block|Grid Size|Block Size|Executed Instructions )" $R/ncu_$f.txt | head -22
  grep -E "^    (-|  )?.*(stall|Stall)" $R/ncu_$f.txt | head -6
  grep -E "decode_split_mma<" $R/ncu_$f.txt | head -1 | cut -c1-200
done
tar czf $OUT/resG4.tgz -C /tmp resG4
