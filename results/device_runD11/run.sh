#!/usr/bin/env bash
# The probe script is results/device_runD12/eager_probe.py (unchanged between D11 and D12).
set -uo pipefail
R=/tmp/res11; mkdir -p $R
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
timeout 120 python3 -c "exec(open('.alt/eager_probe.py').read())" 2>&1 | grep -v Warn | tee $R/eager_probe.log | tail -14
tar czf $OUT/res11.tgz -C /tmp res11
