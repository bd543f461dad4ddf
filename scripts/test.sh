#!/usr/bin/env bash
# Sets up a virtual environment and runs the test suite. On a machine without a GPU the GPU tests
# are skipped and the CPU checks run: NumPy reference and emulator, argument validation, every
# kernel variant compiled for sm_80 and sm_90 through NVRTC (zero spills), tables, tuner, bench.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${FDPP_VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
extra="test"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extra="test,$(bash scripts/cuda_extra.sh),torch"  # CuPy's wheel for the driver's CUDA major version
fi
"$VENV/bin/python" -m pip install -q -e ".[$extra]"
"$VENV/bin/ruff" check fdpp tests scripts
# Two workers, whole files each (--dist loadfile: a file's module fixtures are built once): the
# kernel compile checks (tests/test_compile.py, ~460 s on 2 cores) run beside the other files.
# On a 2-core machine pytest took 596 and 709 s this way (two clean runs), 768 s in one process.
# FDPP_TEST_JOBS=0 runs in one process.
jobs=${FDPP_TEST_JOBS:-2}
if [ "$jobs" = 0 ]; then exec "$VENV/bin/python" -m pytest -q "$@"; fi
exec "$VENV/bin/python" -m pytest -q -n "$jobs" --dist loadfile "$@"
