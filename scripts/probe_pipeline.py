"""GPU probe: pipeline depth of the tensor-core split kernel, fp16 and FP8 caches, CUDA-graph timed.

    python3 scripts/probe_pipeline.py [--kv fp16,fp8_e4m3] [--batch 1] [--seqlens 16384,65536]
                                      [--shapes w4s3u1,w4s4u1,w4s6u1] [--splits 16,33,49]
                                      [--layout NHD|HND] [--variant shipped|head-order|e4m3-alu|e4m3-lop|no-qk|no-pv|no-mma]
                                      [--kernel-dir DIR] [--cp-prefetch 64|128|256]

Contiguous caches, llama3-8b heads (32 / 8, D 128), two-launch merge. For each point: the plan
the shipped table's entry names (read without its source-hash check), then every listed shape
(``w<warps>s<stages>u<unroll>``, stages up to 8, beyond the tuner's space) at every listed split
count, merged by the table plan's combine where it has one; variants that are invalid (shared
memory) are skipped. All kernels are compiled first, in parallel. Prints µs per call (median of graph
replays over input sets rotated past L2) and the max error against a float64 reference (of the
dequantised cache, for FP8).

``--layout HND`` gives the caches as [B, Hkv, N, D] (each head's tokens contiguous); ``--variant``
patches the kernel sources (:data:`VARIANTS`); ``--kernel-dir`` reads decode_split.cu and kv_cache.cuh
from another directory (an older revision: compare the two in one run, one process each). The first row of each point is the floor: the
stream_read kernel reading as many bytes as K and V hold (descales not counted).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import cupy as cp
from probe_cluster import (
    PROBE_HEADER,
    _ints,
    cp_prefetch,
    shape_config,
    table_row,
    time_rows,
    use_kernel_dir,
    use_sources,
)

import fdpp
from fdpp import configs, registry, timing, tune
from fdpp.reference import attention_reference

HQ, HKV, D = 32, 8, 128
_SPLIT_ORDER = "  const int split = blockIdx.x, b = blockIdx.z, h0 = blockIdx.y * GROUP_SIZE;\n"
_HEAD_ORDER = ("  const int lin_ = blockIdx.x + blockIdx.y * gridDim.x;\n"
               "  const int split = lin_ / gridDim.y, b = blockIdx.z, h0 = (lin_ % gridDim.y) * GROUP_SIZE;\n")
_E4M3_CVT = "#if __CUDA_ARCH__ >= 890\n  __device__ __forceinline__ static float scale() { return 1.f; }\n"


def _head_order(name: str, src: str) -> str:
    if name != "decode_split.cu":
        return src
    head, sep, rest = src.partition("decode_split_mma(const DecodeParams p) {")
    if not sep or _SPLIT_ORDER not in rest:
        raise SystemExit("probe_pipeline: decode_split_mma's index line not found")
    return head + sep + rest.replace(_SPLIT_ORDER, _HEAD_ORDER, 1)


def _e4m3_alu(name: str, src: str) -> str:
    if name != "kv_cache.cuh":
        return src
    if src.count(_E4M3_CVT) != 1:
        raise SystemExit("probe_pipeline: the E4M3 cvt branch not found in kv_cache.cuh")
    return src.replace(_E4M3_CVT, "#if 0\n" + _E4M3_CVT.split("\n", 1)[1])


_E4M3_PAIRS = "cvt.rn.f16x2.e4m3x2 %0, l;\\n cvt.rn.f16x2.e4m3x2 %1, h;\\n"


def _e4m3_lop(name: str, src: str) -> str:
    if name != "kv_cache.cuh":
        return src
    if src.count(_E4M3_PAIRS) != 1:
        raise SystemExit("probe_pipeline: the E4M3 cvt pair not found in kv_cache.cuh")
    return src.replace(_E4M3_PAIRS, "and.b32 %0, %2, 0x3f3f3f3f;\\n shr.b32 %1, %2, 1;\\n")


# Timing only (WRONG VALUES): the tensor-core products of the 16-bit and FP8 paths replaced by one
# dependent add of their operands' bits (kept small), so their fragment loads and conversions stay.
_QK_MMAS = {  # decode_split.cu line -> its stand-in
    "MM::run(sc[0], k00, k10, k01, k11, qa[4 * h + j][0], qa[4 * h + j][1]);":
        "sc[0][j] += __uint_as_float((k00 ^ k10 ^ k01 ^ k11 ^ qa[4 * h + j][0] ^ qa[4 * h + j][1]) & 0x3c00u);",
    "MM::run(sc[0], qa[kk][0], 0u, qa[kk][1], 0u, r[0], r[1]);":
        "sc[0][kk % 4] += __uint_as_float((qa[kk][0] ^ qa[kk][1] ^ r[0] ^ r[1]) & 0x3c00u);",
    "MM::run(sc[1], qa[kk][0], 0u, qa[kk][1], 0u, r[2], r[3]);":
        "sc[1][kk % 4] += __uint_as_float((qa[kk][0] ^ qa[kk][1] ^ r[2] ^ r[3]) & 0x3c00u);",
}
_PV_MMAS = {
    "MM::run(o[2 * g + j], a0, a1, a2, a3, pa0, pa2);":
        "o[2 * g + j][0] += __uint_as_float((a0 ^ a1 ^ a2 ^ a3 ^ pa0 ^ pa2) & 0x3c00u);",
    "MM::run(o[n], pa0, 0u, pa2, 0u, r[0], r[1]);": "o[n][0] += __uint_as_float((pa0 ^ pa2 ^ r[0] ^ r[1]) & 0x3c00u);",
    "MM::run(o[n + 1], pa0, 0u, pa2, 0u, r[2], r[3]);":
        "o[n + 1][0] += __uint_as_float((pa0 ^ pa2 ^ r[2] ^ r[3]) & 0x3c00u);",
}


def _no_mma(*tables: dict[str, str]):
    def transform(name: str, src: str) -> str:
        if name != "decode_split.cu":
            return src
        for table in tables:
            for old, new in table.items():
                if src.count(old) != 1:
                    raise SystemExit(f"probe_pipeline: {old!r} not found once in decode_split.cu")
                src = src.replace(old, new)
        return src
    return transform


#: Source patches (file name, text) -> text, applied before anything compiles.
#: - head-order: decode_split_mma's block-index mapping puts the CTAs of one split's KV heads
#:   adjacent in launch order (the grid keeps its shape; two-launch plans only: the fused merge's
#:   tickets still index by blockIdx.y);
#: - e4m3-alu: E4M3 codes decoded by the sm_80 bit moves (prmt, shift, lop3; scale 256 folded into
#:   the descales) instead of sm_89's cvt.rn.f16x2.e4m3x2 (NaN codes then read as finite values);
#: - e4m3-lop: WRONG VALUES, timing only: E4M3 pairs "decoded" by one and / one shift (the ALU
#:   pipes) instead of two cvt, to see what the conversion's pipe costs;
#: - no-qk / no-pv / no-mma: WRONG VALUES, timing only: the Q.K, the P.V or both tensor-core
#:   products of the 16-bit and FP8 paths replaced by a dependent add of their operands' bits
#:   (fragment loads and conversions stay): what the products cost.
VARIANTS = {"shipped": None, "head-order": _head_order, "e4m3-alu": _e4m3_alu,
            "e4m3-lop": _e4m3_lop, "no-qk": _no_mma(_QK_MMAS), "no-pv": _no_mma(_PV_MMAS),
            "no-mma": _no_mma(_QK_MMAS, _PV_MMAS)}


def patch(variant: str) -> None:
    if VARIANTS[variant] is not None:
        use_sources(VARIANTS[variant])


def _inputs(b: int, n: int, kv: str, seed: int, layout: str) -> tuple:
    rs = cp.random.RandomState(seed)
    q = rs.standard_normal((b, HQ, D), dtype=cp.float32).astype(cp.float16)
    shape = (b, n, HKV, D) if layout == "NHD" else (b, HKV, n, D)
    k, v = (rs.standard_normal(shape, dtype=cp.float32).astype(cp.float16) for _ in range(2))
    if kv == "fp16":
        return q, k, v, {"kv_layout": layout}
    qkv = fdpp.quantize_kv(k, v, kv, kv_layout=layout)
    return q, qkv.k, qkv.v, {"kv_dtype": kv, "k_descale": qkv.k_descale, "v_descale": qkv.v_descale,
                             "kv_layout": layout}


def plans(prob: configs.DecodeProblem, shapes: list[str], splits: list[int]) -> list[tuple[str, configs.LaunchPlan]]:
    out = [table_row(prob)]
    g = configs.group_size_for(prob.ratio)
    last = out[0][1].kernels[-1]  # the table's combine (slices) where it has one, else the default
    combine = last if isinstance(last, configs.CombineConfig) else None
    for s in shapes:
        cfg = shape_config(s, prob.dtype, prob.head_dim, g, kv_dtype=prob.kv_dtype)
        if cfg.is_valid(configs.SM90):
            out += [(f"{cfg.key} splits {n}", configs.LaunchPlan.split_kv(cfg, n, combine)) for n in splits]
    return out


def time_point(b: int, n: int, kv: str, layout: str, labelled: list[tuple[str, configs.LaunchPlan]]) -> None:
    per = 2 * b * n * HKV * D * (2 if kv == "fp16" else 1)
    count = timing.rotation_count(per, timing.l2_bytes(), factor=4, max_sets=64)
    sets = [_inputs(b, n, kv, 100 + i, layout) for i in range(count)]
    outs = [cp.empty((b, HQ, D), cp.float16) for _ in sets]
    q0, k0, v0, kw0 = sets[0]
    kd, vd = (k0, v0) if kv == "fp16" else fdpp.dequantize_kv(
        fdpp.quantize_kv(*_inputs(b, n, "fp16", 100, layout)[1:3], kv, kv_layout=layout))
    ref, _ = attention_reference(q0, kd, vd, kv_layout=layout)
    fl = timing.time_stream_read(per, repeats=9)  # its own buffer of the same size, rotated as the sets
    print(f"{kv:>8} {b:>3} {n:>6} {fl.median_us:8.2f} {fl.p10_us:8.2f} {fl.p90_us:8.2f} {'':>9}  floor", flush=True)
    time_rows(f"{kv:>8} {b:>3} {n:>6}", labelled, sets, outs, ref,
              lambda s, o=None: fdpp.decode_attention(*s[:3], **s[3], out=o))
    del sets, outs
    cp.get_default_memory_pool().free_all_blocks()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", default="fp16,fp8_e4m3")
    ap.add_argument("--batch", type=_ints, default=[1])
    ap.add_argument("--seqlens", type=_ints, default=[16384, 65536])
    ap.add_argument("--shapes", default="w4s3u1,w4s4u1,w4s5u1,w4s6u1")
    ap.add_argument("--splits", type=_ints, default=[16, 33])
    ap.add_argument("--layout", choices=("NHD", "HND"), default="NHD")
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="shipped")
    ap.add_argument("--kernel-dir", type=Path, help="read decode_split.cu and kv_cache.cuh from here (another revision)")
    ap.add_argument("--cp-prefetch", type=int, default=0,
                    help="K/V cp.async with the L2 prefetch hint .L2::<n>B (64, 128, 256; 0: as shipped)")
    ap.add_argument("--jobs", type=int, default=16)
    args = ap.parse_args()
    patch(args.variant)
    if args.kernel_dir:
        use_kernel_dir(args.kernel_dir)
    if args.cp_prefetch:  # on top of the variant / kernel dir: every file as it now reads
        kdir = registry.kernel_dir()
        use_kernel_dir(kdir, names=None, transform=cp_prefetch(args.cp_prefetch))
    points = [(kv, b, n) for kv in args.kv.split(",") for b in args.batch for n in args.seqlens]
    todo = {}
    for kv, b, n in points:
        prob = configs.DecodeProblem(b, HQ, HKV, D, n, "fp16", kv_dtype="" if kv == "fp16" else kv)
        labelled = plans(prob, [s for s in args.shapes.split(",") if s], args.splits)
        # head order: the fused merge's tickets index by blockIdx.y, and clusters merge in a cluster
        todo[kv, b, n] = [(lb, p) for lb, p in labelled
                          if args.variant != "head-order" or (not p.fused and p.split.cluster == 1)]
    kernels = {c.key: c for ps in todo.values() for _, p in ps for c in p.kernels}
    tune.precompile(list(kernels.values()), jobs=args.jobs)
    print(f"layout {args.layout}, kernel source {args.kernel_dir or 'kernels_cu'}, variant {args.variant}")
    print(PROBE_HEADER.replace("heads", "    kv"))
    for (kv, b, n), labelled in todo.items():
        time_point(b, n, kv, args.layout, labelled)


if __name__ == "__main__":
    main()
