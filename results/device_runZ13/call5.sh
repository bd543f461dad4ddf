# Run Z13, call 5 (H200, warm), typed inline; its text as run: Nsight Compute on one INT4 split
# kernel (B = 1, 64k, g64). scripts/probe_int4.py times the shipped table's plan (w4 s4 u2, 33 splits:
# the probe reads the table in tuning/, FDPP_TUNING_DIR does not reach it).
R=/tmp/resZ13f; mkdir -p $R; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
[ -d /tmp/site/optuna ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; cat $R/gpu.txt
FDPP_TUNING_DIR=/tmp/resZ13a/tuning timeout 200 ncu --clock-control none -k regex:decode_split --launch-skip 20 --launch-count 1 --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis python3 scripts/probe_int4.py --batch 1 --seqlens 65536 --group 64 > $R/ncu_int4_b1_64k.txt 2>&1
grep -E "Duration|Throughput|Issue Slot|Issued Ipc|No Eligible|Active Warps|Eligible Warps|Stall|Registers|Achieved Occ|Grid Size|Block Size|Executed Ipc|Pipe|decode_split" $R/ncu_int4_b1_64k.txt | head -60; tar czf $OUT/resZ13f.tgz -C /tmp resZ13f
