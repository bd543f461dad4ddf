#!/usr/bin/env bash
# Run Z8: one device call for whatever card comes. An H200: run2.sh (the whole GPU suite, the 70b
# TP-8 re-tune of the H200 table and its bench). An H100: $H100_SCRIPT if set (call 2: run3.sh,
# call 3: run4.sh, the INT4 probes, whose times are relative), else nothing.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  BUDGET=${BUDGET:-570} bash results/device_runZ8/run2.sh
elif [ -n "${H100_SCRIPT:-}" ]; then
  bash results/device_runZ8/$H100_SCRIPT
else
  nvidia-smi --query-gpu=name --format=csv,noheader; echo "not an H200: nothing to do"
fi
