#!/usr/bin/env bash
# Run Y1: RoPE and the KV append fused into one launch per layer (PagedKVCache.append_rope,
# kernels_cu/paged_append.cu paged_rope_append; model_ops.cu rope_qkv_append for the contiguous
# cache): the whole GPU suite, then the llama3-8b decode step with the fusion (fdpp) and without it
# (fdpp-rope2), per-op breakdown, B = 1 and 8, N = 4k and 16k.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-560}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resY1; mkdir -p $R
pack() { tar czf $OUT/resY1.tgz -C /tmp resY1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
N=8; grep -q "H100" $R/gpu.txt && N=4  # 80 GB: the model tests ran out of memory with 8 workers (run X1)
echo "tests $(date -u +%T)"
timeout $(left 150) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_rope_append.py tests/test_gpu_model.py \
  -k "rope or op_kernels" > $R/pytest_rope.log 2>&1
grep -E "passed|failed" $R/pytest_rope.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_rope.log | head -20; pack
timeout $(left 280) python3 -m pytest -q -m gpu -n $N -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30; pack
echo "e2e $(date -u +%T)"
timeout $(left 300) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k --batch 1,8 --impls fdpp,fdpp-rope2 \
  --out $R/e2e_rope.csv > $R/e2e.log 2>&1
grep "ITL" $R/e2e.log
python3 - <<'PY' 2>&1 | tail -20
import pandas as pd
d = pd.read_csv("/tmp/resY1/e2e_rope.csv")
d = d[d.op.isin(["step", "rope", "kv_append", "rope_append"])]
print(d.pivot_table(index=["batch", "seqlen", "op"], columns="impl", values="time_us").round(1))
PY
echo "done $(date -u +%T)"; pack
