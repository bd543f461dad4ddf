#!/usr/bin/env bash
set -uo pipefail
R=/tmp/resE4; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
for cfg in "fp8_e4m3 4 3 1 32" "fp8_e4m3 8 3 1 16" "fp16 4 3 1 16"; do
  set -- $cfg
  timeout 120 ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:decode_split_mma --set full \
    python3 -c "import sys; sys.argv=['x', '$1', '$2', '$3', '$4', '$5']; exec(open('.dev/ncu_fp8.py').read())" > $R/ncu_$1_$2_$3_$4_$5.txt 2>&1
  echo "== $cfg"; grep -E "^    (Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Registers Per Thread|Achieved Occupancy|Issue Slots Busy|Executed Ipc Active|No Eligible|One or More Eligible)" $R/ncu_$1_$2_$3_$4_$5.txt | head -14
  grep -iE "stall|bank" $R/ncu_$1_$2_$3_$4_$5.txt | head -8
done
tar czf $OUT/resE4.tgz -C /tmp resE4
