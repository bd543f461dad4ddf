#!/usr/bin/env bash
# Run H3 (after H2): is the fused tail (fused_merge after the main loop, added in ab867a6) what slows the
# two-launch split kernel? Same bench, heuristic plans (no tables), trees with and without it.
set -uo pipefail
R=/tmp/resH3; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
B="--model llama3-8b --batch 1,8 --seqlens 16k,64k"
for t in exp/head:fdpp-two-launch,floor exp/role_dyn:fdpp,fdpp-two-launch exp/nofused:fdpp-two-launch exp/head:fdpp,fdpp-two-launch; do
  impls=${t#*:}; t=${t%%:*}; d=$PWD/.dev/$t; n=$(echo $t | tr / _)_$SECONDS
  mkdir -p /tmp/tdir_$n
  ( cd $d && rm -rf tuning && FDPP_TUNING_DIR=/tmp/tdir_$n PYTHONPATH=/tmp/site:$d timeout 100 python3 -m fdpp.bench $B --impls $impls --out $R/attn_$n.csv > $R/bench_$n.log 2>&1 )
  echo "== $t $impls $(date -u +%T)"; grep -A5 "time_us" $R/bench_$n.log | grep -E "^(fdpp|floor|torch)"
done
tar czf $OUT/resH3.tgz -C /tmp resH3
