"""softmax_mode="unified_max" on the GPU against the independent float64 reference (run on the H200).

The tensor-core kernels start each chunk's softmax from the given phi; the result must be the exact
softmax to the same tolerance as exact mode whatever phi is: calibrated (most blocks skip the max),
far above every score (every head's first block falls below m0 - 1 = phi - 8 and restarts from its
own max: without that rule fp16 probabilities, and 200 above even float32 ones, would underflow),
at the top of the window over a peak and a long plateau far below it (m0 = phi - 7 sits one above
the peak; the kernel's first rule, m0 = phi, lost the plateau's fp16 probabilities), far below
(every block moves the reference up), and mixed inside one batch (some requests' scores in the
window, others 40 below it); with requests of 1 and 37 tokens, warps and splits see no token and
must not hand phi to the merge (runs R1: E5M2 and INT4 rows came out wrong until they handed on
-inf). Every plan is forced (``fdpp.dispatch.forced_plan``) so each kernel
family runs: 16-bit K/V, FP8 (the transposed products), INT4, the fused and two-launch merges and
the cluster merge. Outputs are poisoned (NaN) before each call.
"""

import itertools

import numpy as np
import pytest
from gpu_util import assert_graph_replay_matches
from gpu_util import poisoned as _poisoned
from int4_util import dequant, random_int4
from int4_util import reference as int4_reference
from paged_util import ragged_table

import fdpp
from fdpp import dispatch
from fdpp.configs import CombineConfig, DecodeConfig, LaunchPlan
from fdpp.dtypes import DTYPES, KV_FORMATS
from fdpp.reference import assert_close, attention_reference, dequant_fp8_cache, gather_pages

pytestmark = pytest.mark.gpu


def _cp():
    import cupy

    return cupy


def _q_for(rng, b, hq, d, dt, scales):
    """q with request r's scores ~ scales[r] times those of a unit-variance q (large logits)."""
    q = rng.standard_normal((b, hq, d)).astype(np.float32) * np.asarray(scales, np.float32)[:, None, None]
    return q.astype(DTYPES[dt].np_dtype)


def _phis(q, k, layout, lens=None):
    """phi: calibrated, 40 and 200 above it (200 nats: 2^-288, below float32's range), 40 below."""
    phi = fdpp.calibrate_unified_max(q, k, kv_layout=layout, cache_seqlens=lens)
    return {"calibrated": phi, "above": phi + 40.0, "far above": phi + 200.0, "below": phi - 40.0}


def _check(out, lse, ref, ref_lse, dt):
    cp = _cp()
    o = cp.asnumpy(out.astype(cp.float32))
    assert np.isfinite(o).all()
    assert_close(o, np.asarray(ref), dt)
    lse = cp.asnumpy(lse)
    ref_lse = np.asarray(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-4, atol=1e-3)


def _plans(dt, d, g, kv="", page=0):
    cfg = DecodeConfig(dt, d, g, 4, 3, 1, mma=True, kv_dtype=kv, page_size=page)
    assert cfg.is_valid(), cfg.check()
    out = [LaunchPlan.split_kv(cfg, 7, fused=True, source="test"),
           LaunchPlan.split_kv(cfg, 7, CombineConfig(dt, d, 4, 1), source="test"),
           LaunchPlan.split_kv(cfg, 1, source="test")]
    if not page:
        out.append(LaunchPlan.cluster_merge(DecodeConfig(dt, d, g, 4, 3, 1, mma=True, kv_dtype=kv, cluster=4),
                                            4, source="test"))
    return out


def _run_all(call, ref, ref_lse, dt, plans):
    for plan in plans:
        with dispatch.forced_plan(plan):
            out, lse = call()
            _check(out, lse, ref, ref_lse, dt)


GRID16 = list(itertools.product(["fp16", "bf16"], ["NHD", "HND"], [1, 3, 4, 8], [64, 128]))


