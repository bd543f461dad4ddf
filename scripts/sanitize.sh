#!/usr/bin/env bash
# Runs every fdpp kernel family (scripts/sanitize_workload.py: decode_split, decode_split_mma,
# decode_combine, the fused and cluster merges, decode_nosplit, paged, PagedKVCache append/extend, flat_gemm's own kernels,
# stream_read) under compute-sanitizer's memcheck, racecheck, initcheck and synccheck, with the
# caching allocators off, and writes a report:
#
#   $OUT/sanitize_report.txt     one section per tool: the command, its time and exit status, the
#                                sanitizer's summary line, the kernels with errors (fdpp's, then
#                                library kernels: CuPy's, cuBLAS, torch's) and CUDA API errors
#   $OUT/sanitize_<tool>.log     the sanitizer's own log;  $OUT/sanitize_<tool>.out  the workload's
#
# Exit status: 0 clean; 1 an error in an fdpp kernel (names with fdpp:: or one of the family
# kernels), or the workload failed / timed out under a tool; 2 no GPU, no sanitizer, or the workload
# fails without a sanitizer. Errors in library kernels and API errors are listed, not failed.
#
# Environment: OUT (default results), TOOLS (default "memcheck racecheck initcheck synccheck"),
# FAMILIES (comma list, default all; see `python3 scripts/sanitize_workload.py --list`),
# TOOL_TIMEOUT (seconds per tool, default 150; each tool should take under ~90 s once the kernels are
# in CuPy's disk cache, which the plain run first fills),
# PYTHON (default .venv/bin/python if present, else python3), COMPUTE_SANITIZER (the binary;
# default: PATH, /usr/local/cuda*/bin, ./.sanitizer, the nvidia-cuda-sanitizer-api wheel).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
TOOLS=${TOOLS:-memcheck racecheck initcheck synccheck}
FAMILIES=${FAMILIES:-all}
TOOL_TIMEOUT=${TOOL_TIMEOUT:-150}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
mkdir -p "$OUT"
REPORT="$OUT/sanitize_report.txt"
WORKLOAD=(scripts/sanitize_workload.py --families "$FAMILIES")
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONUNBUFFERED=1

find_sanitizer() {
  if [ -n "${COMPUTE_SANITIZER:-}" ]; then echo "$COMPUTE_SANITIZER"; return 0; fi
  command -v compute-sanitizer 2>/dev/null && return 0
  local c
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
           /usr/local/cuda/compute-sanitizer/compute-sanitizer /opt/cuda/bin/compute-sanitizer \
           .sanitizer/nvidia/*/compute-sanitizer/compute-sanitizer \
           .sanitizer/nvidia/*/compute-sanitizer/compute-sanitizer/compute-sanitizer; do
    if [ -f "$c" ] && [ -x "$c" ]; then echo "$c"; return 0; fi
  done
  "$PYTHON" - <<'EOF'
import glob, os, site, sys
bases = list(site.getsitepackages()) + [site.getusersitepackages()] + sys.path
for base in bases:
    for pat in ("nvidia/*/compute-sanitizer/compute-sanitizer", "nvidia/cuda_sanitizer_api/compute-sanitizer/compute-sanitizer"):
        for p in glob.glob(os.path.join(base, pat)):
            if os.path.isfile(p) and not os.access(p, os.X_OK):
                try:  # an unpacked wheel may have lost the executable bit
                    os.chmod(p, 0o755)
                except OSError:
                    continue
            if os.path.isfile(p) and os.access(p, os.X_OK):
                print(p)
                sys.exit(0)
sys.exit(1)
EOF
}

CS=$(find_sanitizer) || CS=""
if [ -z "$CS" ]; then
  echo "sanitize.sh: compute-sanitizer not found. It ships with the CUDA toolkit, or as a wheel:" >&2
  echo "  pip install nvidia-cuda-sanitizer-api      (CUDA 13; nvidia-cuda-sanitizer-api-cu12 for CUDA 12);" >&2
  echo "  for a machine without an index: pip download --no-deps --only-binary=:all: \\" >&2
  echo "    --platform manylinux_2_25_x86_64 -d .whl 'nvidia-cuda-sanitizer-api==13.5.25', then install .whl/" >&2
  echo "    into a --target directory on PYTHONPATH (as scripts/device_run.sh does)" >&2
  echo "  or unpack that wheel into ./.sanitizer, or set COMPUTE_SANITIZER=/path/to/compute-sanitizer" >&2
  exit 2
