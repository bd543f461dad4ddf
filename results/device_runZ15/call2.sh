#!/usr/bin/env bash
# Run Z15, call 2 (any card): the K/V tiles' 16-byte cp.async with an L2 prefetch-size hint (.L2::256B /
# .L2::128B; scripts/probe_cluster.py cp_prefetch patches common.cuh's cp_async16) against the shipped
# copy, on the table's plans: fp16 and FP8 E4M3 (scripts/probe_pipeline.py) and INT4 g64
# (scripts/probe_int4.py), llama3-8b heads, B = 1, contiguous NHD caches; one process per side, A B A B.
# In an NHD cache a CTA's rows of one head are 256 B (fp16) / 128 B (FP8) / 64 B (INT4) apart from the
# next head's, which other CTAs read at about the same time.
set -uo pipefail
R=/tmp/resZ15b; mkdir -p $R
pack() { tar czf $OUT/resZ15b.tgz -C /tmp resZ15b; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
for side in 0 256 0b 256b 128; do
  n=${side%b}
  echo "pipeline cp-prefetch $side $(date -u +%T)"
  timeout 110 python3 scripts/probe_pipeline.py --kv fp16,fp8_e4m3 --batch 1 --seqlens 4096,16384,65536 --shapes "" \
    --cp-prefetch $n > $R/pipe_$side.log 2>&1
  grep -v "^#" $R/pipe_$side.log | tail -13; pack
done
for side in 0 256 0b 256b; do
  n=${side%b}
  echo "int4 cp-prefetch $side $(date -u +%T)"
  timeout 80 python3 scripts/probe_int4.py --batch 1 --seqlens 16384,65536 --group 64 --cp-prefetch $n > $R/int4_$side.log 2>&1
  grep -v "^#" $R/int4_$side.log | tail -3; pack
done
echo "done $(date -u +%T)"
