#!/usr/bin/env bash
# Run H9: Nsight Compute of the split and combine kernels, contiguous vs pages of 16 (.dev/ncu_h9.py).
set -uo pipefail
R=/tmp/resH9; mkdir -p $R
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
timeout 200 ncu --clock-control none -k regex:decode --section SpeedOfLight --section LaunchStats --section WarpStateStats \
  --section Occupancy python3 .dev/ncu_h9.py > $R/ncu_h9.txt 2>&1
grep -E "^  void|Duration|DRAM Throughput|Warp Cycles Per Issued|Stall|Achieved Occupancy|Registers Per" $R/ncu_h9.txt | cut -c1-150 | head -120
cp .dev/ncu_h9.py $R/; tar czf $OUT/resH9.tgz -C /tmp resH9
