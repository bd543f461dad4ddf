#!/usr/bin/env bash
# Run Z17, call 3 (any card): compute-sanitizer's racecheck and synccheck over the quantizer and cache
# families (quantize_kv, the quantizing paged append, PagedKVCache append / extend), into resZ17d.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD CUPY_CACHE_DIR=$PWD/.cupy_cache PYTHON=python3
mkdir -p /tmp/resZ17d; nvidia-smi --query-gpu=name,driver_version --format=csv > /tmp/resZ17d/gpu.txt
OUT=/tmp/resZ17d TOOLS="racecheck synccheck" FAMILIES=quantized,cache TOOL_TIMEOUT=100 bash scripts/sanitize.sh
echo "sanitize rc $?"; cp /tmp/resZ17d/* $OUT/; echo "done $(date -u +%T)"
