#!/usr/bin/env bash
# Run T9: compute-sanitizer (racecheck, synccheck, memcheck) on the cluster merge with its split
# last barrier, and on the paged and bad-length families, with the L2 prefetch on (64 MiB budget:
# every PDL call small enough prefetches its whole chunks, block-table hint reads included).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache FDPP_L2_PREFETCH_MB=64
OUT=$OUT TOOLS="racecheck synccheck memcheck" FAMILIES=cluster,paged,bad_lengths TOOL_TIMEOUT=75 PYTHON=python3 \
  bash scripts/sanitize.sh; echo "sanitize rc=$?"
cat $OUT/sanitize_report.txt | head -60
