#!/usr/bin/env bash
set -uo pipefail
R=/tmp/res12; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
timeout 120 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_fused.py tests/test_gpu_host.py tests/test_gpu_merge.py tests/test_gpu_attention.py > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head
timeout 60 python3 -c "exec(open('.alt/eager_probe.py').read())" 2>&1 | grep -v Warn | tee $R/eager_probe.log | tail -10
tar czf $OUT/res12.tgz -C /tmp res12
