#!/usr/bin/env bash
# Run F2: the tests F1 failed, after fixes (model, HF), and the paged-append graph test three times.
set -uo pipefail
R=/tmp/resF2; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
timeout 150 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rxs tests/test_gpu_model.py tests/test_gpu_hf.py tests/test_gpu_quant.py > $R/pytest_model.log 2>&1
tail -3 $R/pytest_model.log; grep -E "^FAILED|^ERROR|XFAIL" $R/pytest_model.log | head
for i in 1 2 3; do timeout 40 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_paged_cache.py -k "graph_replays_append" > $R/pytest_paged_$i.log 2>&1; tail -1 $R/pytest_paged_$i.log; done
tar czf $OUT/resF2.tgz -C /tmp resF2
