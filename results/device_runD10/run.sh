#!/usr/bin/env bash
set -uo pipefail
R=/tmp/res10; mkdir -p $R
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
P=$PWD/.alt/ncu_probe.py
for t in . .base; do
  ( cd $t && PYTHONPATH=$PWD timeout 120 ncu --clock-control none -k regex:"decode" --launch-count 4 \
      --section SpeedOfLight --section LaunchStats python3 -c "exec(open('$P').read())" > $R/ncu_$(basename $t).txt 2>&1 )
  echo "== $t"; grep -E "fdpp::decode|Duration|DRAM Throughput|Grid Size|fdpp:|runs:" $R/ncu_$(basename $t).txt | head -20
done
tar czf $OUT/res10.tgz -C /tmp res10
