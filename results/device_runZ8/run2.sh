#!/usr/bin/env bash
# Run Z8, H200 call: (1) re-tune, into a copy of the shipped H200 table, the llama3-70b TP-8 B = 1
# buckets (fp16, bf16; half groups, as on the H100 in run Z7) and the llama3-8b B = 1 fp16 buckets
# at 1k / 4k / 16k with 80 trials (the shipped entries had 20; each study starts from the shipped
# plan); (2) bench the shipped and the re-tuned table, interleaved with cuDNN, flash and FlashInfer.
# Does nothing on an H100 (its table is another file).
set -uo pipefail
END=$((SECONDS + ${BUDGET:-570}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resZ8b; mkdir -p $R/tuning /tmp/no_tables
pack() { tar czf $OUT/resZ8b.tgz -C /tmp resZ8b; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
grep -q H100 $R/gpu.txt && { echo "an H100: nothing to do"; exit 0; }
cp tuning/NVIDIA_H200.json $R/tuning/
echo "tune 70b $(date -u +%T)"
timeout $(left 130) python3 -m fdpp.tune --model llama3-70b:8 --dtype fp16,bf16 --batch 1 --seqlens 1k,4k,16k,64k,256k \
  --trials 30 --out-dir $R/tuning --no-plots --seed 11 --results-dir $R/tune_70b > $R/tune_70b.log 2>&1
tr '\r' '\n' < $R/tune_70b.log | grep 'fdpp.tune:' | tail -3; pack
echo "tune 8b $(date -u +%T)"
timeout $(left 150) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --batch 1 --seqlens 1k,4k,16k \
  --trials 80 --out-dir $R/tuning --no-plots --seed 12 --results-dir $R/tune_8b > $R/tune_8b.log 2>&1
tr '\r' '\n' < $R/tune_8b.log | grep 'fdpp.tune:' | tail -3; pack
for side in shipped retuned; do
  dir=/tmp/no_tables; [ $side = retuned ] && dir=$R/tuning
  for m in "llama3-70b --tp 8 --seqlens 1k,4k,16k,64k,256k" "llama3-8b --seqlens 1k,4k,16k"; do
    tag=$(echo $m | cut -d' ' -f1)
    echo "bench $side $tag $(date -u +%T)"
    FDPP_TUNING_DIR=$dir timeout $(left 60) python3 -m fdpp.bench attn --model $m --batch 1 \
      --impls fdpp,floor,torch-cudnn,torch-flash,flashinfer --out $R/bench_${side}_$tag.csv > $R/bench_${side}_$tag.log 2>&1
    python3 -c "import sys, pandas as pd; d = pd.read_csv(sys.argv[1]); print(d.pivot_table(index='seqlen', columns='impl', values='time_us').round(2).to_string())" $R/bench_${side}_$tag.csv
    pack
  done
done
echo "done $(date -u +%T)"; pack
