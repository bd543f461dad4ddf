#!/usr/bin/env bash
# Run Z5, sixth call: the launch records' lock (fdpp/plan.py LaunchRecord.run, fdpp/gemm.py
# GemmRecord._launch_with). Call 5's whole suite failed test_threaded_ranks_on_one_gpu[torch]
# once: threads sharing one record's argument struct launched with each other's pointers. (1) with
# the lock: the new thread tests and the distributed tests, five times; (2) the same tree with the
# lock taken out (sed on this machine's copy): the new thread tests again, to see them fail.
set -uo pipefail
R=/tmp/resZ5f; mkdir -p $R
pack() { tar czf $OUT/resZ5f.tgz -C /tmp resZ5f; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
for i in 1 2 3 4 5; do
  timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_host.py -k threads tests/test_gpu_distributed.py \
    > $R/with_lock_$i.log 2>&1; echo "with lock, round $i: $(grep -E 'passed|failed' $R/with_lock_$i.log | tail -1)"
done; pack
sed -i 's/^        with self\._lock:$/        if True:  # lock removed (run Z5 call 6)/' fdpp/plan.py
sed -i 's/^            with self\._lock:  # the record.*$/            if True:  # lock removed (run Z5 call 6)/' fdpp/gemm.py
grep -c "lock removed" fdpp/plan.py fdpp/gemm.py
for i in 1 2 3; do
  timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_host.py -k threads \
    > $R/without_lock_$i.log 2>&1; echo "without lock, round $i: $(grep -E 'passed|failed' $R/without_lock_$i.log | tail -1)"
  grep -E "^E .*results are not|^FAILED" $R/without_lock_$i.log | head -4
done; pack
