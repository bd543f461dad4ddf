#!/usr/bin/env bash
set -uo pipefail
R=/tmp/res9; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
for arr in torch cupy; do
  timeout 100 python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 1k,16k,64k --impls fdpp,torch-cudnn,flashinfer,floor \
    --fdpp-arrays $arr --out $R/attn_$arr.csv > $R/bench_$arr.log 2>&1
  echo "== $arr"; grep -E "^(fdpp|torch|flash|floor) " $R/bench_$arr.log | head -8
done
tar czf $OUT/res9.tgz -C /tmp res9