@pytest.mark.parametrize("dt, layout, ratio, d", GRID16)
def test_16bit_contiguous_any_phi(dt, layout, ratio, d, rng):
    cp = _cp()
    b, hkv, n = 17, 2, 1000
    hq = hkv * ratio
    lens = rng.integers(0, n + 1, size=b).astype(np.int32)
    lens[0], lens[1], lens[2] = n, 0, 37
    shape = (b, n, hkv, d) if layout == "NHD" else (b, hkv, n, d)
    k = rng.standard_normal(shape).astype(DTYPES[dt].np_dtype)
    v = rng.standard_normal(shape).astype(DTYPES[dt].np_dtype)
    scales = np.where(np.arange(b) % 2 == 0, 8.0, 0.5)  # even requests: logits in the tens
    q = _q_for(rng, b, hq, d, dt, scales)
    ref, ref_lse = attention_reference(q, k, v, lens, kv_layout=layout)
    g = max(x for x in range(1, min(ratio, 8) + 1) if ratio % x == 0)
    dq, dk, dv, dl = cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(lens)
    phis = _phis(q[::2], k[::2], layout, lens[::2])  # calibrated on the large-logit requests:
    # the others' scores are ~16 x smaller, far below phi (mixed inside the batch)
    for phi in phis.values():
        def call(phi=phi):
            out = _poisoned(b, hq, d, dt)
            res, lse = fdpp.decode_attention(dq, dk, dv, cache_seqlens=dl, kv_layout=layout, return_lse=True,
                                             out=out, softmax_mode="unified_max", unified_max=phi)
            assert res is out
            return out, lse
        _run_all(call, ref, ref_lse, dt, _plans(dt, d, g))


FP8_CASES = ([(f, p, 32, 8, 128) for f in ("fp8_e4m3", "fp8_e5m2") for p in (0, 1, 16)]
             + [("fp8_e4m3", 0, 4, 4, 64), ("fp8_e4m3", 0, 6, 2, 128), ("fp8_e4m3", 16, 16, 2, 64)])  # GQA 1 / 3 / 8


