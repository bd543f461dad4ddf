#!/usr/bin/env bash
# Run J1: programmatic dependent launch. GPU tests of PDL and the merge paths; then fdpp with the
# H5 table (its hashes re-stamped in this device copy only, so both arms run the same tuned plans)
# with FDPP_PDL=1 and FDPP_PDL=0, cuDNN and the floor in the same process for scale.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-200}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resJ1; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
python3 -c "
import sys; sys.argv=['x']
import importlib.util; from pathlib import Path
s=importlib.util.spec_from_file_location('c','scripts/compare_ptx.py'); m=importlib.util.module_from_spec(s); s.loader.exec_module(m)
print('restamp (device copy, A/B only):', m.restamp(Path('tuning/NVIDIA_H200.json'), set()))" > $R/restamp.log 2>&1
echo "tests $(date -u +%T)"; timeout $(left 90) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_pdl.py \
  tests/test_gpu_fused.py tests/test_gpu_attention.py > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -20
for pdl in 1 0; do
  echo "bench pdl=$pdl $(date -u +%T)"
  imp=fdpp; [ $pdl = 1 ] && imp=fdpp,floor,torch-cudnn
  FDPP_PDL=$pdl timeout $(left 40) python3 -m fdpp.bench --model llama3-8b --batch 1,8,64 --seqlens 1k,4k,16k,64k --page-size 0,16 \
    --impls $imp --out $R/attn_8b_pdl$pdl.csv > $R/bench8b_pdl$pdl.log 2>&1
  FDPP_PDL=$pdl timeout $(left 20) python3 -m fdpp.bench --model llama3-70b --tp 8 --batch 1 --seqlens 1k,4k,16k,64k,256k \
    --impls $imp --out $R/attn_70b_pdl$pdl.csv > $R/bench70b_pdl$pdl.log 2>&1
done
echo "done $(date -u +%T)"
tar czf $OUT/resJ1.tgz -C /tmp resJ1
python3 - <<'PY'
import pandas as pd
for m in ("8b", "70b"):
    try:
        a = pd.concat([pd.read_csv(f"/tmp/resJ1/attn_{m}_pdl{p}.csv").assign(pdl=p) for p in (1, 0)])
    except Exception as e:
        print(m, e); continue
    a["impl"] = a.impl + a.pdl.map({1: "", 0: "-nopdl"}).where(a.impl == "fdpp", "")
    print(a.pivot_table(index=["page_size", "batch", "seqlen"], columns="impl", values="time_us").round(2).to_string())
PY
