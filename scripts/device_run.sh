#!/usr/bin/env bash
# The project's runs on the lent H200 machine (no package index there), from the project root:
#   bash scripts/device_run.sh STEP [STEP ...]      logs and CSVs go to $OUT (default results/device)
# Steps:
#   test        the GPU test suite (pytest -m gpu; workers: one per 17 GiB of GPU memory, at most 8;
#               TEST_JOBS=<n> overrides; 8 on an 80 GB H100 ran out of memory in run Z15) -> pytest_gpu.log
#   probe       contiguous vs paged quick timing, this tree and .base/   -> probe.log, probe_base.log
#   tune        re-tune the shipped table: llama3-8b, llama2-7b, llama3-70b/tp8 (fp16, bf16) and
#               llama3-8b paged (page 16, fp16)                          -> tune.log, tuning/*.json
#   bench       llama3-8b contiguous + paged (pages 1, 16, 64) against the peers -> bench_*.csv/log
#   cache       tar the CuPy kernel cache into $OUT (carry it back as .cupy_cache to skip compiles)
# Needs the wheels of ../shared/device/get-wheels.sh --flashinfer in .whl/ (name .whl in carry).
# .base/ (optional) is an export of the commit before a kernel change, for before/after probes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=$PWD/.cupy_cache
[ -f .cupy_cache.tgz ] && tar xzf .cupy_cache.tgz
rc=0
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case "$step" in
    test)
      mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
      jobs=${TEST_JOBS:-$(( ${mib:-0} / 17408 ))}; [ "$jobs" -gt 8 ] && jobs=8; [ "$jobs" -lt 1 ] && jobs=1
      timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -m gpu -n "$jobs" -p no:cacheprovider ${TEST_ARGS:-tests} 2>&1 \
        | tee "$OUT/pytest_gpu.log" | tail -40 || rc=1 ;;
    probe)
      timeout 240 python3 scripts/probe_paged.py 2>&1 | tee "$OUT/probe.log"
      if [ -d .base ]; then
        FDPP_PROBE_CONTIGUOUS_ONLY=1 PYTHONPATH=/tmp/site:$PWD/.base timeout 90 \
          python3 scripts/probe_paged.py 2>&1 | tee "$OUT/probe_base.log"
      fi ;;
    tune)
      { timeout 330 python3 -m fdpp.tune --model llama3-8b llama2-7b llama3-70b:8 --dtype fp16,bf16 \
          --trials 16 --out-dir tuning --results-dir "$OUT" \
        && timeout 200 python3 -m fdpp.tune --model llama3-8b --dtype fp16 --page-size 16 --trials 16 \
          --out-dir tuning --results-dir "$OUT/paged"; } 2>&1 | tee "$OUT/tune.log" | tail -30
      cp tuning/NVIDIA_H200.json "$OUT/" ;;
    bench)
      timeout 420 python3 -m fdpp.bench --model llama3-8b --batch 1,8,64 --seqlens 1k,4k,16k,64k \
        --page-size 0,1,16,64 --out "$OUT/attn_llama3-8b_paged_h200.csv" 2>&1 | tee "$OUT/bench.log" | tail -60 ;;
    cache)
      tar czf "$OUT/cupy_cache.tgz" .cupy_cache ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
done
exit $rc
