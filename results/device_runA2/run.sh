#!/usr/bin/env bash
# Run A2 (ad hoc): kernel-time comparison old/new/alt, the attention bench (new, tuned table), base bench, tests.
set -uo pipefail
R=/tmp/res; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
tar xzf .cupy_cache.tgz
P="scripts/probe_paged.py --batch 1 --seqlens 4096 --pages 0"
for t in .base . .alt; do
  echo "== ncu $t" >> $R/ncu.log
  PYTHONPATH=/tmp/site:$PWD/$t FDPP_PROBE_CONTIGUOUS_ONLY=1 timeout 60 ncu --clock-control none --metrics gpu__time_duration.sum -k regex:decode_ --launch-count 6 python3 $PWD/$P >> $R/ncu.log 2>&1
done
for t in .base . .alt; do
  echo "== probe $t" >> $R/probe_cmp.log
  PYTHONPATH=/tmp/site:$PWD/$t FDPP_PROBE_CONTIGUOUS_ONLY=1 timeout 60 python3 $PWD/scripts/probe_paged.py --batch 1,8 --seqlens 1024,4096,65536 --pages 0 >> $R/probe_cmp.log 2>&1
done
export PYTHONPATH=/tmp/site:$PWD
timeout 90 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gpu_paged.py tests/test_cache_decode.py tests/test_gpu_host.py > $R/pytest_gpu_A2.log 2>&1
timeout 330 python3 -m fdpp.bench --model llama3-8b --batch 1,8,64 --seqlens 1k,4k,16k,64k --page-size 0,1,16,64 \
  --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/attn_llama3-8b_paged_h200.csv > $R/bench.log 2>&1
PYTHONPATH=/tmp/site:$PWD/.base timeout 80 python3 -m fdpp.bench --model llama3-8b --batch 1,8,64 --seqlens 1k,4k,16k,64k \
  --impls fdpp,floor --out $R/attn_llama3-8b_base_h200.csv > $R/bench_base.log 2>&1
tar czf $OUT/res.tgz -C /tmp res
grep -E "passed|failed" $R/pytest_gpu_A2.log | tail -2; tail -5 $R/bench.log; cat $R/probe_cmp.log | grep -v Warn
