#!/usr/bin/env bash
# Run T5: where a B = 1 attention call's time goes (scripts/probe_phases.py: %globaltimer and clock64
# marks at six points of the phase-1 kernels, patched copy of kernels_cu/), the shipped table's plans,
# L2 prefetch off and at 4 MiB.
set -uo pipefail
R=/tmp/resT5; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
timeout 200 python3 scripts/probe_phases.py --prefetch-mb 0,4 2>&1 | tee $R/probe_phases.log
tar czf $OUT/resT5.tgz -C /tmp resT5
