#!/usr/bin/env bash
# Run Z8: one device call for whatever card comes. An H200: run2.sh (the whole GPU suite, the 70b
# TP-8 re-tune of the H200 table and its bench). An H100: ${H100_SCRIPT:-run4.sh} (the INT4 probes;
# their times are relative, so an H100 serves).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  BUDGET=${BUDGET:-570} bash results/device_runZ8/run2.sh
else
  bash results/device_runZ8/${H100_SCRIPT:-run4.sh}
fi
