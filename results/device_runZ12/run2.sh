#!/usr/bin/env bash
# Run Z12, its one call (an H100), on branch z12-warp-private: each warp copies the K/V rows it computes on, and the
# tensor-core loop orders a tile's copies and reads with __syncwarp instead of __syncthreads.
# (1) main's kernels (.mainK, an ignored copy of main's kernels_cu at 28b216d) against the branch's,
#     one process each, on the H200 table's plans: fp16 (B 1, 8; 1k..64k), FP8 E4M3 and INT4 g64
#     (B 1, 8; 4k..64k), contiguous; (2) the whole GPU suite on the branch; (3) a second A/B round
#     if time is left. Each step's limit is capped by BUDGET.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-560}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ12b; mkdir -p $R
pack() { tar czf $OUT/resZ12b.tgz -C /tmp resZ12b; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
J=8; grep -q H200 $R/gpu.txt || J=4
ab() {  # round $1
  for side in main new; do
    kd=""; [ $side = main ] && kd="--kernel-dir .mainK"
    echo "round $1 $side $(date -u +%T)"
    timeout $(left 60) python3 scripts/probe_pipeline.py $kd --kv fp16 --batch 1,8 --seqlens 1024,4096,16384,65536 \
      --shapes "" --splits "" > $R/ab$1_fp16_$side.log 2>&1
    timeout $(left 60) python3 scripts/probe_pipeline.py $kd --kv fp8_e4m3 --batch 1,8 --seqlens 4096,16384,65536 \
      --shapes "" --splits "" > $R/ab$1_fp8_$side.log 2>&1
    timeout $(left 60) python3 scripts/probe_int4.py $kd --batch 1,8 --seqlens 4096,16384,65536 --group 64 \
      > $R/ab$1_int4_$side.log 2>&1
    grep -h -E "table|heuristic" $R/ab$1_*_$side.log | head -30; pack
  done
}
ab 1
echo "suite $(date -u +%T)"
timeout $(left 300) python3 -m pytest -q -m gpu -n $J -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
tail -3 $R/pytest_gpu.log; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -20; pack
[ $((END - SECONDS)) -gt 200 ] && ab 2
echo "done $(date -u +%T)"; pack
