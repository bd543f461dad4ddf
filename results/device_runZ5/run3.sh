#!/usr/bin/env bash
# Run Z5, third call: where the split kernels' time above the loader goes. The loader alone
# (probe_read_pattern.py's split_cpasync) reached the floor in the second call, the kernels did
# not; here the same plans (w4s3u1 / w8s3u1, 16 splits, two launches) as shipped and with the Q.K,
# the P.V or both tensor-core products replaced by a dependent add (probe_pipeline.py --variant
# no-qk / no-pv / no-mma: timing only, wrong values), fp16 and FP8, B = 1, 16k and 64k; the loader
# again in the same run.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-300}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ5c; mkdir -p $R
pack() { tar czf $OUT/resZ5c.tgz -C /tmp resZ5c; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
cd scripts
for v in shipped no-qk no-pv no-mma; do
  echo "$v $(date -u +%T)"
  timeout $(left 70) python3 probe_pipeline.py --variant $v --kv fp16,fp8_e4m3 --batch 1 --seqlens 16384,65536 \
    --shapes w4s3u1,w8s3u1 --splits 16 > $R/pipeline_$v.log 2>&1; grep -v Warning $R/pipeline_$v.log; pack
done
timeout $(left 40) python3 probe_read_pattern.py --points "" --cp-shapes w4s3,w8s3 \
  --cp-points fp16:16384:16,fp16:65536:16,fp8:16384:16,fp8:65536:16 > $R/cpasync.log 2>&1; cat $R/cpasync.log
cd ..; echo "done $(date -u +%T)"; pack
