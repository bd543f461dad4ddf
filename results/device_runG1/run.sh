#!/usr/bin/env bash
# Run G1 (host path decisions): the GPU suite with the new host path (output reuse on, CuPy
# launcher), the host/fused/attention files again with FDPP_LAUNCH=bindings and =ctypes; the host
# profile (launcher x reuse matrix, one launch vs two); a quick re-tune of llama3-8b fp16 B=1
# 1k/4k/16k with the launch tie rule into a user dir; the eager bench with that table.
set -uo pipefail
END=$((SECONDS + ${BUDGET:-400}))
left() { local l=$((END - SECONDS)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 5 ] && l=5; echo "$l"; }
R=/tmp/resG1; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv > $R/gpu.txt 2>&1
echo "tests $(date -u +%T)"; timeout $(left 160) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rs tests > $R/pytest_gpu.log 2>&1
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu.log | head -30
for L in bindings ctypes; do
  echo "tests $L $(date -u +%T)"; FDPP_LAUNCH=$L timeout $(left 70) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider \
    tests/test_gpu_host.py tests/test_gpu_fused.py tests/test_gpu_attention.py tests/test_gpu_model.py > $R/pytest_gpu_$L.log 2>&1
  grep -E "passed|failed" $R/pytest_gpu_$L.log | tail -1; grep -E "^FAILED|^ERROR" $R/pytest_gpu_$L.log | head -10
done
echo "profile $(date -u +%T)"; timeout $(left 100) python3 scripts/host_profile.py --out $R/host_profile_h200.csv > $R/host_profile.log 2>&1
echo "tune $(date -u +%T)"; mkdir -p $R/tt
timeout $(left 40) python3 -m fdpp.tune --model llama3-8b --dtype fp16 --batch 1 --seqlens 1k,4k,16k --trials 16 \
  --out-dir $R/tt --results-dir $R/tune --no-plots > $R/tune.log 2>&1
python3 - <<'PY' > $R/tune_entries.txt 2>&1
import json; t = json.load(open("/tmp/resG1/tt/NVIDIA_H200.json"))
for k, e in t["entries"].items(): print(k, e["plan"]["merge"], e["plan"]["num_splits"], e["time_us"], e.get("heuristic_time_us"))
PY
cat $R/tune_entries.txt
echo "eager $(date -u +%T)"; FDPP_TUNING_DIR=$R/tt timeout $(left 60) python3 -m fdpp.bench --model llama3-8b --batch 1 --seqlens 1k \
  --impls eager --out $R/eager_llama3-8b_h200.csv > $R/eager.log 2>&1
echo "done $(date -u +%T)"
tar czf $OUT/resG1.tgz -C /tmp resG1
grep -E "eager|plan" $R/eager.log | head -12
grep -E "matrix|empty kernel|new_empty|torch.empty|custom op|SDPA eager \(CUDNN|flashinfer" $R/host_profile.log | head -80
