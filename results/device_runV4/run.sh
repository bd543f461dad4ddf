#!/usr/bin/env bash
# Run V4: the final code after the review fixes (flat_gemm's first call on a stream inside a torch graph
# capture takes torch temporaries; the weight-format guard in the GEMM lookup; time_round_robin uploads
# each CuPy graph on the stream it runs on, makes torch's stream on CuPy's device, runs eager kinds in their
# context; tune --gemm on --device, skipped when cut short): the whole GPU suite, then short interleaved
# attention and GEMM benches.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-420}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resV4; mkdir -p $R
pack() { tar czf $OUT/resV4.tgz -C /tmp resV4; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
export FDPP_TUNING_DIR=$R/user_empty
echo "tests $(date -u +%T)"; timeout $(left 240) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30; pack
echo "bench8b $(date -u +%T)"; timeout $(left 60) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k,4k \
  --impls fdpp,floor,torch-cudnn,flashinfer --out $R/attn.csv > $R/bench8b.log 2>&1
grep -A6 "time_us" $R/bench8b.log | head -8; grep -i "interleaved timing failed\|failed at" $R/bench8b.log | head -3; pack
echo "gemm $(date -u +%T)"; timeout $(left 40) python3 -m fdpp.bench gemm --model llama3-8b --layers o --m 1 --weights fp8 \
  --out $R/gemm.csv > $R/gemm.log 2>&1; grep -A3 "^layer" $R/gemm.log | head -8; grep -i "timed alone\|failed" $R/gemm.log | head -3
echo "done $(date -u +%T)"; pack
