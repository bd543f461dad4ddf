# Run Z13, call 3 (H200, warm after call 2), typed inline; this is its text as run. Run Z10's fp16
# re-tune (llama3-8b, B = 1 and 8, 4k / 16k / 64k, 30 trials) seeded from call 1's table, and the
# bench of the seed against the re-tuned table. The FP8 bench at the end failed on its argument
# (`--kv-dtype e4m3`; the name is fp8_e4m3) and was rerun as call 4.
R=/tmp/resZ13d; mkdir -p $R/tuning; S=/tmp/resZ13a/tuning/NVIDIA_H200.json; [ -f $S ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; S=tuning/NVIDIA_H200.json; }; echo seed $S
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; cp $S $R/tuning/; cp $S $R/seed_table.json
pack() { tar czf $OUT/resZ13d.tgz -C /tmp resZ13d; }
echo "tune fp16 $(date -u +%T)"
timeout 150 python3 -m fdpp.tune --model llama3-8b --dtype fp16 --kv-dtype same --page-size 0 --batch 1,8 --seqlens 4k,16k,64k --trials 30 --out-dir $R/tuning --seed-table $S --no-plots --seed 13 --results-dir $R/tune_fp16 > $R/tune_fp16.log 2>&1
tr '\r' '\n' < $R/tune_fp16.log | grep 'fdpp.tune:' | tail -2; pack
for side in shipped retuned; do dir=$R/seedonly; mkdir -p $dir; cp $S $dir/; [ $side = retuned ] && dir=$R/tuning
 echo "bench $side $(date -u +%T)"
 FDPP_TUNING_DIR=$dir timeout 60 python3 -m fdpp.bench attn --model llama3-8b --batch 1,8 --seqlens 1k,4k,16k,64k --kv-dtype same --page-size 0 --impls fdpp,floor --out $R/bench_$side.csv > $R/bench_$side.log 2>&1
 python3 -c "import sys, pandas as pd; d = pd.read_csv(sys.argv[1]); print(d.pivot_table(index=['batch', 'seqlen'], columns='impl', values='time_us').round(2).to_string())" $R/bench_$side.csv; pack; done
echo "fp8 $(date -u +%T)"
FDPP_TUNING_DIR=$R/tuning timeout 150 python3 -m fdpp.bench attn --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k --kv-dtype e4m3 --page-size 0,16,64 --impls fdpp,flashinfer,floor --out $R/bench_fp8.csv > $R/bench_fp8.log 2>&1
python3 -c "import sys, pandas as pd; d = pd.read_csv(sys.argv[1]); print(d.pivot_table(index=['batch', 'seqlen', 'page_size'], columns='impl', values='time_us').round(2).to_string())" $R/bench_fp8.csv; tail -3 $R/bench_fp8.log; pack; echo done $(date -u +%T)
