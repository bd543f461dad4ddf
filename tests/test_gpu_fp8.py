"""FP8 K/V caches (E4M3, E5M2) on the GPU against the float64 reference of the dequantised cache.

The reference dequantises the codes with ml_dtypes (``fdpp.reference.dequant_fp8_cache``:
float32(code) * descale) and runs plain float64 attention, never an fdpp kernel, so the
tolerance (q's dtype, ``fdpp.reference.assert_close``) measures kernel error, not quantisation
error. Codes come from random data quantised with ml_dtypes (every finite code appears), outputs
are poisoned (NaN) before each call, pages are shuffled, lengths are not multiples of a chunk or
page.
"""

import dataclasses
import itertools

import numpy as np
import pytest
from gpu_util import assert_graph_replay_matches
from gpu_util import poisoned as _poisoned
from paged_util import ragged_table

import fdpp
from fdpp import configs, dispatch
from fdpp.dtypes import DTYPES, KV_FORMATS
from fdpp.reference import assert_close, attention_reference, dequant_fp8_cache, gather_pages

pytestmark = pytest.mark.gpu


def _cp():
    import cupy

    return cupy


def _codes(shape, fmt, rng, spread=1.0):
    """uint8 codes of Gaussian data scaled to the format's range (clipped, round to nearest even)."""
    f = KV_FORMATS[fmt]
    x = rng.standard_normal(shape, dtype=np.float32) * (f.max / 4) * spread
    return np.clip(x, -f.max, f.max).astype(f.np_dtype).view(np.uint8)


def _descale(kind, b, hkv, rng):
    if kind == "none":
        return None
    if kind == "scalar":
        return float(rng.uniform(0.001, 0.01))
    if kind == "tensor":
        return _cp().asarray(np.array(rng.uniform(0.001, 0.01), np.float32))
    if kind == "kvhead":  # [Hkv]: every request
        return _cp().asarray(rng.uniform(0.0005, 0.01, size=hkv).astype(np.float32))
    return _cp().asarray(rng.uniform(0.0005, 0.01, size=(b, hkv)).astype(np.float32))


def _host(x):
    return None if x is None else (x if isinstance(x, float) else _cp().asnumpy(x))


def _check(out, lse, q, k, v, lens, layout, dt):
    cp = _cp()
    ref, ref_lse = attention_reference(q, k, v, lens, kv_layout=layout)
    assert_close(cp.asnumpy(out.astype(cp.float32)), ref, dt)
    lse = cp.asnumpy(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-4, atol=1e-3)


GRID = list(itertools.product(["fp8_e4m3", "fp8_e5m2"], ["fp16", "bf16"], ["NHD", "HND"], [64, 128],
                              ["none", "scalar", "tensor", "head", "kvhead"]))


@pytest.mark.parametrize("fmt, dt, layout, d, ds", GRID)
def test_contiguous_against_reference(fmt, dt, layout, d, ds, rng):
    cp = _cp()
    b, hq, hkv, n = 3, 8, 2, 1000
    q = (rng.standard_normal((b, hq, d), dtype=np.float32)).astype(DTYPES[dt].np_dtype)
    shape = (b, n, hkv, d) if layout == "NHD" else (b, hkv, n, d)
    kc, vc = _codes(shape, fmt, rng), _codes(shape, fmt, rng)
    kd, vd = _descale(ds, b, hkv, rng), _descale(ds, b, hkv, rng)
    lens = np.array([1000, 333, 0], np.int32)
    k = dequant_fp8_cache(kc, fmt, _host(kd), layout)
    v = dequant_fp8_cache(vc, fmt, _host(vd), layout)
    for splits in (None, 1, 7):
        out = _poisoned(b, hq, d, dt)
        res, lse = fdpp.decode_attention(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), cache_seqlens=cp.asarray(lens),
                                         kv_layout=layout, kv_dtype=fmt, k_descale=kd, v_descale=vd,
                                         num_splits=splits, return_lse=True, out=out)
        assert res is out
        _check(out, lse, q, k, v, lens, layout, dt)


@pytest.mark.parametrize("fmt, page, layout", list(itertools.product(["fp8_e4m3", "fp8_e5m2"], [1, 16, 64],
                                                                      ["NHD", "HND"])))