@pytest.mark.parametrize("fmt, page, hq, hkv, d", FP8_CASES)
def test_fp8_any_phi(fmt, page, hq, hkv, d, rng):
    cp = _cp()
    b, dt, layout = 9, "fp16", "NHD"
    lens = rng.integers(1, 700, size=b).astype(np.int32)
    lens[0] = 700
    f = KV_FORMATS[fmt]
    if page:
        table, num_pages = ragged_table(rng, lens, page)
        shape = (num_pages, page, hkv, d)
    else:
        shape = (b, 700, hkv, d)
    kc = np.clip(rng.standard_normal(shape) * f.max / 4, -f.max, f.max).astype(f.np_dtype).view(np.uint8)
    vc = np.clip(rng.standard_normal(shape) * f.max / 4, -f.max, f.max).astype(f.np_dtype).view(np.uint8)
    kd, vd = 0.02, 0.01
    q = _q_for(rng, b, hq, d, dt, np.where(np.arange(b) < 4, 4.0, 0.25))
    if page:
        k = dequant_fp8_cache(gather_pages(kc, table, lens), fmt, kd)
        v = dequant_fp8_cache(gather_pages(vc, table, lens), fmt, vd)
    else:
        k, v = dequant_fp8_cache(kc, fmt, kd), dequant_fp8_cache(vc, fmt, vd)
    ref, ref_lse = attention_reference(q, k, v, lens)
    args = [cp.asarray(x) for x in (q, kc, vc)]
    for phi in _phis(q[:4], k[:4], layout, lens[:4]).values():
        def call(phi=phi):
            out = _poisoned(b, hq, d, dt)
            kw = dict(kv_dtype=fmt, k_descale=kd, v_descale=vd, return_lse=True, out=out,
                      softmax_mode="unified_max", unified_max=phi)
            if page:
                res, lse = fdpp.paged_decode_attention(*args, cp.asarray(table), cp.asarray(lens), **kw)
            else:
                res, lse = fdpp.decode_attention(*args, cache_seqlens=cp.asarray(lens), **kw)
            return res, lse
        _run_all(call, ref, ref_lse, dt, _plans(dt, d, min(hq // hkv, 8), fmt, page))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_any_phi(group, rng):
    cp = _cp()
    b, hq, hkv, d, dt = 5, 16, 4, 128, "fp16"
    n = 513
    lens = np.array([n, 1, 200, 64, 511], np.int32)
    kc, ks, kz = random_int4((b, n, hkv, d), group, rng, outliers=True)
    vc, vs, vz = random_int4((b, n, hkv, d), group, rng)
    q = _q_for(rng, b, hq, d, dt, [1.0, 1.0, 0.05, 1.0, 0.05])
    k, v = dequant(kc, ks, kz), dequant(vc, vs, vz)
    ref, ref_lse = int4_reference(q, k, v, lens)
    args = [cp.asarray(x) for x in (q, kc, vc)]
    quant = dict(kv_dtype="int4", k_descale=cp.asarray(ks), k_zero=cp.asarray(kz), v_descale=cp.asarray(vs),
                 v_zero=cp.asarray(vz))
    for phi in _phis(q[:2], k[:2], "NHD", lens[:2]).values():
        def call(phi=phi):
            out = _poisoned(b, hq, d, dt)
            return fdpp.decode_attention(*args, cache_seqlens=cp.asarray(lens), return_lse=True, out=out,
                                         softmax_mode="unified_max", unified_max=phi, **quant)
        _run_all(call, ref, ref_lse, dt, _plans(dt, d, 4, f"int4_g{group}")[:3])


@pytest.mark.parametrize("kv", ["", "fp8_e4m3"])
def test_peak_and_plateau_at_the_top_of_the_window(kv, rng):
    """Scores: peaks (0) at tokens 0, 16, .., 112 (the first block of every warp of the first split,
    for 4 or 8 warps, unroll 1 or 2) and a plateau 17-20 log2 units below them; phi = peak + 8 log2
    units (the highest phi whose window holds the peaks), so those warps keep the reference m0 =
    phi - 7, one above the peaks. The plateau's weight must reach the output as in exact mode: the
    first form of the rule (m0 = phi, 8 above the peaks) rounded its fp16 probabilities (2^-25 ..
    2^-28) to 0 while l kept them, an output bias of ~-2e-4 (4 splits) to ~-9e-4 (one split) on
    this data (a NumPy model of the warps and the merge). The bias is the mean signed error over
    all outputs, where fp16 output rounding (~1e-3 at most, unbiased) averages out; the max error
    is checked too. Shapes and plans beyond the other tests': 8 warps, unroll 2."""
    cp = _cp()
    b, hq, hkv, d, dt, n = 4, 8, 2, 128, "fp16", 4096
    s2 = -rng.uniform(17.0, 20.0, (b, n, hkv))
    s2[:, 0:128:16] = 0.0
    k = np.zeros((b, n, hkv, d), np.float32)
    k[..., 0] = s2 / np.log2(np.e)  # softmax_scale 1, q = e_0: the score is k[..., 0]
    v = rng.standard_normal((b, n, hkv, d)) + 0.5  # a mean: weight lost from P biases the output
    q = np.zeros((b, hq, d), np.float16)
    q[..., 0] = 1.0
    lens = np.full(b, n, np.int32)
    kw: dict = {"softmax_scale": 1.0}
    if kv:
        f = KV_FORMATS[kv]
        kd, vd = 0.05, 0.01
        kc = np.clip(k / kd, -f.max, f.max).astype(f.np_dtype).view(np.uint8)
        vc = np.clip(v / vd, -f.max, f.max).astype(f.np_dtype).view(np.uint8)
        kr, vr = dequant_fp8_cache(kc, kv, kd), dequant_fp8_cache(vc, kv, vd)
        kw.update(kv_dtype=kv, k_descale=kd, v_descale=vd)
    else:
        kc, vc = k.astype(np.float16), v.astype(np.float16)
        kr, vr = kc, vc
    ref, _ = attention_reference(q, kr, vr, lens, softmax_scale=1.0)
    peak = float(np.max(np.asarray(kr, np.float64)[:, 0, :, 0]))  # the peaks after rounding (natural units)
    phi = peak + 8.0 / np.log2(np.e)
    dq, dk, dv, dl = (cp.asarray(x) for x in (q, kc, vc, lens))
    ref = np.asarray(ref, np.float64)
    for w, u in ((4, 1), (8, 1), (4, 2)):
        cfg = DecodeConfig(dt, d, 4, w, 3, u, mma=True, kv_dtype=kv)
        for plan in (LaunchPlan.split_kv(cfg, 4, fused=True, source="test"), LaunchPlan.split_kv(cfg, 1, source="test")):
            err, bias = {}, {}
            for mode in ("exact", "unified_max"):
                with dispatch.forced_plan(plan):
                    out = _poisoned(b, hq, d, dt)
                    fdpp.decode_attention(dq, dk, dv, cache_seqlens=dl, out=out, softmax_mode=mode,
                                          unified_max=phi if mode == "unified_max" else None, **kw)
                diff = cp.asnumpy(out.astype(cp.float32)).astype(np.float64) - ref
                err[mode], bias[mode] = float(np.abs(diff).max()), float(diff.mean())
            assert err["unified_max"] <= 3 * err["exact"] + 5e-5, (w, u, plan.mode, err)
            assert abs(bias["unified_max"] - bias["exact"]) < 6e-5, (w, u, plan.mode, bias)


@pytest.mark.parametrize("dt", ["fp16", "bf16", "fp32"])
def test_default_plan_and_decode_plan(dt, rng):
    """Without a forced plan (the table's or the heuristic's kernel; fp32: CUDA cores, phi unused),
    through decode_attention and a DecodePlan, paged with pages of 16."""
    cp = _cp()
    b, hq, hkv, d, page = 3, 32, 8, 128, 16
    lens = np.array([4097, 1, 300], np.int32)
    table, num_pages = ragged_table(rng, lens, page)
    kp = rng.standard_normal((num_pages, page, hkv, d)).astype(DTYPES[dt].np_dtype)
    vp = rng.standard_normal((num_pages, page, hkv, d)).astype(DTYPES[dt].np_dtype)
    q = _q_for(rng, b, hq, d, dt, [6.0, 1.0, 1.0])
    k, v = gather_pages(kp, table, lens), gather_pages(vp, table, lens)
    ref, ref_lse = attention_reference(q, k, v, lens)
    phi = fdpp.calibrate_unified_max(q, k, cache_seqlens=lens) + 20.0
    dev = [cp.asarray(x) for x in (q, kp, vp, table, lens)]
    out = _poisoned(b, hq, d, dt)
    _, lse = fdpp.paged_decode_attention(*dev, return_lse=True, out=out, softmax_mode="unified_max",
                                         unified_max=phi)
    _check(out, lse, ref, ref_lse, dt)
    plan = fdpp.DecodePlan(b, hq, hkv, d, table.shape[1] * page, dtype=dt, page_size=page, return_lse=True,
                           softmax_mode="unified_max", unified_max=phi)
    for _ in range(2):  # the first run records, the second takes the record
        out = _poisoned(b, hq, d, dt)
        _, lse = plan.run(*dev, out=out)
        _check(out, lse, ref, ref_lse, dt)


def test_graph_replays_are_bitwise_and_modes_differ_only_in_rounding(rng):
    """100 replays of a captured unified-max call give the eager call's bits; exact and unified
    results agree to the tolerance (not bitwise: another reference, other roundings)."""
    cp = _cp()
    b, hq, hkv, d, n = 2, 32, 8, 128, 16384
    q = cp.asarray(_q_for(rng, b, hq, d, "fp16", [3.0, 3.0]))
    k = cp.asarray(rng.standard_normal((b, n, hkv, d)).astype(np.float16))
    v = cp.asarray(rng.standard_normal((b, n, hkv, d)).astype(np.float16))
    phi = fdpp.calibrate_unified_max(q[:1], k[:1, :4096])
    out = _poisoned(b, hq, d, "fp16")

    def run():
        fdpp.decode_attention(q, k, v, out=out, softmax_mode="unified_max", unified_max=phi)

    run()
    assert_graph_replay_matches(run, out, 100)
    exact = fdpp.decode_attention(q, k, v)
    ref, _ = attention_reference(q, k, v)
    assert_close(cp.asnumpy(out.astype(cp.float32)), cp.asnumpy(ref), "fp16")
    assert_close(cp.asnumpy(exact.astype(cp.float32)), cp.asnumpy(ref), "fp16")
