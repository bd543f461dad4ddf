#!/usr/bin/env bash
# Run Z6, first call. (1) the threaded tests (the records' lock, 31b274e): test_threaded_ranks_on_one_gpu,
# which failed in run Z5 call 5 and has not run since the fix, and the thread tests of test_gpu_host,
# three rounds; (2) A/B of the split kernels with two accumulator chains for the Q.K products
# (.exp_kernels, carried: decode_split.cu of HEAD with the odd k-steps' MMAs in a second chain, summed
# before the softmax) against the shipped kernels, on the H200 table's plans plus w4s3u1 at 16 splits:
# fp16 and FP8 E4M3 at B = 1 (1k-64k), INT4 g64 at B = 1 (16k, 64k); each side twice, ABAB.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-540}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ6; mkdir -p $R
pack() { tar czf $OUT/resZ6.tgz -C /tmp resZ6; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
for i in 1 2 3; do
  timeout $(left 60) python3 -m pytest -q -m gpu -p no:cacheprovider "tests/test_gpu_distributed.py::test_threaded_ranks_on_one_gpu" \
    tests/test_gpu_host.py -k "threaded or threads" > $R/threads_$i.log 2>&1
  echo "threads round $i: $(grep -E 'passed|failed' $R/threads_$i.log | tail -1)"
done; pack
for side in shipped exp shipped exp; do
  kd=""; [ $side = exp ] && kd="--kernel-dir .exp_kernels"
  echo "pipeline $side $(date -u +%T)"
  timeout $(left 150) python3 scripts/probe_pipeline.py --kv fp16,fp8_e4m3 --batch 1 --seqlens 1024,4096,16384,65536 \
    --shapes w4s3u1 --splits 16 $kd >> $R/pipeline_$side.log 2>&1
  grep -v -i warn $R/pipeline_$side.log | tail -14; pack
done
for side in shipped exp; do
  kd=""; [ $side = exp ] && kd="--kernel-dir .exp_kernels"
  echo "int4 $side $(date -u +%T)"
  timeout $(left 90) python3 scripts/probe_int4.py --batch 1 --seqlens 16384,65536 $kd > $R/int4_$side.log 2>&1
  grep -v -i warn $R/int4_$side.log | tail -6; pack
done
echo "done $(date -u +%T)"; pack