def test_paged_against_reference(fmt, page, layout, rng):
    cp = _cp()
    b, hq, hkv, d, dt = 17, 32, 8, 128, "fp16"
    lens = rng.integers(0, 700, size=b).astype(np.int32)
    lens[0], lens[1] = 700, 1
    table, num_pages = ragged_table(rng, lens, page)
    shape = (num_pages, page, hkv, d) if layout == "NHD" else (num_pages, hkv, page, d)
    kp, vp = _codes(shape, fmt, rng), _codes(shape, fmt, rng)
    kd = _descale("head", b, hkv, rng)
    vd = _descale("head", b, hkv, rng)
    q = rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16)
    k = dequant_fp8_cache(gather_pages(kp, table, lens, layout), fmt, _host(kd), layout)
    v = dequant_fp8_cache(gather_pages(vp, table, lens, layout), fmt, _host(vd), layout)
    for splits in (None, 5):
        out = _poisoned(b, hq, d, dt)
        res, lse = fdpp.paged_decode_attention(cp.asarray(q), cp.asarray(kp), cp.asarray(vp), cp.asarray(table),
                                               cp.asarray(lens), kv_layout=layout, kv_dtype=fmt, k_descale=kd,
                                               v_descale=vd, num_splits=splits, return_lse=True, out=out)
        assert res is out
        _check(out, lse, q, k, v, lens, layout, dt)


@pytest.mark.parametrize("ratio", [1, 3, 4, 8])
@pytest.mark.parametrize("mma", [True, False])
def test_every_gqa_ratio_on_both_kernels(ratio, mma, rng):
    """The tensor-core and the CUDA-core phase 1, fused and two-launch merges."""
    cp = _cp()
    b, hkv, d, n, fmt = 2, 2, 128, 2049, "fp8_e4m3"
    hq = hkv * ratio
    q = rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16)
    kc, vc = _codes((b, n, hkv, d), fmt, rng), _codes((b, n, hkv, d), fmt, rng)
    kd, vd = _descale("head", b, hkv, rng), _descale("head", b, hkv, rng)
    k, v = dequant_fp8_cache(kc, fmt, _host(kd)), dequant_fp8_cache(vc, fmt, _host(vd))
    g = configs.group_size_for(ratio) if mma else min(2, configs.group_size_for(ratio))  # CUDA cores: registers
    if ratio % g:
        g = 1
    cfg = configs.DecodeConfig("fp16", d, g, 4, 3 if mma else 2, 1 if mma else 2, mma=mma, kv_dtype=fmt)
    assert cfg.is_valid(), cfg.check()
    for fused in (True, False):
        plan = configs.LaunchPlan.split_kv(cfg, 9, fused=fused)
        with dispatch.forced_plan(plan):
            out = _poisoned(b, hq, d, "fp16")
            _, lse = fdpp.decode_attention(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), kv_dtype=fmt,
                                           k_descale=kd, v_descale=vd, return_lse=True, out=out)
        _check(out, lse, q, k, v, None, "NHD", "fp16")


def test_large_logits_and_every_code(rng):
    """Scores of several hundred (descale folded into the scores) and K/V holding every finite code."""
    cp = _cp()
    fmt, b, hq, hkv, d = "fp8_e4m3", 1, 8, 1, 128
    allc = np.array([c for c in range(256) if c not in (0x7f, 0xff)], np.uint8)
    n = 2 * len(allc)
    kc = rng.permutation(np.resize(allc, n * d)).astype(np.uint8).reshape(b, n, hkv, d)
    vc = rng.permutation(np.resize(allc, n * d)).astype(np.uint8).reshape(b, n, hkv, d)
    q = (rng.standard_normal((b, hq, d), dtype=np.float32) * 4).astype(np.float16)
    kd, vd = 0.05, 0.01
    k, v = dequant_fp8_cache(kc, fmt, kd), dequant_fp8_cache(vc, fmt, vd)
    out = _poisoned(b, hq, d, "fp16")
    _, lse = fdpp.decode_attention(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), kv_dtype=fmt, k_descale=kd,
                                   v_descale=vd, return_lse=True, out=out)
    assert float(np.abs(cp.asnumpy(lse)).max()) > 50  # the logits really are large
    _check(out, lse, q, k, v, None, "NHD", "fp16")


def test_torch_float8_tensors_and_numpy_inputs(rng):
    torch = pytest.importorskip("torch")
    fmt, b, hq, hkv, d, n = "fp8_e4m3", 2, 32, 8, 128, 777
    q = rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16)
    kc, vc = _codes((b, n, hkv, d), fmt, rng), _codes((b, n, hkv, d), fmt, rng)
    kd = rng.uniform(0.001, 0.01, size=(b, hkv)).astype(np.float32)
    k, v = dequant_fp8_cache(kc, fmt, kd), dequant_fp8_cache(vc, fmt, None)
    ref, _ = attention_reference(q, k, v)
    tk = torch.from_numpy(kc).cuda().view(torch.float8_e4m3fn)  # the format from the dtype
    tv = torch.from_numpy(vc).cuda().view(torch.float8_e4m3fn)
    out = fdpp.decode_attention(torch.from_numpy(q).cuda(), tk, tv, k_descale=torch.from_numpy(kd).cuda())
    assert_close(out.float().cpu().numpy(), ref, "fp16")
    f8 = KV_FORMATS[fmt].np_dtype  # NumPy in (ml_dtypes FP8), NumPy out, computed on the GPU
    out_np = fdpp.decode_attention(q, kc.view(f8), vc.view(f8), k_descale=kd)
    assert isinstance(out_np, np.ndarray)
    assert_close(out_np.astype(np.float32), ref, "fp16")
    with pytest.raises(TypeError, match="kv_dtype"):
        fdpp.decode_attention(torch.from_numpy(q).cuda(), torch.from_numpy(kc).cuda(), torch.from_numpy(vc).cuda())


