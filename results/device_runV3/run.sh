#!/usr/bin/env bash
# Run V3: `python -m fdpp.tune --gemm` (attention buckets, then the model's flat GEMMs, 16-bit and FP8 weights,
# into one --out-dir) on the H200, as scripts/run.sh now runs it (fewer buckets and Ms, to stay short); the
# tables it writes read back by `fdpp.gemm.explain`; the GEMM and tuner GPU tests.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-400}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resV3; mkdir -p $R
pack() { tar czf $OUT/resV3.tgz -C /tmp resV3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
export FDPP_TUNING_DIR=$R/user_empty
echo "tune $(date -u +%T)"
timeout $(left 200) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --seqlens 1k --batch 1 --trials 6 --rounds 1 \
  --gemm --gemm-m 1,8 --gemm-fp8 --out-dir $R/tuning --results-dir $R/results --no-plots > $R/tune.log 2>&1; echo "rc=$?"
tail -5 $R/tune.log; ls $R/tuning; pack
FDPP_TUNING_DIR=$R/tuning timeout 30 python3 -c "
import fdpp.gemm as g
for m in (1, 2, 8):
    print(g.explain(m, 6144, 4096)); print(g.explain(m, 4096, 4096, wfmt='e4m3'))
" > $R/explain.log 2>&1; cat $R/explain.log; pack
echo "tests $(date -u +%T)"; timeout $(left 150) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests/test_gemm.py \
  tests/test_gemm_fp8.py  tests/test_gpu_host.py tests/test_tune_cpu.py > $R/pytest.log 2>&1
grep -E "passed|failed" $R/pytest.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest.log | head -20
echo "done $(date -u +%T)"; pack
