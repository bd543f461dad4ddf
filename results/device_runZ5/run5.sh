#!/usr/bin/env bash
# Run Z5, fifth call (the committed tree, d17600c or later). On an H200: (1) the whole GPU suite
# (the widened cluster heuristic of run Z1 has not run there; half-group tests); (2) the llama3-70b
# TP-8 B = 1 buckets re-tuned with half groups into a copy of the H200 table (run4.sh's command);
# (3) the bench with the shipped and the re-tuned table; (4) run Z1's heuristic probe. On an H100:
# the whole GPU suite only, -n 4 (8 workers ran out of memory there in run Z3).
set -uo pipefail
END=$((SECONDS + ${BUDGET:-560}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ5e; mkdir -p $R/tuning /tmp/no_tables
pack() { tar czf $OUT/resZ5e.tgz -C /tmp resZ5e; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
J=8; grep -q H100 $R/gpu.txt && J=4
echo "suite $(date -u +%T)"
timeout $(left 360) python3 -m pytest -q -m gpu -n $J -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30; pack
grep -q H100 $R/gpu.txt && { echo "an H100: the suite only"; exit 0; }
echo "tune $(date -u +%T)"
cp tuning/NVIDIA_H200.json $R/tuning/
timeout $(left 110) python3 -m fdpp.tune --model llama3-70b:8 --dtype fp16,bf16 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --trials 30 --out-dir $R/tuning --no-plots --seed 11 --results-dir $R/tune_70b > $R/tune.log 2>&1
tr '\r' '\n' < $R/tune.log | grep 'fdpp.tune:' | tail -3; pack
for side in shipped retuned; do
  echo "bench $side $(date -u +%T)"
  dir=/tmp/no_tables; [ $side = retuned ] && dir=$R/tuning
  FDPP_TUNING_DIR=$dir timeout $(left 50) python3 -m fdpp.bench attn --model llama3-70b --tp 8 --batch 1 \
    --seqlens 1k,4k,16k,64k,256k --impls fdpp,floor,torch-cudnn,flashinfer --out $R/bench_$side.csv > $R/bench_$side.log 2>&1
  python3 - $R/bench_$side.csv <<'PY'
import sys, pandas as pd
d = pd.read_csv(sys.argv[1])
print(d.pivot_table(index="seqlen", columns="impl", values="time_us").round(2).to_string())
PY
  pack
done
echo "probe $(date -u +%T)"
timeout $(left 60) python3 scripts/probe_cluster.py --heuristic --heads 28/4,16/8,40/8,12/2 --batch 1,8 \
  --seqlens 1024,4096 > $R/probe_heuristic.log 2>&1; grep -v Warning $R/probe_heuristic.log
echo "done $(date -u +%T)"; pack
