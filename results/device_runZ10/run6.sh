#!/usr/bin/env bash
# Run Z10, call 10, an H200 only: run4.sh on the shipped H200 table (the llama3-8b INT4 / fp16
# re-tune with the new split candidates, and the bench of shipped vs re-tuned). Exits at once on another card.
set -uo pipefail
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { nvidia-smi --query-gpu=name --format=csv,noheader; echo "not an H200: nothing to do"; exit 0; }
TABLE=tuning/NVIDIA_H200.json BUDGET=${BUDGET:-300} bash results/device_runZ10/run4.sh
