#!/usr/bin/env bash
# Run Z9, call 2, any card: INT4 parameters copied as 16-byte chunks when they are head-major
# (decode_split.cu's vector loader; kv_layout="HND" caches) and the array-major parameter area.
# (1) tests/test_gpu_int4.py (the new test_hnd_parameter_chunks included); (2) scripts/probe_int4.py,
# shipped H200 table's plans, llama3-8b heads, g64: the previous kernel (k_old/, decode_split.cu and
# kv_cache.cuh of 7dcf8b7, not committed: make it here first with `mkdir -p results/device_runZ9/k_old &&
# for f in decode_split.cu kv_cache.cuh; do git show 7dcf8b7:kernels_cu/$f > results/device_runZ9/k_old/$f; done`)
# against this tree's, NHD and HND caches, each in its own
# process; (3) the GPU tests of every file matching int4 / quant / fp8; (4) fdpp.bench, llama3-8b B = 1:
# fp16, INT4 NHD and HND (contiguous and pages of 16); (5) the whole GPU suite in the time left.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-560}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ9b; mkdir -p $R
pack() { tar czf $OUT/resZ9b.tgz -C /tmp resZ9b; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
echo "int4 tests $(date -u +%T)"
timeout $(left 100) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests/test_gpu_int4.py > $R/pytest_int4.log 2>&1
grep -E "passed|failed" $R/pytest_int4.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_int4.log | head -20; pack
probe() {  # name, probe arguments
  echo "== probe $1 $(date -u +%T)"
  timeout $(left 45) python3 scripts/probe_int4.py "${@:2}" --batch 1,8 --seqlens 16384,65536 > $R/probe_$1.log 2>&1
  grep -v "^ *$" $R/probe_$1.log | tail -5
}
K=results/device_runZ9/k_old
probe old_hnd --kernel-dir $K --kv-layout HND
probe new_hnd --kv-layout HND
probe old_nhd --kernel-dir $K
probe new_nhd


pack
echo "int4 / quant tests in every file $(date -u +%T)"
timeout $(left 120) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests -k "int4 or quant or fp8" --deselect tests/test_gpu_int4.py > $R/pytest_kq.log 2>&1
grep -E "passed|failed" $R/pytest_kq.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_kq.log | head -20; pack
for kv in fp16 int4_nhd int4_hnd; do
  echo "bench $kv $(date -u +%T)"
  a="--kv-dtype same"; [ $kv = int4_nhd ] && a="--kv-dtype int4 --page-size 0,16"; [ $kv = int4_hnd ] && a="--kv-dtype int4 --kv-layout HND --page-size 0,16"
  timeout $(left 45) python3 -m fdpp.bench attn --model llama3-8b --batch 1 --seqlens 16k,64k $a \
    --impls fdpp,floor --out $R/bench_$kv.csv > $R/bench_$kv.log 2>&1
  python3 -c "import sys, pandas as pd; d = pd.read_csv(sys.argv[1]); print(d.pivot_table(index=['seqlen', 'page_size'], columns='impl', values='time_us').round(2).to_string())" $R/bench_$kv.csv
  pack
done
echo "suite $(date -u +%T)"
timeout $(left 230) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30; pack
echo "done $(date -u +%T)"; pack
