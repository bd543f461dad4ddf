#!/usr/bin/env bash
# Run Z8: how much of the INT4 kernel's time is its per-element dequantisation (issue 10: INT4 at
# 0.675 x fdpp's fp16 time, bar 0.33)? Timing-only variants of kernels_cu/decode_split.cu (wrong
# values, errors not meaningful), each run by scripts/probe_int4.py --kernel-dir in its own process
# on the shipped H200 table's INT4 plans, llama3-8b heads, B = 1, g64:
#   base  : the shipped kernel
#   ksub  : K codes to exact fp16 (shift, lop3, sub) without the scale/zero fma
#   kraw  : K codes as the biased fp16 1024 + n (shift, lop3): what folding scale, zero and the bias
#           out of the loop would leave (an upper bound: the per-token fix-ups are not modelled)
#   vsub, vraw, kvraw: the same for V, and both raw
# plus fdpp's fp16 decode on the same card and run for the ratio.
set -uo pipefail
R=/tmp/resZ8c; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
python3 - <<'PY'
import pathlib, shutil
src = pathlib.Path("kernels_cu")
K = "r[i] = dec::dequant(dec::f16x2(w[j] >> (4 * i)), s2, z2);"
V0 = "dec::dequant(dec::f16x2(y01 >> (4 * i)), s01, z01)"
V1 = "dec::dequant(dec::f16x2(y89 >> (4 * i)), s89, z89)"
raw = lambda x: f"((({x}) & 0x000f000fu) | 0x64006400u)"
edits = {
    "ksub": [(K, "r[i] = dec::f16x2(w[j] >> (4 * i));")],
    "kraw": [(K, "r[i] = " + raw("w[j] >> (4 * i)") + ";")],
    "vsub": [(V0, "dec::f16x2(y01 >> (4 * i))"), (V1, "dec::f16x2(y89 >> (4 * i))")],
    "vraw": [(V0, raw("y01 >> (4 * i)")), (V1, raw("y89 >> (4 * i)"))],
}
edits["kvraw"] = edits["kraw"] + edits["vraw"]
for name, subs in edits.items():
    d = pathlib.Path("/tmp/int4var") / name
    d.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        shutil.copy(f, d / f.name)
    t = (d / "decode_split.cu").read_text()
    for a, b in subs:
        assert t.count(a) == 1, (name, a)
        t = t.replace(a, b)
    (d / "decode_split.cu").write_text(t)
print("variants written")
PY
for v in base ksub kraw vsub vraw kvraw; do
  kd=""; [ $v != base ] && kd="--kernel-dir /tmp/int4var/$v"
  echo "== $v $(date -u +%T)"
  timeout 120 python3 scripts/probe_int4.py $kd --batch 1 --seqlens 16384,65536 > $R/probe_$v.log 2>&1
  grep -v "^ *$" $R/probe_$v.log | tail -3
done
echo "== fp16 $(date -u +%T)"
timeout 90 python3 -m fdpp.bench attn --model llama3-8b --batch 1 --seqlens 16k,64k --impls fdpp,floor --out $R/fp16.csv > $R/fp16.log 2>&1
tail -8 $R/fp16.log
tar czf $OUT/resZ8c.tgz -C /tmp resZ8c
