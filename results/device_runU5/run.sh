#!/usr/bin/env bash
# Run U5: the final state's FP8-weight GPU tests (two test plans fixed after run U4, the torch custom
# op's w_scale), the host-path tests (custom ops), and the FP8-weight model test, on the shipped
# (run U4) GEMM table.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-200}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resU5; mkdir -p $R
pack() { tar czf $OUT/resU5.tgz -C /tmp resU5; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "tests $(date -u +%T)"; timeout $(left 170) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests/test_gemm_fp8.py \
  tests/test_gemm.py tests/test_gpu_host.py tests/test_gpu_model.py > $R/pytest.log 2>&1
grep -E "passed|failed" $R/pytest.log | tail -1; grep -E "^FAILED|^ERROR|^_____" $R/pytest.log | head -20
echo "done $(date -u +%T)"; pack
# Second call (U5b), after fixing the one failure of the first (a local `import fdpp.torch_ops`
# shadowed the module name in test_gpu_w8_torch_and_graph):
#   python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemm_fp8.py > /tmp/resU5/pytest_b.log
