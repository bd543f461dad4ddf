"""GPU probe: INT4 decode attention (fdpp's tensor-core kernel) timed on the shipped table's plans.

    python3 scripts/probe_int4.py [--kernel-dir DIR] [--cp-prefetch 256] [--batch 1,8] [--seqlens 4096,16384,65536]
                                  [--group 64] [--splits 16,33,50] [--shapes w4s3u1,w4s2u1] [--vscale 1]
                                  [--param-layout nhd|hnd] [--kv-layout NHD|HND]

Contiguous caches (NHD; HND with ``--kv-layout HND``), llama3-8b heads (32 / 8, D 128). For each point: the plan the table's INT4 entry names (read without its source-hash check, so a
table tuned before a kernel edit still names its plan; the heuristic where it has none), then the
same kernel shape at other split counts and the listed shapes. ``--kernel-dir`` reads
decode_split.cu and kv_cache.cuh from another directory (an older revision: compare the two in
one run, one process each). Prints µs per call (median of graph replays over input sets rotated
past L2) and the max error against a float64 reference of the dequantised cache (K with a few
large-magnitude groups); ``--vscale`` multiplies V's scales (large values reach the kernel's
per-element path). ``--param-layout hnd`` passes the same scales and zeros as strided views of
[B, Hkv, N, D // g] arrays (a KV head's values contiguous over tokens) instead of the [B, N, Hkv,
D // g] arrays ``quantize_kv`` returns for NHD codes. ``--kv-layout HND`` quantizes [B, Hkv, N, D]
caches (codes, scales and zeros all head-major, as ``quantize_kv(..., kv_layout="HND")`` gives them)
and calls with ``kv_layout="HND"``.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import cupy as cp
from probe_cluster import (
    PROBE_HEADER,
    _ints,
    _table_plan,
    cp_prefetch,
    shape_config,
    time_rows,
    use_kernel_dir,
)

import fdpp
from fdpp import configs, registry, timing
from fdpp.reference import attention_reference


def _dequant(codes, scale, zero, g):
    lo, hi = codes & 15, codes >> 4
    n = cp.stack([lo, hi], axis=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1]).astype(cp.float64)
    s = cp.repeat(scale.astype(cp.float64), g, axis=-1)
    z = cp.repeat(zero.astype(cp.float64), g, axis=-1)
    return (n * s + z).astype(cp.float16).astype(cp.float64)


def _hnd(x):
    """The values of x [B, N, Hkv, G] with a KV head's rows contiguous over tokens (a strided view)."""
    return cp.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def _cache(b, n, hkv, d, g, vscale, rng_seed, param_layout="nhd", kv_layout="NHD"):
    rs = cp.random.RandomState(rng_seed)
    k = rs.standard_normal((b, n, hkv, d), dtype=cp.float32)
    k[..., : d // 8] *= 20.0  # a few large-magnitude channels, as real models' K
    v = rs.standard_normal((b, n, hkv, d), dtype=cp.float32)
    if kv_layout == "HND":
        k, v = (cp.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (k, v))
    q4 = fdpp.quantize_kv(k.astype(cp.float16), v.astype(cp.float16), "int4", group_size=g, kv_layout=kv_layout)
    vs = (q4.v_scale.astype(cp.float32) * vscale).astype(cp.float16)
    params = (q4.k_scale, vs, q4.k_zero, q4.v_zero)
    if param_layout == "hnd":
        params = tuple(_hnd(x) for x in params)
    ks, vs, kz, vz = params
    return q4.k, q4.v, ks, vs, kz, vz


def time_point(b, n, hq, hkv, d, g, vscale, plans_for, param_layout="nhd", kv_layout="NHD"):
    prob = configs.DecodeProblem(b, hq, hkv, d, n, "fp16", kv_dtype=f"int4_g{g}")
    per = 2 * b * n * hkv * (d // 2 + 4 * d // g)
    count = timing.rotation_count(per, timing.l2_bytes(), factor=4, max_sets=64)
    sets = []
    for i in range(count):
        kc, vc, ks, vs, kz, vz = _cache(b, n, hkv, d, g, vscale, 100 + i, param_layout, kv_layout)
        q = cp.random.standard_normal((b, hq, d), dtype=cp.float32).astype(cp.float16)
        sets.append((q, kc, vc, ks, vs, kz, vz))
    q0, kc, vc, ks, vs, kz, vz = sets[0]
    kd, vd = _dequant(kc, ks, kz, g), _dequant(vc, vs, vz, g)
    if kv_layout == "HND":
        kd, vd = kd.transpose(0, 2, 1, 3), vd.transpose(0, 2, 1, 3)
    ref, _ = attention_reference(q0, kd, vd)
    outs = [cp.empty((b, hq, d), cp.float16) for _ in sets]

    def call(s, o=None):
        q, kc, vc, ks, vs, kz, vz = s
        return fdpp.decode_attention(q, kc, vc, kv_dtype="int4", k_descale=ks, v_descale=vs, k_zero=kz,
                                     v_zero=vz, out=o, kv_layout=kv_layout)

    time_rows(f"{b:>3} {n:>6}", plans_for(prob), sets, outs, ref, call)
    del sets, outs
    cp.get_default_memory_pool().free_all_blocks()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel-dir", type=Path)
    ap.add_argument("--cp-prefetch", type=int, default=0,
                    help="K/V cp.async with the L2 prefetch hint .L2::<n>B (64, 128, 256; 0: as shipped)")
    ap.add_argument("--batch", type=_ints, default=[1, 8])
    ap.add_argument("--seqlens", type=_ints, default=[4096, 16384, 65536])
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--splits", type=_ints, default=[])
    ap.add_argument("--shapes", default="")
    ap.add_argument("--vscale", type=float, default=1.0)
    ap.add_argument("--param-layout", choices=("nhd", "hnd"), default="nhd")
    ap.add_argument("--kv-layout", choices=("NHD", "HND"), default="NHD")
    args = ap.parse_args()
    if args.kv_layout == "HND" and args.param_layout == "hnd":
        ap.error("--param-layout hnd re-strides NHD caches' parameters; HND caches' are head-major already")
    if args.kernel_dir or args.cp_prefetch:
        use_kernel_dir(args.kernel_dir or registry.kernel_dir(),
                       transform=cp_prefetch(args.cp_prefetch) if args.cp_prefetch else lambda name, text: text)
    hq, hkv, d = 32, 8, 128

    def plans_for(prob):
        name, base = _table_plan(prob)
        out = [(f"{name} {base.split.key} splits {base.effective_splits(prob.seqlen)} {base.mode}", base)]
        kernels = [base.split]
        for shape in [s for s in args.shapes.split(",") if s]:
            c = shape_config(shape, "fp16", d, 1)
            kernels.append(dataclasses.replace(base.split, num_warps=c.num_warps, num_stages=c.num_stages,
                                               unroll=c.unroll, cluster=1))
        for cfg in kernels:
            for s in args.splits:
                if cfg.is_valid(configs.SM90):
                    out.append((f"{cfg.key} splits {s}", configs.LaunchPlan.split_kv(cfg, s)))
        return out

    print(f"int4 g{args.group} vscale {args.vscale} params {args.param_layout} kv_layout {args.kv_layout}")
    print(PROBE_HEADER.replace("heads ", ""))
    for b in args.batch:
        for n in args.seqlens:
            time_point(b, n, hq, hkv, d, args.group, args.vscale, plans_for, args.param_layout, args.kv_layout)


if __name__ == "__main__":
    main()
