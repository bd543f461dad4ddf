# Run Z13, call 6 (H200, warm), typed inline; its text as run: the 12 INT4 entries re-tuned again
# with 40 trials each (seeded from call 3's table, which holds call 1's 16-trial INT4 entries), and
# the bench of INT4 and fp16 with the result. The shipped H200 table takes this call's 12 INT4 entries.
R=/tmp/resZ13g; mkdir -p $R/tuning; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
[ -d /tmp/site/optuna ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
S=/tmp/resZ13d/tuning/NVIDIA_H200.json; [ -f $S ] || S=tuning/NVIDIA_H200.json; echo seed $S
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; cat $R/gpu.txt; cp $S $R/tuning/; cp $S $R/seed_table.json
pack() { tar czf $OUT/resZ13g.tgz -C /tmp resZ13g; }
echo "tune int4 $(date -u +%T)"
timeout 200 python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype int4 --page-size 0,16 --batch 1,8 --seqlens 4k,16k,64k --trials 40 --out-dir $R/tuning --seed-table $S --no-plots --seed 23 --results-dir $R/tune_int4 > $R/tune_int4.log 2>&1
tr '\r' '\n' < $R/tune_int4.log | grep 'fdpp.tune:' | tail -2; grep kvi4 $R/tune_int4/tune_NVIDIA_H200.csv | cut -d, -f4,6,7,8,9,12,15,16; pack
for kv in int4 same; do ps="0,16"; [ $kv = same ] && ps=0
 echo "bench $kv $(date -u +%T)"
 FDPP_TUNING_DIR=$R/tuning timeout 90 python3 -m fdpp.bench attn --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k --kv-dtype $kv --page-size $ps --impls fdpp,floor --out $R/bench_$kv.csv > $R/bench_$kv.log 2>&1
 python3 -c "import sys, pandas as pd; d = pd.read_csv(sys.argv[1]); print(d.pivot_table(index=['batch', 'seqlen', 'page_size'], columns='impl', values='time_us').round(2).to_string())" $R/bench_$kv.csv; pack; done; echo done $(date -u +%T)
