#!/usr/bin/env bash
# Run Z11: run4.sh on an H200 only (exits at once on another card): the INT4 GPU tests, old against
# new kernels on the H200 table's INT4 plans, the re-tune of those entries (re-stamped, not
# re-tuned, in run Z11: no H200 came) and the bench. Each step's limit is capped by BUDGET.
set -uo pipefail
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { nvidia-smi --query-gpu=name --format=csv,noheader; echo "not an H200: nothing to do"; exit 0; }
BUDGET=${BUDGET:-300} bash results/device_runZ11/run4.sh
