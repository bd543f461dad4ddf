#!/usr/bin/env python3
"""Every fdpp kernel family on small representative and edge shapes, checked against the float64
reference: the workload that ``scripts/sanitize.sh`` runs under compute-sanitizer (memcheck,
racecheck, initcheck, synccheck). Without a sanitizer it is a quick correctness smoke test:

    python3 scripts/sanitize_workload.py            # every family; prints "sanitize_workload: OK"
    python3 scripts/sanitize_workload.py --list     # the families (no GPU needed)
    python3 scripts/sanitize_workload.py --families paged,cache
    python3 scripts/sanitize_workload.py --summarize LOG   # parse a compute-sanitizer log (no GPU)

Caching allocators are off (``cupy.cuda.set_allocator(None)``, ``set_pinned_memory_allocator(None)``,
``PYTORCH_NO_CUDA_MEMORY_CACHING=1``), so every device buffer is its own cudaMalloc and memcheck
sees an access past its end. Kernels are compiled with ``-lineinfo`` (``FDPP_SANITIZE_LINEINFO=0``
turns that off) so reports name source lines. A family that fails (wrong result, or an exception)
is reported and the others still run; the exit status is 1 if any failed.

Shapes: lengths 0, 1 and 97 (not a multiple of any tile or page), batch 1 and 3, GQA ratios 1 and 4,
head_dim 64 / 96 / 128, several split counts (the combine kernel), NHD and HND, pages of 1, 16 and
256 tokens in shuffled block tables with garbage in the unused entries, a block-table entry outside
the pool and lengths outside [0, N_max] (NaN for those requests only, no access outside the pool).

Importable without a GPU: nothing imports CuPy or torch at module level.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Kernel names of fdpp's families (``fdpp::<name><...>``): a sanitizer error in one of these fails.
FDPP_KERNELS = ("decode_split_mma_cluster", "decode_split_mma", "decode_split", "decode_combine", "decode_nosplit", "paged_append",
                "paged_append_quant", "paged_table_update", "flat_gemm", "flat_tma", "gemv", "stream_read",
                "merge_states", "kv_amax", "kv_descale", "quantize_fp8", "quantize_int4", "dequant_fp8",
                "dequant_int4")


# ---- the families ---------------------------------------------------------------------------
@dataclass
class Ctx:
    cp: Any
    dev: int
    limits: Any
    rng: np.random.Generator
    checks: int = 0
    notes: list[str] = field(default_factory=list)

    def sync(self) -> None:
        self.cp.cuda.Device(self.dev).synchronize()


def _np_dtype(dt: str) -> np.dtype:
    from fdpp.dtypes import DTYPES

    return DTYPES[dt].np_dtype


def _host(ctx: Ctx, x: Any) -> np.ndarray:
    """A device array on the host, as float64 (bit copies only: no CuPy kernel on bf16)."""
    h = ctx.cp.asnumpy(x)
    return h if h.dtype.kind in "iub" else np.asarray(h, dtype=np.float64)


def _rand(ctx: Ctx, shape: tuple[int, ...], dt: str, scale: float = 1.0) -> Any:
    h = (ctx.rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(_np_dtype(dt))
    return ctx.cp.asarray(h)


def _poisoned(ctx: Ctx, shape: tuple[int, ...], dt: str) -> Any:
    return ctx.cp.asarray(np.full(shape, np.nan, dtype=np.float32).astype(_np_dtype(dt)))


def _close(ctx: Ctx, out: Any, ref: Any, dt: str, what: str, rows: Any = slice(None)) -> None:
    from fdpp.reference import assert_close

    o = _host(ctx, out)[rows]
    r = np.asarray(ref, dtype=np.float64)[rows]
    try:
        assert_close(o, r, dt)
    except AssertionError as e:
        raise AssertionError(f"{what}: {str(e)[:400]}") from None
    ctx.checks += 1


def _check_lse(ctx: Ctx, lse: Any, ref_lse: Any, what: str, rows: Any = slice(None)) -> None:
    lh, rl = _host(ctx, lse)[rows], np.asarray(ref_lse)[rows]
    if not np.array_equal(np.isneginf(lh), np.isneginf(rl)):
        raise AssertionError(f"{what}: lse -inf pattern differs")
    fin = np.isfinite(rl)
    if not np.allclose(lh[fin], rl[fin], rtol=1e-4, atol=1e-3):
        raise AssertionError(f"{what}: lse differs by {np.abs(lh[fin] - rl[fin]).max():.3g}")


def _contiguous_case(ctx: Ctx, dt: str, b: int, hkv: int, ratio: int, d: int, n_max: int, lens: list[int],
                     layout: str = "NHD", splits: int | None = None, plan: Any = None, nosplit: bool = False,
                     what: str = "") -> None:
    import fdpp
    from fdpp import dispatch
    from fdpp.reference import attention_reference

    cp = ctx.cp
    hq = hkv * ratio
    kv_shape = (b, n_max, hkv, d) if layout == "NHD" else (b, hkv, n_max, d)
    q, k, v = _rand(ctx, (b, hq, d), dt), _rand(ctx, kv_shape, dt), _rand(ctx, kv_shape, dt)
    lens_d = cp.asarray(np.asarray(lens, np.int32))
    out = _poisoned(ctx, (b, hq, d), dt)
    kw: dict[str, Any] = dict(cache_seqlens=lens_d, kv_layout=layout, return_lse=True, out=out)
    with dispatch.forced_plan(plan) if plan is not None else contextlib.nullcontext():
        if nosplit:
            res, lse = fdpp.decode_attention_nosplit(q, k, v, **kw)
        else:
            res, lse = fdpp.decode_attention(q, k, v, num_splits=splits, **kw)
    ctx.sync()
    ref, ref_lse = attention_reference(_host(ctx, q), _host(ctx, k), _host(ctx, v), np.asarray(lens), None, layout)
    tag = f"{what} {dt} b{b} q{hq}/kv{hkv} d{d} N{n_max} lens{lens} {layout} splits={splits}"
    _close(ctx, res, ref, dt, tag)
    _check_lse(ctx, lse, ref_lse, tag)


def fam_decode_split(ctx: Ctx) -> None:
    """decode_split on CUDA cores: fp32 (the heuristic's kernel for fp32 and head_dim 96), and fp16
    through a forced non-mma config; 1 and several splits (decode_combine)."""
    from fdpp.configs import DecodeConfig, LaunchPlan, group_size_for

    for b, hkv, ratio, d, lens, layout, splits in [
        (1, 2, 1, 128, [97], "NHD", 1), (3, 2, 4, 64, [0, 1, 97], "HND", 3), (3, 1, 4, 96, [97, 0, 1], "NHD", None),
        (1, 1, 4, 128, [1], "NHD", 4),
    ]:
        _contiguous_case(ctx, "fp32", b, hkv, ratio, d, max(lens), lens, layout, splits, what="decode_split")
    for b, hkv, ratio, d, lens, splits in [(1, 2, 1, 128, [97], 1), (3, 2, 4, 64, [0, 1, 97], 4),
                                           (3, 1, 4, 96, [1, 97, 0], 2)]:
        cfg = DecodeConfig("fp16", d, group_size_for(ratio), num_warps=4, num_stages=2, unroll=2, mma=False)
        why = cfg.check(ctx.limits)
        if why:
            raise AssertionError(f"the forced CUDA-core fp16 config {cfg.key} is invalid here: {why}")
        _contiguous_case(ctx, "fp16", b, hkv, ratio, d, max(lens), lens, "NHD",
                         plan=LaunchPlan.split_kv(cfg, splits, source="sanitize"), what="decode_split(fp16, forced)")


def fam_decode_split_mma(ctx: Ctx) -> None:
    """decode_split_mma (tensor cores): fp16 and bf16, head_dim 64/128, 1 and several splits."""
    for dt, b, hkv, ratio, d, lens, layout, splits in [
        ("fp16", 1, 2, 1, 128, [97], "NHD", 1), ("bf16", 3, 2, 4, 64, [0, 1, 97], "NHD", 3),
        ("fp16", 3, 1, 4, 128, [97, 1, 0], "HND", None), ("bf16", 1, 2, 4, 128, [1], "HND", 2),
    ]:
        _contiguous_case(ctx, dt, b, hkv, ratio, d, max(lens), lens, layout, splits, what="decode_split_mma")


def _merge_plan(dt: str, d: int, ratio: int, splits: int, fused: bool, bucket: int = 0, slices: int = 1) -> Any:
    from fdpp.configs import CombineConfig, DecodeProblem, LaunchPlan, default_kernel

    cfg = default_kernel(DecodeProblem(1, ratio, 1, d, 4096, dt), split=True)
    if fused:
        return LaunchPlan.split_kv(cfg, splits, source="sanitize", fused=True, bucket=bucket)
    return LaunchPlan.split_kv(cfg, splits, CombineConfig(dt, d, 4, slices), source="sanitize")


def fam_decode_combine(ctx: Ctx) -> None:
    """decode_combine (the two-launch merge) on its own terms: many splits, most of them empty
    (short requests), head dim sliced over 1, 4 and 8 CTAs per row."""
    for dt, lens, splits, slices in [("fp16", [97, 0, 1], 16, 1), ("fp32", [1, 97, 96], 7, 4),
                                     ("bf16", [0, 0, 97], 97, 8)]:
        _contiguous_case(ctx, dt, 3, 2, 4, 64, 97, lens, "NHD", plan=_merge_plan(dt, 64, 4, splits, False, slices=slices),
                         what=f"decode_combine slices {slices}")


def fam_fused(ctx: Ctx) -> None:
    """The fused single launch: the last CTA of each group merges (one level, and buckets)."""
    for dt, lens, splits, bucket, ratio, d in [("fp16", [97, 0, 1], 16, 0, 4, 64), ("bf16", [300, 299, 1], 40, 6, 8, 128),
                                               ("fp32", [300, 0, 5], 33, 4, 1, 128)]:
        _contiguous_case(ctx, dt, 3, 1, ratio, d, max(lens), lens, "NHD",
                         plan=_merge_plan(dt, d, ratio, splits, True, bucket), what=f"fused bucket {bucket}")


def fam_cluster(ctx: Ctx) -> None:
    """The cluster merge (sm_90): the splits of each group merged through distributed shared memory
    (cluster sizes 2, 8 and 16; requests shorter than the cluster, one empty)."""
    from fdpp.configs import DecodeProblem, LaunchPlan, default_kernel

    if ctx.limits.cc[0] < 9:
        print("cluster: needs sm_90 or newer; skipped")
        return
    for dt, lens, cluster, ratio, d in [("fp16", [97, 0, 1], 16, 4, 64), ("bf16", [300, 299, 5], 8, 8, 128),
                                        ("fp16", [3000, 17, 1], 2, 1, 128)]:
        cfg = default_kernel(DecodeProblem(1, ratio, 1, d, 4096, dt), split=True)
        _contiguous_case(ctx, dt, 3, 1, ratio, d, max(lens), lens, "NHD",
                         plan=LaunchPlan.cluster_merge(cfg, cluster, source="sanitize"), what=f"cluster {cluster}")


def fam_merge_states(ctx: Ctx) -> None:
    """merge_states / merge_state_ against the float64 reference (one part empty)."""
    import fdpp
    from fdpp.reference import merge_states_reference

    cp = ctx.cp
    for dt, s, b, h, d in [("fp16", 3, 2, 4, 128), ("fp32", 2, 1, 8, 64), ("bf16", 5, 3, 2, 256)]:
        outs = _rand(ctx, (s, b, h, d), dt)
        lses = cp.asarray(np.random.default_rng(s).standard_normal((s, b, h)).astype(np.float32))
        lses[0, 0, 0] = -np.inf
        o, lse = fdpp.merge_states(outs, lses)
        ctx.sync()
        ref, _ = merge_states_reference(_host(ctx, outs), _host(ctx, lses))
        _close(ctx, o, ref, dt, f"merge_states {dt} S{s} B{b} H{h} D{d}")
        o2, l2 = _poisoned(ctx, (b, h, d), dt), cp.empty((b, h), dtype=np.float32)
        o2[...] = outs[0]
        l2[...] = lses[0]
        fdpp.merge_state_(o2, l2, outs[1], lses[1])
        ctx.sync()


def fam_decode_nosplit(ctx: Ctx) -> None:
    """decode_nosplit (the no-split baseline)."""
    for dt, b, hkv, ratio, d, lens in [("fp16", 3, 2, 4, 128, [0, 1, 97]), ("fp32", 1, 1, 1, 96, [97]),
                                       ("bf16", 1, 2, 1, 64, [1])]:
        _contiguous_case(ctx, dt, b, hkv, ratio, d, max(lens), lens, "NHD", nosplit=True, what="decode_nosplit")


def fam_bad_lengths(ctx: Ctx) -> None:
    """Contiguous cache, device lengths outside [0, N_max]: NaN for those requests only."""
    import fdpp

    cp = ctx.cp
    for dt, splits in (("fp16", 1), ("fp32", 4)):
        q, k = _rand(ctx, (3, 8, 128), dt), _rand(ctx, (3, 97, 2, 128), dt)
        good = fdpp.decode_attention(q, k, k, cache_seqlens=cp.asarray(np.array([97, 5, 1], np.int32)),
                                     num_splits=splits)
        out = fdpp.decode_attention(q, k, k, cache_seqlens=cp.asarray(np.array([97, 98, -1], np.int32)),
                                    num_splits=splits)
        ctx.sync()
        o, g = _host(ctx, out), _host(ctx, good)
        if not (np.isnan(o[1:]).all() and np.array_equal(o[0], g[0])):
            raise AssertionError(f"bad lengths ({dt}, splits {splits}): expected NaN for requests 1, 2 only")
        ctx.checks += 1


def _paged_inputs(ctx: Ctx, dt: str, b: int, hkv: int, ratio: int, d: int, page: int, lens: list[int],
                  layout: str, spare: int = 2) -> tuple[Any, ...]:
    cp = ctx.cp
    per = [-(-n // page) for n in lens]
    width = max(1, max(per))
    num_pages = sum(per) + spare
    perm = ctx.rng.permutation(num_pages)
    table = ctx.rng.integers(-5, 2 * num_pages, size=(b, width)).astype(np.int32)  # unused: never read
    nxt = 0
    for i, p in enumerate(per):
        table[i, :p] = perm[nxt:nxt + p]
        nxt += p
    shape = (num_pages, page, hkv, d) if layout == "NHD" else (num_pages, hkv, page, d)
    return (_rand(ctx, (b, hkv * ratio, d), dt), _rand(ctx, shape, dt), _rand(ctx, shape, dt), cp.asarray(table),
            cp.asarray(np.asarray(lens, np.int32)))


def fam_paged(ctx: Ctx) -> None:
    """paged_decode_attention: pages of 1, 16 and 256 tokens, shuffled tables, garbage in unused
    entries; then a block-table entry outside the pool and lengths outside [0, N_max]."""
    import fdpp
    from fdpp.reference import paged_attention_reference

    cp = ctx.cp
    for dt, page, b, hkv, ratio, d, lens, layout, splits in [
        ("fp16", 1, 3, 2, 4, 128, [0, 1, 97], "NHD", None), ("bf16", 16, 3, 1, 4, 64, [97, 0, 1], "HND", 3),
        ("fp32", 256, 1, 2, 1, 64, [97], "NHD", 1), ("fp16", 16, 1, 2, 1, 128, [97], "NHD", 4),
        ("fp32", 16, 3, 2, 4, 96, [1, 97, 0], "HND", 2),
    ]:
        q, kp, vp, table, lens_d = _paged_inputs(ctx, dt, b, hkv, ratio, d, page, lens, layout)
        out = _poisoned(ctx, q.shape, dt)
        res, lse = fdpp.paged_decode_attention(q, kp, vp, table, lens_d, kv_layout=layout, num_splits=splits,
                                               return_lse=True, out=out)
        ctx.sync()
        ref, ref_lse = paged_attention_reference(_host(ctx, q), _host(ctx, kp), _host(ctx, vp), cp.asnumpy(table),
                                                 np.asarray(lens), None, layout)
        tag = f"paged {dt} page {page} b{b} d{d} lens{lens} {layout} splits={splits}"
        _close(ctx, res, ref, dt, tag)
        _check_lse(ctx, lse, ref_lse, tag)
    # hostile device values (checks off): NaN for the bad requests, nothing read outside the pool
    fdpp.set_checks(False)
    for page, splits in ((16, 1), (1, 4), (256, 2)):
        lens = [97, 50, 60, 40]
        q, kp, vp, table, lens_d = _paged_inputs(ctx, "fp16", 4, 2, 4, 128, page, lens, "NHD")
        good = fdpp.paged_decode_attention(q, kp, vp, table, lens_d, num_splits=splits)
        bad_t = cp.asnumpy(table)
        bad_t[1, min(1, (50 - 1) // page)] = kp.shape[0]  # one past the pool, in a used entry
        bad_t[2, 0] = -1
        bad_l = np.asarray(lens, np.int32)
        bad_l[3] = bad_t.shape[1] * page + 1  # past what the row addresses
        out = fdpp.paged_decode_attention(q, kp, vp, cp.asarray(bad_t), cp.asarray(bad_l), num_splits=splits)
        neg = np.asarray(lens, np.int32)
        neg[0] = -7
        out2 = fdpp.paged_decode_attention(q, kp, vp, table, cp.asarray(neg), num_splits=splits)
        ctx.sync()
        o, g, o2 = _host(ctx, out), _host(ctx, good), _host(ctx, out2)
        if not (np.isnan(o[1:]).all() and np.array_equal(o[0], g[0])):
            raise AssertionError(f"paged bad table/length (page {page}): expected NaN for requests 1-3 only")
        if not (np.isnan(o2[0]).all() and np.array_equal(o2[1:], g[1:])):
            raise AssertionError(f"paged negative length (page {page}): expected NaN for request 0 only")
        ctx.checks += 1


def fam_cache(ctx: Ctx) -> None:
    """PagedKVCache on CuPy: paged_append (append, extend) and paged_table_update (reserve,
    set_batch), copy-on-write after a fork, aligned and misaligned sources; contents read back
    through the pages equal what was written, bit for bit."""
    from fdpp.cache import PagedKVCache

    cp = ctx.cp
    for dt, page, layout, d in (("fp16", 16, "NHD", 64), ("bf16", 1, "HND", 128), ("fp32", 16, "HND", 96)):
        h, layers = 2, 2
        c = PagedKVCache(layers, 256, page, h, d, dtype=dt, kv_layout=layout, max_batch=3, backend="cupy",
                         device=ctx.dev)
        exp: dict[int, list[list[list[np.ndarray]]]] = {}
        seqs = [c.allocate() for _ in range(3)]
        for s, n in zip(seqs, (0, 19, 40), strict=True):
            exp[s] = [[[], []] for _ in range(layers)]
            for chunk in ([n] if n < 30 else [25, n - 25]) if n else []:
                c.extend_reserve(s, chunk)
                for layer in range(layers):
                    kv = [ctx.rng.standard_normal((chunk, h, d), dtype=np.float32).astype(_np_dtype(dt))
                          for _ in range(2)]
                    c.extend(layer, s, cp.asarray(kv[0]), cp.asarray(kv[1]))
                    for j in range(2):
                        exp[s][layer][j].append(kv[j])
        batch = list(seqs)
        c.set_batch(batch)
        for step in range(6):
            if step == 3:  # fork: the next reserve copies the shared, partly filled last page
                child = c.fork(batch[1])
                exp[child] = [[list(x) for x in lay] for lay in exp[batch[1]]]
                batch = [batch[0], batch[1], child]
                c.set_batch(batch)
            c.reserve(1)
            for layer in range(layers):
                kv = [ctx.rng.standard_normal((len(batch), h, d), dtype=np.float32).astype(_np_dtype(dt))
                      for _ in range(2)]
                if step % 2:  # a misaligned strided source: the cache copies it first
                    pads = []
                    for x in kv:
                        pad = np.zeros(x.shape[:2] + (d + 1,), x.dtype)
                        pad[..., 1:] = x
                        pads.append(cp.asarray(pad)[..., 1:])
                    c.append(layer, pads[0], pads[1])
                else:
                    c.append(layer, cp.asarray(kv[0]), cp.asarray(kv[1]))
                for i, s in enumerate(batch):
                    for j in range(2):
                        exp[s][layer][j].append(kv[j][i:i + 1])
        ctx.sync()
        for s, lay in exp.items():
            pages = np.asarray(c.pages(s), np.int64)
            pos = np.arange(c.length(s))
            for layer in range(layers):
                for j, pool in enumerate((c.k_pages(layer), c.v_pages(layer))):
                    p = c.to_numpy(pool)
                    got = p[pages[pos // page], pos % page] if layout == "NHD" else p[pages[pos // page], :, pos % page]
                    want = np.concatenate(lay[layer][j]) if lay[layer][j] else np.zeros((0, h, d), got.dtype)
                    if got.tobytes() != np.ascontiguousarray(want).tobytes():
                        raise AssertionError(f"cache {dt} page {page} {layout}: seq {s} layer {layer} differs")
        bt, ln = c.to_numpy(c.block_table), c.to_numpy(c.seqlens)
        for r, s in enumerate(c.batch):
            if list(bt[r, :len(c.pages(s))]) != list(c.pages(s)) or ln[r] != c.length(s):
                raise AssertionError(f"cache {dt}: device block table / seqlens row {r} differ")
        ctx.checks += 1


def fam_quantized(ctx: Ctx) -> None:
    """Quantized caches (the FP8 and INT4 KV-type policies of decode_split_mma): contiguous caches
    from fdpp.quantize_kv (E4M3, E5M2; INT4 in groups of 32, 64 and 128, so one group per row and
    its 2-byte scale offsets too), NHD and HND, lengths 0 / 1 / 97, 1 and several splits; paged
    FP8 and INT4 caches from PagedKVCache (pages of 1 and 16) through attention_kwargs. Checked
    against the float64 reference over the dequantised cache."""
    import fdpp
    from fdpp import quant
    from fdpp.cache import PagedKVCache
    from fdpp.reference import attention_reference, paged_attention_reference

    cp = ctx.cp
    for fmt, g, b, hkv, ratio, d, lens, layout, splits in [
        ("fp8_e4m3", 0, 3, 2, 4, 128, [0, 1, 97], "NHD", None), ("fp8_e5m2", 0, 1, 1, 4, 64, [97], "HND", 3),
        ("int4", 32, 3, 2, 4, 128, [97, 0, 1], "NHD", None), ("int4", 64, 1, 2, 1, 64, [97], "HND", 2),
        ("int4", 128, 3, 3, 3, 128, [1, 97, 0], "NHD", 1), ("int4", 64, 1, 1, 8, 128, [97], "NHD", 4),
    ]:
        hq, n_max = hkv * ratio, max(lens)
        kv_shape = (b, n_max, hkv, d) if layout == "NHD" else (b, hkv, n_max, d)
        q, k, v = _rand(ctx, (b, hq, d), "fp16"), _rand(ctx, kv_shape, "fp16"), _rand(ctx, kv_shape, "fp16")
        qkv = fdpp.quantize_kv(k, v, fmt, group_size=g or 64, kv_layout=layout)
        kk, vv = (_host(ctx, x) for x in fdpp.dequantize_kv(qkv))
        kw: dict[str, Any] = dict(kv_dtype=fmt)
        if fmt == "int4":
            kw.update(k_descale=qkv.k_scale, v_descale=qkv.v_scale, k_zero=qkv.k_zero, v_zero=qkv.v_zero)
        else:
            kw.update(k_descale=qkv.k_descale, v_descale=qkv.v_descale)
        out = _poisoned(ctx, (b, hq, d), "fp16")
        res, lse = fdpp.decode_attention(q, qkv.k, qkv.v, cache_seqlens=cp.asarray(np.asarray(lens, np.int32)),
                                         kv_layout=layout, num_splits=splits, return_lse=True, out=out, **kw)
        ctx.sync()
        ref, ref_lse = attention_reference(_host(ctx, q), kk, vv, np.asarray(lens), None, layout)
        tag = f"quantized {fmt} g{g} b{b} q{hq}/kv{hkv} d{d} lens{lens} {layout} splits={splits}"
        _close(ctx, res, ref, "fp16", tag)
        _check_lse(ctx, lse, ref_lse, tag)
    for fmt, page, layout in (("int4", 16, "NHD"), ("int4", 1, "HND"), ("fp8_e4m3", 16, "HND")):
        h, d, ratio = 2, 128, 4
        c = PagedKVCache(1, 64, page, h, d, dtype="fp16", kv_layout=layout, max_batch=3, backend="cupy",
                         device=ctx.dev, kv_format=fmt, group_size=64)
        seqs = [c.allocate() for _ in range(3)]
        lens = [0, 19, 40]
        for sq, n in zip(seqs, lens, strict=True):
            if n:
                c.extend_reserve(sq, n)
                c.extend(0, sq, _rand(ctx, (n, h, d), "fp16"), _rand(ctx, (n, h, d), "fp16"))
        c.set_batch(seqs)
        kw = c.attention_kwargs(0)
        q = _rand(ctx, (3, h * ratio, d), "fp16")
        out = _poisoned(ctx, q.shape, "fp16")
        res, lse = fdpp.paged_decode_attention(q, c.k_pages(0), c.v_pages(0), c.block_table, c.seqlens,
                                               kv_layout=layout, return_lse=True, out=out, **kw)
        ctx.sync()
        hn = c.to_numpy
        if fmt == "int4":
            kk = quant.dequant_int4(hn(c.k_pages(0)), hn(kw["k_descale"]), hn(kw["k_zero"]), 64)
            vv = quant.dequant_int4(hn(c.v_pages(0)), hn(kw["v_descale"]), hn(kw["v_zero"]), 64)
        else:  # per-KV-head descales: the head axis is 2 (NHD) or 1 (HND) of the pool
            shape = (1, 1, h, 1) if layout == "NHD" else (1, h, 1, 1)
            kk = quant.dequant_fp8(hn(c.k_pages(0)), fmt, hn(kw["k_descale"]).reshape(shape))
            vv = quant.dequant_fp8(hn(c.v_pages(0)), fmt, hn(kw["v_descale"]).reshape(shape))
        ref, ref_lse = paged_attention_reference(_host(ctx, q), kk, vv, hn(c.block_table), np.asarray(lens), None,
                                                 layout)
        tag = f"quantized paged {fmt} page {page} {layout}"
        _close(ctx, res, ref, "fp16", tag)
        _check_lse(ctx, lse, ref_lse, tag)


def fam_flat_gemm(ctx: Ctx) -> None:
    """flat_gemm's own kernels, forced (never cuBLAS): flat_gemm (cp.async), flat_tma (bulk copies,
    sm_90+), gemv; one wave (stream-K fix-up) and one CTA per tile; M 1 and 3; with and without bias;
    K not a multiple of any tile."""
    import fdpp
    from fdpp import gemm

    plans = [gemm.GemmPlan("flat", gemm.FlatGemmConfig("fp16", 64, 128, 4, 4, 1), None),
             gemm.GemmPlan("flat", gemm.FlatGemmConfig("fp16", 32, 256, 4, 4, 1), "tiles"),
             gemm.GemmPlan("gemv", gemm.GemvConfig("fp16", 4, 2, 2, 1), None),
             gemm.GemmPlan("gemv", gemm.GemvConfig("fp16", 8, 2, 2, 1), "tiles")]
    if tuple(ctx.limits.cc) >= (9, 0):
        plans += [gemm.GemmPlan("tma", gemm.FlatTmaConfig("fp16", 4, 8, 1, 2, 0), None),
                  gemm.GemmPlan("tma", gemm.FlatTmaConfig("fp16", 8, 4, 1, 2, 1, 2), "tiles")]
    else:
        ctx.notes.append(f"flat_tma skipped: sm_{ctx.limits.cc[0]}{ctx.limits.cc[1]} < sm_90")
    n, k = 200, 520
    for dt in ("fp16", "bf16"):
        w = _rand(ctx, (n, k), dt, 0.1)
        bias = _rand(ctx, (n,), dt)
        for plan in plans:
            for m in (1, 3):
                cfg = plan.config.for_m(m)
                grid = -(-n // cfg.block_n) if plan.grid == "tiles" else None
                forced = gemm.GemmPlan(plan.impl, cfg, grid, source="forced")
                x = _rand(ctx, (m, k), dt)
                for b in (None, bias):
                    out = _poisoned(ctx, (m, n), dt)
                    with gemm.forced_plan(forced):
                        y = fdpp.flat_gemm(x, w, bias=b, out=out)
                    ctx.sync()
                    ref = _host(ctx, x) @ _host(ctx, w).T + (0 if b is None else _host(ctx, b))
                    _close(ctx, y, ref, dt, f"flat_gemm {plan.impl} {cfg.key} grid={grid} {dt} M{m} bias={b is not None}")


def fam_stream_read(ctx: Ctx) -> None:
    """stream_read (the benchmarks' floor kernel) over a buffer whose size is not a multiple of
    the grid's stride."""
    from fdpp import timing

    buf = ctx.cp.zeros((1 << 20) + 48, dtype=ctx.cp.uint8)
    for cfg in (timing.StreamReadConfig(), timing.StreamReadConfig(unroll=2, num_warps=4, ctas_per_sm=2)):
        timing._stream_read_call(cfg, buf.data.ptr, buf.size, ctx.dev)()
    ctx.sync()
    ctx.checks += 1


def fam_torch(ctx: Ctx) -> None:
    """decode_attention and paged_decode_attention on torch tensors (partials from torch's
    allocator, torch's stream); skipped without torch."""
    try:
        import torch
    except ImportError:
        ctx.notes.append("torch family skipped: torch not installed")
        return
    import fdpp
    from fdpp.reference import attention_reference, paged_attention_reference

    cp = ctx.cp
    dev = torch.device("cuda", ctx.dev)
    q, k = _rand(ctx, (3, 8, 128), "fp16"), _rand(ctx, (3, 97, 2, 128), "fp16")
    lens = np.array([0, 1, 97], np.int32)
    tq, tk = torch.from_dlpack(q), torch.from_dlpack(k)
    out = fdpp.decode_attention(tq, tk, tk, cache_seqlens=torch.tensor(lens, device=dev), num_splits=4)
    torch.cuda.synchronize(dev)
    ref, _ = attention_reference(_host(ctx, q), _host(ctx, k), _host(ctx, k), lens)
    _close(ctx, cp.from_dlpack(out), ref, "fp16", "torch decode_attention")
    args = _paged_inputs(ctx, "fp16", 3, 2, 4, 64, 16, [97, 0, 1], "NHD")
    o = fdpp.paged_decode_attention(*(torch.from_dlpack(a) for a in args), num_splits=2)
    torch.cuda.synchronize(dev)
    ref, _ = paged_attention_reference(*(cp.asnumpy(a) for a in args))
    _close(ctx, cp.from_dlpack(o), ref, "fp16", "torch paged_decode_attention")


FAMILIES: dict[str, Callable[[Ctx], None]] = {
    "decode_split": fam_decode_split,
    "decode_split_mma": fam_decode_split_mma,
    "decode_combine": fam_decode_combine,
    "fused": fam_fused,
    "cluster": fam_cluster,
    "merge_states": fam_merge_states,
    "decode_nosplit": fam_decode_nosplit,
    "bad_lengths": fam_bad_lengths,
    "paged": fam_paged,
    "cache": fam_cache,
    "quantized": fam_quantized,
    "flat_gemm": fam_flat_gemm,
    "stream_read": fam_stream_read,
    "torch": fam_torch,
}


# ---- compute-sanitizer logs -----------------------------------------------------------------
@dataclass
class Record:
    head: str
    lines: list[str]
    kernel: str | None
    kind: str  # "kernel" | "api" | "other"
    severity: str  # "error" | "warning"

    @property
    def fdpp(self) -> bool:
        return self.kind == "kernel" and is_fdpp_kernel(self.kernel or " ".join(self.lines))


def is_fdpp_kernel(name: str) -> bool:
    if "fdpp::" in name:
        return True
    return any(re.search(rf"(?<![A-Za-z0-9_]){k}(?![A-Za-z0-9_])", name) for k in FDPP_KERNELS)


_PREFIX = re.compile(r"^=+ ?")
_NOT_RECORDS = ("COMPUTE-SANITIZER", "CUDA-MEMCHECK", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY")
_AT_NEW = re.compile(r"\bat (?:0x[0-9a-fA-F]+ in )?(?P<name>[^\s].*?)\+0x[0-9a-fA-F]+(?: in |$)")
_AT_OLD = re.compile(r"\bat 0x[0-9a-fA-F]+ in (?:[^\s:]+:\d+:)?(?P<name>[^\s].*)$")


def kernel_of(lines: list[str]) -> str | None:
    """The device function a record points at (newer "at fn(...)+0x1d0 in f.cu:12", older
    "at 0x1d0 in f.cu:12:fn(...)"); None if the record names none."""
    for ln in lines:
        if "Host Frame" in ln:
            continue
        m = _AT_NEW.search(ln) or _AT_OLD.search(ln)
        if m:
            return m.group("name").strip()
    return None


def parse_log(text: str) -> tuple[list[Record], list[str]]:
    """compute-sanitizer's log -> (error records, summary lines)."""
    records: list[Record] = []
    summaries: list[str] = []
    cur: list[str] | None = None

    def close() -> None:
        if not cur:
            return
        head = cur[0]
        if any(head.startswith(x) for x in _NOT_RECORDS):
            return
        api = "Program hit" in head or "CUDA API call" in head or "API error" in head
        kernel = None if api else kernel_of(cur)
        kind = "api" if api else ("kernel" if kernel or any(" at " in ln for ln in cur) else "other")
        severity = "warning" if head.lower().startswith("warning") else "error"
        records.append(Record(head, list(cur), kernel, kind, severity))

    for raw in text.splitlines():
        if not raw.startswith("="):
            continue  # the program's own output
        body = _PREFIX.sub("", raw, count=1)
        if "SUMMARY:" in body:
            summaries.append(body.strip())
        if not body.strip():
            close()
            cur = None
        elif body[0].isspace():
            if cur is not None:
                cur.append(body.strip())
        else:
            close()
            cur = [body.strip()]
    close()
    return records, summaries


def summarize(text: str) -> dict[str, Any]:
    """Counts and kernel lists of a log: what sanitize.sh writes into its report."""
    records, summaries = parse_log(text)

    def names(rs: list[Record]) -> list[str]:
        out: dict[str, int] = {}
        for r in rs:
            key = r.kernel or r.head
            out[key] = out.get(key, 0) + 1
        return [f"{k} ({n}x)" for k, n in sorted(out.items())]

    fdpp_err = [r for r in records if r.severity == "error" and (r.fdpp or (r.kind == "other" and
                                                                              is_fdpp_kernel(" ".join(r.lines))))]
    fdpp_warn = [r for r in records if r.fdpp and r.severity == "warning"]
    other = [r for r in records if r.kind == "kernel" and not r.fdpp]
    api = [r for r in records if r.kind == "api"]
    notes = [r for r in records if r.kind == "other" and not r.fdpp]  # "Target application ...", tool messages
    return {"summary": summaries, "fdpp_errors": len(fdpp_err), "fdpp_error_kernels": names(fdpp_err),
            "fdpp_warning_kernels": names(fdpp_warn), "other_kernels": names(other),
            "api_errors": sorted({r.head for r in api}), "notes": sorted({r.head for r in notes}),
            "records": len(records),
            "first_fdpp_error": "\n".join(fdpp_err[0].lines[:12]) if fdpp_err else ""}


# ---- main -----------------------------------------------------------------------------------
def _setup(device: int) -> Ctx:
    os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    import cupy

    cupy.cuda.set_allocator(None)  # every buffer its own cudaMalloc: memcheck sees overruns
    cupy.cuda.set_pinned_memory_allocator(None)
    cupy.cuda.Device(device).use()
    from fdpp import registry

    if os.environ.get("FDPP_SANITIZE_LINEINFO", "1") != "0" and "-lineinfo" not in registry.NVRTC_OPTIONS:
        registry.NVRTC_OPTIONS = (*registry.NVRTC_OPTIONS, "-lineinfo")  # read at each compile
    return Ctx(cupy, device, registry.device_limits(device), np.random.default_rng(0))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="all", help=f"comma list of {', '.join(FAMILIES)} (default: all)")
    ap.add_argument("--list", action="store_true", help="print the families and exit")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--summarize", metavar="LOG", help="parse a compute-sanitizer log and print a summary (JSON)")
    return ap


def describe(fn: Callable[..., Any]) -> str:
    """A family's docstring as one line."""
    return " ".join((fn.__doc__ or "").split())


def select_families(spec: str) -> list[str]:
    if spec in ("", "all"):
        return list(FAMILIES)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in FAMILIES]
    if bad:
        raise SystemExit(f"unknown families {bad}; choose from {list(FAMILIES)}")
    return names


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        for name, fn in FAMILIES.items():
            print(f"{name}: {describe(fn)}")
        return 0
    if args.summarize:
        import json

        try:
            text = Path(args.summarize).read_text(errors="replace")
        except OSError as e:
            build_parser().error(f"argument --summarize: cannot read {args.summarize}: {e.strerror or e}")
        print(json.dumps(summarize(text), indent=1))
        return 0
    names = select_families(args.families)
    try:
        ctx = _setup(args.device)
    except Exception as e:  # noqa: BLE001 - no CuPy, no driver, no device
        print(f"sanitize_workload: needs a CUDA GPU with CuPy ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    failed = []
    for name in names:
        t0 = time.perf_counter()
        try:
            FAMILIES[name](ctx)
            ctx.sync()
            print(f"sanitize_workload: {name}: ok ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on with the other families
            failed.append(name)
            print(f"sanitize_workload: {name}: FAIL: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
    for note in ctx.notes:
        print(f"sanitize_workload: note: {note}")
    if failed:
        print(f"sanitize_workload: FAILED: {', '.join(failed)} ({ctx.checks} checks passed)")
        return 1
    print(f"sanitize_workload: OK ({len(names)} families, {ctx.checks} checks, device {ctx.limits.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
