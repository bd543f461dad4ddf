# Run Z13, call 4 (H200, warm), typed inline; its text as run: the FP8 (E4M3) bench with FlashInfer
# 0.5.3 beside, call 3's table.
R=/tmp/resZ13e; mkdir -p $R; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
ls /tmp/site | grep -i flashinfer | head -2; nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
pack() { tar czf $OUT/resZ13e.tgz -C /tmp resZ13e; }
echo "fp8 $(date -u +%T)"
FDPP_TUNING_DIR=/tmp/resZ13d/tuning timeout 200 python3 -m fdpp.bench attn --model llama3-8b --batch 1,8 --seqlens 4k,16k,64k --kv-dtype fp8_e4m3 --page-size 0,16,64 --impls fdpp,flashinfer,floor --out $R/bench_fp8.csv > $R/bench_fp8.log 2>&1
python3 -c "import sys, pandas as pd; d = pd.read_csv(sys.argv[1]); print(d.pivot_table(index=['batch', 'seqlen', 'page_size'], columns='impl', values='time_us').round(2).to_string())" $R/bench_fp8.csv; tail -3 $R/bench_fp8.log; pack; echo done $(date -u +%T)