def test_decode_plan_and_graph_replay(rng):
    cp = _cp()
    fmt, b, hq, hkv, d, n = "fp8_e5m2", 4, 32, 8, 128, 4096
    q = rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16)
    kc, vc = _codes((b, n, hkv, d), fmt, rng), _codes((b, n, hkv, d), fmt, rng)
    kd = cp.asarray(rng.uniform(0.001, 0.01, size=(b, hkv)).astype(np.float32))
    lens = cp.asarray(np.array([4096, 100, 4000, 1], np.int32))
    k, v = dequant_fp8_cache(kc, fmt, cp.asnumpy(kd)), dequant_fp8_cache(vc, fmt, 0.003)
    plan = fdpp.DecodePlan(b, hq, hkv, d, n, dtype="fp16", kv_dtype=fmt)
    args = (cp.asarray(q), cp.asarray(kc), cp.asarray(vc))
    out = _poisoned(b, hq, d, "fp16")
    plan.run(*args, cache_seqlens=lens, out=out, k_descale=kd, v_descale=0.003)
    ref, _ = attention_reference(q, k, v, cp.asnumpy(lens))
    assert_close(cp.asnumpy(out.astype(cp.float32)), ref, "fp16")
    assert_graph_replay_matches(lambda: plan.run(*args, cache_seqlens=lens, out=out, k_descale=kd, v_descale=0.003),
                                out, 20)


def test_unquantised_results_unchanged_by_the_descale_fields(rng):
    """fp16 caches run the same kernels with descale 1: the result equals the reference as before."""
    cp = _cp()
    b, hq, hkv, d, n = 1, 32, 8, 128, 3000
    q, k, v = (cp.asarray(rng.standard_normal(s, dtype=np.float32).astype(np.float16))
               for s in ((b, hq, d), (b, n, hkv, d), (b, n, hkv, d)))
    out = fdpp.decode_attention(q, k, v)
    ref, _ = attention_reference(cp.asnumpy(q), cp.asnumpy(k), cp.asnumpy(v))
    assert_close(cp.asnumpy(out.astype(cp.float32)), ref, "fp16")
    with pytest.raises(ValueError, match="k_descale applies to FP8"):
        fdpp.decode_attention(q, k, v, k_descale=0.5)


def test_bad_quantised_arguments(rng):
    cp = _cp()
    b, hq, hkv, d, n = 2, 8, 2, 128, 64
    q = cp.asarray(rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16))
    kc = cp.asarray(_codes((b, n, hkv, d), "fp8_e4m3", rng))
    cases = [
        (dict(k_descale=cp.zeros((b, hkv + 1), np.float32)), ValueError, "k_descale must have shape"),
        (dict(k_descale=cp.zeros((b, hkv), np.float16)), TypeError, "k_descale must be float32"),
        (dict(v_descale=float("nan")), ValueError, "v_descale must be a finite"),
        (dict(k_descale=np.zeros((b, hkv), np.float32)), TypeError, "k_descale must be the same array type"),
        (dict(kv_dtype="int3"), ValueError, "kv_dtype must be None or one of"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fdpp.decode_attention(q, kc, kc, **{"kv_dtype": "fp8_e4m3", **kw})
    with pytest.raises(TypeError, match="fp16 or bf16 q"):
        fdpp.decode_attention(q.astype(cp.float32), kc, kc, kv_dtype="fp8_e4m3")
    with pytest.raises(TypeError, match="names a quantised format, but v_cache is float16"):
        fdpp.decode_attention(q, kc, cp.zeros((b, n, hkv, d), cp.float16), kv_dtype="fp8_e4m3")
    with pytest.raises(TypeError, match="kv_dtype"):  # the baseline takes no FP8 cache
        fdpp.decode_attention_nosplit(q, kc, kc)
    cfg = dataclasses.replace(configs.DecodeConfig("fp16", 256, 1, 4, 3, 1, mma=True), kv_dtype="fp8_e4m3")
    assert "head_dim" in cfg.check()
