#!/usr/bin/env bash
# Run Z14, call 5 (any card): INT4's Q.K products as two independent MMA chains (even and odd k-steps into
# two accumulators, added once; acc2.patch) against the shipped single chain, on the table's plans
# (scripts/probe_int4.py, llama3-8b heads, g64, B = 1 / 8, 16k / 64k), one process each, A B A B.
# Call 3 found INT4's warps stalled on fixed-latency dependencies ('wait') 1.03 cycles per instruction.
set -uo pipefail
R=/tmp/resZ14e; mkdir -p $R
pack() { tar czf $OUT/resZ14e.tgz -C /tmp resZ14e; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
rm -rf /tmp/acc2 && cp -r kernels_cu /tmp/acc2
patch -s -d /tmp/acc2 -p1 < results/device_runZ14/acc2.patch || (cd /tmp/acc2 && git apply -p1 "$OLDPWD/results/device_runZ14/acc2.patch")
grep -c "two independent MMA chains" /tmp/acc2/decode_split.cu > $R/acc2_patched.txt
for side in shipped acc2 shipped2 acc2b; do
  kd=""; case $side in acc2*) kd="--kernel-dir /tmp/acc2";; esac
  echo "probe $side $(date -u +%T) (patched: $(cat $R/acc2_patched.txt))"
  timeout 60 python3 scripts/probe_int4.py $kd --batch 1,8 --seqlens 16384,65536 --group 64 > $R/probe_$side.log 2>&1
  grep -v "^#" $R/probe_$side.log | tail -4; pack
done
echo "done $(date -u +%T)"
