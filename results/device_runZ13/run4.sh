#!/usr/bin/env bash
# Run Z13, on an H100 (after the H200 calls): run Z11's run4.sh with 40 trials per bucket, main's
# kernels (.mainK) as the old side: the INT4 GPU tests, the probe old vs new, the re-tune of the
# card's 12 INT4 entries (the H100 table's, stale since the kernel edit), the bench of INT4 and fp16.
set -uo pipefail
R=/tmp/resZ13h OLDK=.mainK TRIALS=40 BUDGET=${BUDGET:-400} bash results/device_runZ11/run4.sh
