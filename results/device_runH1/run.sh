#!/usr/bin/env bash
# Run H1: bisect of the fp16 split kernel's long-context slowdown (65.8 us at B=1 64k in run B,
# 75 us since run D): the same bench on trees at each kernel-source version, one device, one run.
set -uo pipefail
R=/tmp/resH1; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv > $R/gpu.txt
B="--model llama3-8b --batch 1,8 --seqlens 16k,64k"
for t in current dcdf05d ab867a6 23b3621 4e3cd8d baae541 55ead77 current2; do
  d=$PWD/.dev/bisect/$t; [ "$t" = current ] || [ "$t" = current2 ] && d=$PWD
  impls=fdpp,floor; [ "$t" = current ] && impls=fdpp,floor,torch-cudnn
  mkdir -p /tmp/tdir_$t
  ( cd $d && FDPP_TUNING_DIR=/tmp/tdir_$t PYTHONPATH=/tmp/site:$d timeout 100 python3 -m fdpp.bench $B --impls $impls --out $R/attn_$t.csv > $R/bench_$t.log 2>&1 )
  echo "== $t $(date -u +%T)"; grep -A4 "time_us" $R/bench_$t.log | grep -E "^(fdpp|floor|torch)" 
  python3 -c "import json;m=json.load(open('$R/attn_$t.csv.meta.json'));print(m['fdpp_plans'])" 2>/dev/null
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv >> $R/gpu.txt
tar czf $OUT/resH1.tgz -C /tmp resH1
