#!/usr/bin/env bash
# Run Z13 (branch z13-int4-ops): INT4's loop with 17-24 % fewer instructions (shift-free nibble
# extraction, masks kept in registers, one byte_perm per row pair's scales, contiguous scale rows
# located by one add). Run Z11's run4.sh with main's kernels (.mainK) as the old side: the INT4
# GPU tests, the probe old vs new on the table's INT4 plans, the re-tune of the card's 12 INT4
# entries with the new kernel, the bench of INT4 and fp16.
set -uo pipefail
R=/tmp/resZ13a OLDK=.mainK BUDGET=${BUDGET:-420} bash results/device_runZ11/run4.sh
