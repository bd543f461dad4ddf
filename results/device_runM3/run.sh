#!/usr/bin/env bash
# Run M3: the tree of runs M1/M2 (test_gpu_fused.py's replay tests share one helper now; its GPU
# tests and the host-path ones first) with run M1's table (tuning/NVIDIA_H200.json, cut by M1's tune
# limits): the buckets it lacks tuned with --skip-tuned (M1's commands), then with the completed
# table the FP8 / INT4 KV sweeps with FlashInfer's FP8 decode, the llama3-8b model step, the eager
# host cost, the cluster probe (scripts/probe_cluster.py) and the softmax probe (scripts/probe_softmax.py: exact, no-max, lazy-quad).
set -uo pipefail
END=$((SECONDS + ${BUDGET:-480}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resM3; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "tests $(date -u +%T)"; timeout $(left 60) python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_gpu_fused.py \
  tests/test_gpu_host.py > $R/pytest_gpu.log 2>&1; grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head
echo "fill $(date -u +%T)"; T="--out-dir tuning --no-plots --skip-tuned"
timeout $(left 100) python3 -m fdpp.tune --model llama3-8b llama2-7b llama3-70b:8 --dtype fp16,bf16 --trials 20 $T \
  --results-dir $R/tune_fill > $R/tune_fill.log 2>&1
timeout $(left 70) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype fp8_e4m3 --page-size 0,16,64 --batch 1,8 \
  --seqlens 4k,16k,64k --trials 16 $T --results-dir $R/tune_fill_fp8 > $R/tune_fill_fp8.log 2>&1
timeout $(left 30) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype int4 --page-size 0,16 \
  --batch 1,8 --seqlens 4k,16k,64k --trials 12 $T --results-dir $R/tune_fill_int4 > $R/tune_fill_int4.log 2>&1
cp tuning/NVIDIA_H200.json $R/; for f in $R/tune*.log; do echo "$(basename $f): $(tr '\r' '\n' < $f | grep 'fdpp.tune:' | tail -1)"; done
echo "bench fp8 $(date -u +%T)"; timeout $(left 50) python3 -m fdpp.bench --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k \
  --page-size 0,16,64 --kv-dtype fp8_e4m3 --impls fdpp,floor,flashinfer --out $R/attn_fp8_llama3-8b_h200.csv > $R/bench_fp8.log 2>&1
grep -A5 "time_us" $R/bench_fp8.log | head -60
echo "bench int4 $(date -u +%T)"; timeout $(left 30) python3 -m fdpp.bench --model llama3-8b --batch 1,8 \
  --seqlens 4k,16k,64k --page-size 0,16 --kv-dtype int4 --out $R/attn_int4_llama3-8b_h200.csv > $R/bench_int4.log 2>&1
grep -A5 "time_us" $R/bench_int4.log | head -40
echo "e2e $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench e2e --model llama3-8b --seqlens 4k,16k,64k,128k --batch 1 \
  --kv fp16,fp8,int4 --no-breakdown --out $R/e2e_llama3-8b_b1_h200.csv > $R/e2e.log 2>&1; tail -8 $R/e2e.log
echo "eager $(date -u +%T)"; timeout $(left 45) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k \
  --impls eager --out $R/eager_llama3-8b_h200.csv > $R/eager.log 2>&1; grep -A14 "B=1  time_us" $R/eager.log | head -14
echo "cluster probe $(date -u +%T)"; timeout $(left 60) python3 scripts/probe_cluster.py --heads 32/8,8/1 --batch 1 \
  --seqlens 1024,4096,16384,65536 --shapes w4s2u1,w4s3u1 > $R/probe_cluster.log 2>&1; cat $R/probe_cluster.log
echo "softmax probe $(date -u +%T)"
for v in exact lazy-quad no-max; do timeout $(left 30) python3 scripts/probe_softmax.py --variant $v --heads 32/8,8/1 --batch 1,8 \
  --seqlens 1024,4096,16384,65536 > $R/probe_softmax_$v.log 2>&1; cat $R/probe_softmax_$v.log; done
echo "done $(date -u +%T)"
tar czf $OUT/resM3.tgz -C /tmp resM3
