#!/usr/bin/env bash
# Run Z10, call 5, any card: the whole GPU suite on the tree with the re-tuned tables (H200: run
# Z8's run2.sh 70b entries; H100: run4.sh's llama3-8b INT4 / fp16 entries); then, on an H200,
# run4.sh (the llama3-8b INT4 / fp16 re-tune of the H200 table, with the new split candidates).
set -uo pipefail
END=$((SECONDS + ${BUDGET:-560}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ10e; mkdir -p $R
pack() { tar czf $OUT/resZ10e.tgz -C /tmp resZ10e; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
J=8; grep -q H200 $R/gpu.txt || J=4  # 8 workers run an 80 GB H100 out of memory (run Z10's first try; run Z7's rule)
echo "suite -n $J $(date -u +%T)"
timeout $(left 330) python3 -m pytest -q -m gpu -n $J -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30; pack
grep -q H200 $R/gpu.txt || { echo "not an H200: done"; exit 0; }
TABLE=tuning/NVIDIA_H200.json BUDGET=$((END - SECONDS)) bash results/device_runZ10/run4.sh  # its output in $OUT/resZ10d.tgz
