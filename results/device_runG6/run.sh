#!/usr/bin/env bash
# Run G6 (final check): the whole GPU suite on the final tree (the output reuse's lock), the eager
# host-cost bench and the host profile.
set -uo pipefail
R=/tmp/resG6; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
echo "tests $(date -u +%T)"; timeout 170 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -20
echo "eager $(date -u +%T)"; timeout 45 python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k \
  --impls eager --out $R/eager_llama3-8b_h200.csv > $R/eager.log 2>&1
timeout 60 python3 scripts/host_profile.py --profile-calls 5000 --out $R/host_profile_h200.csv > $R/host_profile.log 2>&1
echo "done $(date -u +%T)"
tar czf $OUT/resG6.tgz -C /tmp resG6
grep -E "eager|plan" $R/eager.log | head -10
grep -E "^  (cupy|torch) +(fdpp.decode_attention|DecodePlan.run) |CUDNN|flashinfer" $R/host_profile.log | head -8
