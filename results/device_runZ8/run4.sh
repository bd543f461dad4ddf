#!/usr/bin/env bash
# Run Z8, after run3 (no dequantisation at all ran no faster at 64k): are INT4's per-row scale and
# zero loads the cost? They are 4-byte cp.asyncs, one per (row, array); in quantize_kv's NHD layout
# [B, N, Hkv, D/g] a KV head's values of consecutive tokens lie 32 bytes apart, so each load touches
# its own 32-byte sector. Timed with scripts/probe_int4.py on the shipped H200 table's plans,
# llama3-8b heads, B = 1, g64:
#   base nhd  : the shipped kernel, quantize_kv's layout
#   base hnd  : the same kernel and values, scales and zeros as strided views of [B, Hkv, N, D/g]
#   noparam   : timing only, the contiguous loader's parameter copies removed (wrong values)
#   kvraw_noparam : timing only, no parameter copies and no dequantisation
set -uo pipefail
R=/tmp/resZ8d; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=$PWD/.cupy_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
python3 - <<'PY'
import pathlib, shutil
src = pathlib.Path("kernels_cu")
K = "r[i] = dec::dequant(dec::f16x2(w[j] >> (4 * i)), s2, z2);"
V0 = "dec::dequant(dec::f16x2(y01 >> (4 * i)), s01, z01)"
V1 = "dec::dequant(dec::f16x2(y89 >> (4 * i)), s89, z89)"
P = "if constexpr (I4) copy_params(sc, row, start + t * TILE + row, 0, ok);"
raw = lambda x: f"((({x}) & 0x000f000fu) | 0x64006400u)"
edits = {
    "noparam": [(P, "")],
    "kvraw_noparam": [(P, ""), (K, "r[i] = " + raw("w[j] >> (4 * i)") + ";"),
                      (V0, raw("y01 >> (4 * i)")), (V1, raw("y89 >> (4 * i)"))],
}
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
run() {  # name, probe arguments
  echo "== $1 $(date -u +%T)"
  timeout 120 python3 scripts/probe_int4.py "${@:2}" --batch 1 --seqlens 16384,65536 --splits 16,66 > $R/probe_$1.log 2>&1
  grep -v "^ *$" $R/probe_$1.log | tail -7
}
run base_nhd
run base_hnd --param-layout hnd
run noparam --kernel-dir /tmp/int4var/noparam
run kvraw_noparam --kernel-dir /tmp/int4var/kvraw_noparam
run base_nhd_again
tar czf $OUT/resZ8d.tgz -C /tmp resZ8d
