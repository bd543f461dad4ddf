#!/usr/bin/env bash
# Prints the pip extra of CuPy's wheel for this machine's NVIDIA driver: "cuda12" for a driver of
# CUDA 12 or older, "cuda13" otherwise (also when nvidia-smi prints no CUDA version or fails).
# FDPP_CUDA_EXTRA=cuda12 / cuda13 overrides. Used by scripts/run.sh and scripts/test.sh.
if [ -n "${FDPP_CUDA_EXTRA:-}" ]; then echo "$FDPP_CUDA_EXTRA"; exit 0; fi
major=$({ nvidia-smi 2>/dev/null || true; } | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -1)
if [ -n "$major" ] && [ "$major" -le 12 ]; then
  [ "$major" -lt 12 ] && echo "fdpp: the driver supports CUDA $major; CuPy needs 12 or newer" >&2
  echo cuda12
else
  echo cuda13
fi
