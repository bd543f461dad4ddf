#!/usr/bin/env bash
# Nsight Compute of the split kernel at llama3-8b heads, B = 1, N = 64k (the H200 table's plans:
# results/device_runG4/ncu_int4.py) for FP8 E4M3 and INT4 g64: the warp-stall breakdown (raw
# smsp__average_warps_issue_stalled_* per issued instruction) and the SASS lines with the most
# stall samples. Writes under $1.
set -uo pipefail
R=$1; mkdir -p $R
for f in fp8_e4m3 int4; do
  timeout 150 ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:decode_split_mma \
    --section WarpStateStats --section SchedulerStats --section SpeedOfLight --section SourceCounters \
    --section LaunchStats --section Occupancy -o $R/ncu_$f -f python3 results/device_runG4/ncu_int4.py $f > $R/ncu_$f.log 2>&1
  timeout 60 ncu --import $R/ncu_$f.ncu-rep --page details > $R/ncu_$f.txt 2>&1
  timeout 60 ncu --import $R/ncu_$f.ncu-rep --page raw --csv \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio > $R/stalls_$f.csv 2>&1
  timeout 90 ncu --import $R/ncu_$f.ncu-rep --page source --print-source sass --csv > $R/source_$f.csv 2>&1
  echo "== $f: $(grep -E '^ +Duration' $R/ncu_$f.txt | head -1)"
  python3 - $R/stalls_$f.csv <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = next((r for r in rows if any("stalled" in c for c in r)), None)
if hdr is None:
    print("no stall metrics:", open(sys.argv[1]).read()[:400]); raise SystemExit
vals = rows[rows.index(hdr) + 2] if len(rows) > rows.index(hdr) + 2 else rows[-1]
pairs = [(h.split("stalled_")[1].split("_per")[0], v) for h, v in zip(hdr, vals) if "stalled_" in h]
pairs = sorted(((n, float(v.replace(",", ""))) for n, v in pairs if v.replace(",", "").replace(".", "").isdigit()), key=lambda x: -x[1])
print("  stall (warps per issue):", ", ".join(f"{n} {v:.2f}" for n, v in pairs[:9]))
PY
done
