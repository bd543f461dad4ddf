#!/usr/bin/env bash
# Run Z7, sixth call: the GPU tests of the review fixes (9033ba5 and later): tests/test_gpu_rotation.py
# (device check, the gain bar at 1.6) and tests/test_gpu_quant.py (set_descale now also on torch,
# whose per-head descales arrive as a read-only broadcast), with warnings shown.
set -uo pipefail
R=/tmp/resZ7f; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
timeout ${BUDGET:-150} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -rs tests/test_gpu_rotation.py tests/test_gpu_quant.py \
  > $R/pytest.log 2>&1
grep -E "passed|failed" $R/pytest.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest.log | head; grep -c "not writable" $R/pytest.log
tar czf $OUT/resZ7f.tgz -C /tmp resZ7f
