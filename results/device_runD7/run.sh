#!/usr/bin/env bash
# Run D7: the whole GPU suite on the final tree (default launcher), and the eager rows once more.
set -uo pipefail
R=/tmp/res7; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
git log --oneline -1 > $R/commit.txt 2>/dev/null
timeout 200 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -20
timeout 60 python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k --impls eager --out $R/eager_llama3-8b_h200.csv > $R/eager.log 2>&1
grep -E "^(fdpp|flash|torch)" $R/eager.log | head -8
tar czf $OUT/res7.tgz -C /tmp res7
