#!/usr/bin/env bash
# Run E6: instruction mix of the FP8 split kernel (B=1, N=64k, w8 s3 u1, 16 splits) and its SASS.
set -uo pipefail
R=/tmp/resE6; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cc6
timeout 120 ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:decode_split_mma --section InstructionStats --print-details all \
  python3 -c "import sys; sys.argv=['x', 'fp8_e4m3', '8', '3', '1', '16']; exec(open('.dev/ncu_fp8.py').read())" > $R/ncu_mix.txt 2>&1
grep -A60 "Instruction Statistics" $R/ncu_mix.txt | head -70
ls /tmp/cc6 | head; which cuobjdump nvdisasm
for f in $(grep -l "decode_split_mma" /tmp/cc6/* 2>/dev/null | head -3); do (cuobjdump -sass $f || nvdisasm $f) > $R/sass_$(basename $f).txt 2>&1; done
ls -la $R
tar czf $OUT/resE6.tgz -C /tmp resE6
