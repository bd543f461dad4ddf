"""GPU probe: what bounds flat_gemm on FP8 weights (W8A16), CUDA-graph timed.

    python3 scripts/probe_gemm_w8.py [--variant shipped|alu|none] [--m 1,8] [--layers qkv,o,gate_up,down]
                                     [--shapes w8s8r2x0g1,w4s16r2x0g1,...] [--grids table,wave,tiles]

llama3-8b projection shapes. For each (layer, M): the stream-read floor of the FP8 bytes, the plan
the GEMM tables name (the user's over the shipped one, as `fdpp.gemm.choose` reads them; the heuristic where they have none), then
every listed bulk-copy shape (``w<warps>s<steps>r<stages>x<x_ring>g<groups>``, w8 variants) at
each grid. Prints µs per call (median of graph replays over weight sets rotated past L2) and the
max error against the float64 reference of the dequantised weights.

``--variant`` patches ``kernels_cu/flat_gemm.cu``'s E4M3 -> fp16 conversion (timing only; the
errors then say how wrong the values are):

- ``alu``:  the conversion by integer bit moves (and / shift / or per pair, no ``cvt``): values
            2^-8 of the true ones (subnormal fp16 for small codes), so the error is large;
- ``none``: the code bytes used as fp16 bits as they are (no conversion at all).

Same times for ``shipped`` and ``alu``/``none``: the conversion is not what limits the kernel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_cluster import use_sources  # noqa: E402

from fdpp import gemm, gemm_tune, registry, timing  # noqa: E402
from fdpp.dtypes import get_dtype  # noqa: E402
from fdpp.models import get_model  # noqa: E402
from fdpp.reference import max_rel_err  # noqa: E402

_CVT = ('  asm("{\\n .reg .b16 a, b, c, d;\\n mov.b32 {a, b}, %4;\\n mov.b32 {c, d}, %5;\\n"\n'
        '      " cvt.rn.f16x2.e4m3x2 %0, a;\\n cvt.rn.f16x2.e4m3x2 %1, b;\\n"\n'
        '      " cvt.rn.f16x2.e4m3x2 %2, c;\\n cvt.rn.f16x2.e4m3x2 %3, d;\\n}"\n'
        '      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(c.x), "r"(c.y));\n')
_ALU = ('  auto hb = [](unsigned a) { return (a & 0x80008000u) | ((a >> 1) & 0x3f803f80u); };\n'
        '  r.x = hb(__byte_perm(c.x, 0u, 0x1404)); r.y = hb(__byte_perm(c.x, 0u, 0x3424));\n'
        '  r.z = hb(__byte_perm(c.y, 0u, 0x1404)); r.w = hb(__byte_perm(c.y, 0u, 0x3424));\n')
_NONE = '  r = make_uint4(c.x, c.y, c.x ^ c.y, c.y);\n'
VARIANTS = {"alu": _ALU, "none": _NONE}


def _patch(variant: str) -> None:
    body = VARIANTS[variant]

    def tr(name: str, text: str) -> str:
        if name != "flat_gemm.cu":
            return text
        if text.count(_CVT) != 1:
            raise SystemExit("probe_gemm_w8: the E4M3 cvt block of flat_gemm.cu not found")
        return text.replace(_CVT, body)

    use_sources(tr)


def _shape(s: str, m: int) -> gemm.FlatTmaConfig:
    w, rest = s[1:].split("s")
    st, rest = rest.split("r")
    ns, rest = rest.split("x")
    xr, gr = rest.split("g")
    return gemm.FlatTmaConfig("fp16", int(w), int(st), gemm.m_tiles_for(m), int(ns), int(xr), int(gr), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="shipped", choices=("shipped", *VARIANTS))
    ap.add_argument("--m", default="1,8")
    ap.add_argument("--layers", default="qkv,o,gate_up,down")
    ap.add_argument("--shapes", default="w8s8r2x0g1,w4s16r2x0g1,w8s8r3x0g1,w8s4r4x0g1,w8s8r2x0g2")
    ap.add_argument("--grids", default="wave,tiles")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if args.variant != "shipped":
        _patch(args.variant)
    import cupy as cp

    dev = cp.cuda.Device().id
    lim = registry.device_limits(dev)
    l2 = timing.l2_bytes(dev)
    dt = get_dtype("fp16")
    shapes = get_model("llama3-8b").linear_shapes(1)
    print(f"variant {args.variant}; {'layer':>8} {'M':>3} {'us':>8} {'p10':>8} {'p90':>8} {'err':>9}  plan", flush=True)
    for layer in args.layers.split(","):
        n, k = shapes[layer]
        for m in (int(x) for x in args.m.split(",")):
            sets = gemm_tune._rotated_inputs(n, k, m, dt, l2, wfmt="e4m3")
            ref = gemm_tune._reference(sets[0])
            nbytes = n * k + 4 * n + (m * k + n + m * n) * 2
            fl = timing.time_stream_read(nbytes, repeats=args.repeats).median_us
            print(f"{layer:>8} {m:>3} {fl:8.2f} {'':8} {'':8} {'':9}  floor ({nbytes / 2**20:.1f} MiB)", flush=True)
            plans = [("table", gemm.choose(m, n, k, lim, "fp16", wfmt="e4m3"))]
            for s in args.shapes.split(","):
                cfg = _shape(s, m)
                if cfg.check(lim) is None:
                    plans += [(s, p) for p in gemm_tune.expand_grids(gemm.GemmPlan("tma", cfg), n, k, dev,
                                                                 args.grids.split(","))]
            for label, plan in plans:
                try:
                    err = max_rel_err(gemm_tune.run_plan(plan, sets[0]), ref)
                    t, how = gemm_tune.time_plan(plan, sets, args.repeats)
                except Exception as e:  # noqa: BLE001 - a probe: report and go on
                    print(f"{layer:>8} {m:>3} failed: {type(e).__name__}: {str(e)[:160]}  {label}", flush=True)
                    continue
                print(f"{layer:>8} {m:>3} {t.median_us:8.2f} {t.p10_us:8.2f} {t.p90_us:8.2f} {err:9.2e}  "
                      f"{label} {how}", flush=True)
            del sets


if __name__ == "__main__":
    main()