fi

{
  echo "fdpp sanitizer report, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "sanitizer: $CS ($("$CS" --version 2>/dev/null | grep -i version | head -1))"
  echo "python: $PYTHON; families: $FAMILIES"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
  echo
} >"$REPORT"

# Without a sanitizer first: the workload must pass (and this compiles every kernel into CuPy's
# disk cache, so the sanitized runs do not spend their time in NVRTC).
t0=$(date +%s)
if ! "$PYTHON" "${WORKLOAD[@]}" >"$OUT/sanitize_plain.out" 2>&1 || ! grep -q "sanitize_workload: OK" "$OUT/sanitize_plain.out"; then
  {
    echo "== plain run (no sanitizer): FAILED, see $OUT/sanitize_plain.out"
    tail -20 "$OUT/sanitize_plain.out"
  } >>"$REPORT"
  cat "$REPORT"
  exit 2
fi
echo "== plain run (no sanitizer): $(grep "sanitize_workload: OK" "$OUT/sanitize_plain.out") in $(($(date +%s) - t0)) s" >>"$REPORT"
echo >>"$REPORT"

status=0
for tool in $TOOLS; do
  log="$OUT/sanitize_$tool.log"
  out="$OUT/sanitize_$tool.out"
  extra=()
  case $tool in
    memcheck) extra=(--padding 256) ;;  # an access just past a buffer lands in padding, not a neighbour
  esac
  cmd=("$CS" --tool "$tool" --print-limit 200 --destroy-on-device-error kernel --log-file "$log"
       "${extra[@]}" "$PYTHON" "${WORKLOAD[@]}")
  rm -f "$log"
  t0=$(date +%s)
  timeout --kill-after=30 "$TOOL_TIMEOUT" "${cmd[@]}" >"$out" 2>&1
  rc=$?
  secs=$(($(date +%s) - t0))
  [ -f "$log" ] || : >"$log"
  summary_json=$("$PYTHON" scripts/sanitize_workload.py --summarize "$log")
  {
    echo "== $tool"
    echo "command: ${cmd[*]}"
    echo "time: ${secs} s; exit status: $rc$([ $rc = 124 ] && echo " (TIMED OUT after $TOOL_TIMEOUT s)")"
    echo "workload: $(grep -E "sanitize_workload: (OK|FAILED)" "$out" | tail -1 || true)"
    "$PYTHON" - "$summary_json" <<'EOF'
import json, sys
s = json.loads(sys.argv[1])
print("summary:", "; ".join(s["summary"]) or "(no summary line in the log)")
print("fdpp kernels with errors:", ", ".join(s["fdpp_error_kernels"]) or "none")
if s["fdpp_warning_kernels"]:
    print("fdpp kernels with warnings (not failed):", ", ".join(s["fdpp_warning_kernels"]))
print("other kernels with errors (library; not failed):", ", ".join(s["other_kernels"]) or "none")
if s["api_errors"]:
    print(f"CUDA API errors (not failed): {len(s['api_errors'])} distinct:")
    for a in s["api_errors"][:10]:
        print("   ", a)
for n in s["notes"][:5]:
    print("sanitizer note:", n)
if s["first_fdpp_error"]:
    print("first fdpp error:")
    for line in s["first_fdpp_error"].splitlines():
        print("   ", line)
EOF
    grep -E "sanitize_workload: .*(FAIL|note)" "$out" | head -10
    echo
  } >>"$REPORT"
  nerr=$(printf '%s' "$summary_json" | "$PYTHON" -c "import json,sys; print(json.load(sys.stdin)['fdpp_errors'])")
  if [ "$nerr" != 0 ] || [ $rc = 124 ] || [ $rc = 137 ] || ! grep -q "sanitize_workload: OK" "$out"; then
    status=1
  fi
done

if [ $status = 0 ]; then
  echo "RESULT: clean (no error in an fdpp kernel under: $TOOLS)" >>"$REPORT"
else
  echo "RESULT: FAILED (an fdpp kernel error, or the workload failed under a tool: see above)" >>"$REPORT"
fi
cat "$REPORT"
exit $status
