#!/usr/bin/env bash
# Run E7: the contiguous loader with running row pointers: GPU tests of the attention families,
# Nsight Compute durations (B=1, 64k) of FP8 and fp16 split kernels, heuristic sweeps (stale tables).
set -uo pipefail
R=/tmp/resE7; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
timeout 150 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_fp8.py tests/test_gpu_attention.py tests/test_gpu_paged.py tests/test_gpu_fused.py tests/test_hostile_gpu.py > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -20
for cfg in "fp8_e4m3 4 3 1 32" "fp8_e4m3 8 3 1 16" "fp8_e4m3 4 4 1 32" "fp16 4 3 1 16" "fp16 8 3 1 16"; do
  set -- $cfg
  timeout 40 ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:decode_split_mma --section SpeedOfLight --section InstructionStats \
    python3 -c "import sys; sys.argv=['x', '$1', '$2', '$3', '$4', '$5']; exec(open('.dev/ncu_fp8.py').read())" > $R/ncu_$1_$2_$3_$4_$5.txt 2>&1
  echo "== $cfg $(grep -E '^    (Duration|DRAM Throughput|Executed Instructions) ' $R/ncu_$1_$2_$3_$4_$5.txt | awk '{print $1,$(NF)}' | tr '\n' ' ')"
done
tar czf $OUT/resE7.tgz -C /tmp resE7
