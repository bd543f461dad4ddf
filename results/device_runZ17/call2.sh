#!/usr/bin/env bash
# Run Z17, call 2 (an H200 only): run Z14's never-run call 4, FP8 E4M3's 18 llama3-8b entries re-tuned
# with 40 trials into a copy of the H200 table, then the bench of shipped against re-tuned, into resZ17b.
# Then, here: PYTHONPATH=. python3 results/device_runZ15/adopt_fp8.py results/device_runZ17/out/resZ17b tuning/NVIDIA_H200.json
RES_NAME=resZ17b bash results/device_runZ14/call4.sh
