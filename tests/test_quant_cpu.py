"""fdpp.quant on the CPU: the FP8 bit mirror of the kernels against ml_dtypes, NumPy quantize /
dequantize round trips, scale shapes and masking, the INT4 byte layout, argument errors, and the
Python mirrors of kernels_cu/quant.cuh's constants. (GPU: tests/test_gpu_quant.py.)"""

import re
import sys
import warnings
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import fdpp
from fdpp import quant, registry
from fdpp.quant import FP8, QuantizedKV, dequant_fp8, dequant_int4, fp8_decode_bits, fp8_encode_bits

FP8_FMTS = list(FP8)


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}")


# ---- the FP8 bit mirror ----------------------------------------------------------------------
def _ml(x, fmt):
    """ml_dtypes' conversion of clip(x): what fp8_encode_bits must equal."""
    t = FP8[fmt]
    with np.errstate(invalid="ignore"):
        return np.clip(x, np.float32(-t.max), np.float32(t.max)).astype(t.np_dtype).view(np.uint8)


ALL_F16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@pytest.mark.parametrize("fmt", FP8_FMTS)
@pytest.mark.parametrize("mult", [1.0, 2.0**-12, 2.0**-20, 2.0**10, 3.0, 1 / 448])
def test_fp8_encode_matches_ml_dtypes_on_all_float16_values(fmt, mult):
    # every fp16 value (NaN payloads, infinities, subnormals, -0 included), scaled so that fp8's
    # subnormal range (2^-12, 2^-20) and its saturation (2^10) are hit densely
    with np.errstate(invalid="ignore"):
        x = (ALL_F16 * np.float32(mult)).astype(np.float32)
    got, want = fp8_encode_bits(x, fmt), _ml(x, fmt)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} mismatches, e.g. x={x[bad[:4]]} got {got[bad[:4]]} want {want[bad[:4]]}"


def _ties(fmt):
    """Midpoints between consecutive finite fp8 values and their float32 neighbours (exact in
    float32: one bit more than fp8's mantissa)."""
    vals = np.unique(fp8_decode_bits(np.arange(256, dtype=np.uint8), fmt))
    vals = vals[np.isfinite(vals)].astype(np.float64)
    mids = ((vals[1:] + vals[:-1]) / 2).astype(np.float32)
    assert np.array_equal(mids.astype(np.float64), (vals[1:] + vals[:-1]) / 2)
    up, down = np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))
    top = np.float32(FP8[fmt].max)
    edge = np.array([top, np.nextafter(top, np.float32(0)), np.nextafter(top, np.float32(np.inf)), top * 1.0625,
                     np.finfo(np.float32).max, np.finfo(np.float32).tiny, np.float32(1e-45), 0.0, np.inf, np.nan],
                    dtype=np.float32)
    out = np.concatenate([mids, up, down, edge])
    return np.concatenate([out, -out])


@pytest.mark.parametrize("fmt", FP8_FMTS)
def test_fp8_encode_matches_ml_dtypes_on_random_float32(fmt):
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    # and a log-uniform sample over fp8's range (where the rounding decisions are)
    wide = (rng.choice([-1.0, 1.0], 1 << 19) * 2.0 ** rng.uniform(-26, 18, 1 << 19)).astype(np.float32)
    x = np.concatenate([bits, wide, _ties(fmt)])
    got, want = fp8_encode_bits(x, fmt), _ml(x, fmt)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} mismatches, e.g. x={x[bad[:4]]} got {got[bad[:4]]} want {want[bad[:4]]}"
    # the sign of zero and of underflow, NaN and saturation, explicitly
    sp = np.array([0.0, -0.0, -1e-30, np.nan, -np.nan, np.inf, -np.inf], dtype=np.float32)
    t = FP8[fmt]
    assert fp8_encode_bits(sp, fmt).tolist() == [0, 0x80, 0x80, t.nan_code, 0x80 | t.nan_code, t.max_code,
                                                 0x80 | t.max_code]


@pytest.mark.parametrize("fmt", FP8_FMTS)
def test_fp8_decode_matches_ml_dtypes_on_all_codes(fmt):
    c = np.arange(256, dtype=np.uint8)
    got = fp8_decode_bits(c, fmt)
    want = c.view(FP8[fmt].np_dtype).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_fp8_constants_match_the_cuda_header():
    src = registry.kernel_source("quant.cuh")
    for fmt, cname in (("fp8_e4m3", "KV_FP8_E4M3"), ("fp8_e5m2", "KV_FP8_E5M2")):
        t = FP8[fmt]
        body = re.search(r"struct Fp8Traits<" + cname + r"> \{(.*?)\n\};", src, re.S).group(1)
        got = {m.group(1): int(m.group(2), 0) for m in re.finditer(r"(MANT|BIAS|MAX_BITS|MAX_CODE|NAN_CODE) = (0x[0-9a-f]+|\d+)", body)}
        assert got == {"MANT": t.mant, "BIAS": t.bias, "MAX_BITS": t.max_bits, "MAX_CODE": t.max_code,
                       "NAN_CODE": t.nan_code}
        assert float(np.float32(t.max)) == float(ml_dtypes.finfo(t.np_dtype).max)
        assert int(re.search(r"constexpr int " + cname + r" = (\d+);", src).group(1)) == quant.FORMAT_IDS[fmt]
    k = registry.kernel_source("quantize_kv.cu")
    assert int(re.search(r"AMAX_THREADS = (\d+);", k).group(1)) == quant.AMAX_THREADS
    assert int(re.search(r"QUANT_THREADS = (\d+);", k).group(1)) == quant.QUANT_THREADS


# ---- FP8 quantize_kv -------------------------------------------------------------------------
def _kv(rng, shape, dt=np.float16, scale=1.0):
    k = (rng.standard_normal(shape) * scale).astype(dt)
    v = (rng.standard_normal(shape) * scale).astype(dt)
    return k, v


def _ulp_half_fp8(y, fmt):
    t = FP8[fmt]
    emin = 1 - t.bias
    e = np.floor(np.log2(np.maximum(np.abs(y), 2.0**(emin - 40))))
    return 2.0 ** (np.maximum(e, emin) - t.mant - 1)


@pytest.mark.parametrize("fmt", FP8_FMTS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fp8_round_trip_within_half_ulp(fmt, layout, rng):
    shape = (2, 48, 3, 64) if layout == "NHD" else (2, 3, 48, 64)
    k, v = _kv(rng, shape, scale=3.0)
    k[0, 1] *= 50  # a wide dynamic range in one request
    kc, vc = k.copy(), v.copy()
    q = fdpp.quantize_kv(k, v, fmt, kv_layout=layout)
    assert np.array_equal(k, kc) and np.array_equal(v, vc)  # inputs untouched
    assert q.k.dtype == FP8[fmt].np_dtype and q.k.shape == shape and q.k_descale.shape == (2, 3)
    assert q.k_descale.dtype == np.float32 and q.fmt == fmt and q.kv_layout == layout and q.group_size is None
    dk, dv = fdpp.dequantize_kv(q)
    assert dk.dtype == np.float32 and dk.shape == shape
    for x, deq, ds in ((k, dk, q.k_descale), (v, dv, q.v_descale)):
        x32 = x.astype(np.float32)
        axes = (1, 3) if layout == "NHD" else (2, 3)
        amax = np.abs(x32).max(axis=axes)
        assert np.array_equal(ds, amax / np.float32(FP8[fmt].max))  # float32 division
        dsb = ds[:, None, :, None] if layout == "NHD" else ds[:, :, None, None]
        bound = _ulp_half_fp8(x32.astype(np.float64) / dsb, fmt) * dsb * (1 + 2.0**-20) + np.abs(x32) * 2.0**-22
        err = np.abs(x32.astype(np.float64) - deq)
        assert np.all(err <= bound), float((err / bound).max())
        assert np.array_equal(deq, dequant_fp8(q.k if x is k else q.v, fmt, dsb))


def test_fp8_per_tensor_and_per_head(rng):
    k, v = _kv(rng, (3, 20, 4, 32))
    ph = fdpp.quantize_kv(k, v, "fp8_e4m3", scale="per_head")
    pt = fdpp.quantize_kv(k, v, "fp8_e4m3", scale="per_tensor")
    assert ph.k_descale.shape == (3, 4) and pt.k_descale.shape == () and pt.v_descale.shape == ()
    assert isinstance(pt.k_descale, np.ndarray) and pt.k_descale.dtype == np.float32
    assert pt.k_descale == ph.k_descale.max() and pt.v_descale == ph.v_descale.max()
    assert pt.k_descale != pt.v_descale  # separate for K and V
    want = np.clip(k.astype(np.float32) / pt.k_descale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(pt.k.view(np.uint8), want.view(np.uint8))
    dk, _ = fdpp.dequantize_kv(pt)
    assert np.array_equal(dk, pt.k.astype(np.float32) * pt.k_descale)


def test_fp8_cache_seqlens_masks_amax(rng):
    b, n, h, d = 3, 40, 2, 16
    k, v = _kv(rng, (b, n, h, d), dt=np.float32)
    lens = np.array([17, 0, 40])
    for i, ln in enumerate(lens):  # garbage past each length: must not reach the scale
        k[i, ln:] = np.inf
        v[i, ln:] = 1e30
    k[1, :] = np.nan
    q = fdpp.quantize_kv(k, v, "fp8_e4m3", cache_seqlens=lens)
    for i, ln in enumerate(lens):
        if ln == 0:
            assert np.all(q.k_descale[i] == 1.0) and np.all(q.v_descale[i] == 1.0)
            continue
        ref = fdpp.quantize_kv(k[i:i + 1, :ln], v[i:i + 1, :ln], "fp8_e4m3")
        assert np.array_equal(q.k_descale[i], ref.k_descale[0]) and np.array_equal(q.v_descale[i], ref.v_descale[0])
        assert np.array_equal(q.k[i, :ln].view(np.uint8), ref.k[0].view(np.uint8))
        if ln < n:  # past the length: saturated with the same descale
            assert np.all(q.k[i, ln:].view(np.uint8) == 0x7E) and np.all(q.v[i, ln:].view(np.uint8) == 0x7E)
    pt = fdpp.quantize_kv(k, v, "fp8_e5m2", scale="per_tensor", cache_seqlens=lens)
    valid = np.arange(n)[None, :] < lens[:, None]
    assert pt.k_descale == np.abs(k[valid]).max() / np.float32(57344)
    with pytest.raises(ValueError, match="^k holds non-finite"):
        fdpp.quantize_kv(k, v, "fp8_e4m3")  # without lengths the inf is inside the scale's domain
    with pytest.raises(ValueError, match="^v holds non-finite"):
        fdpp.quantize_kv(k, np.where(np.isfinite(k), k, 0) * 0 + np.inf, "fp8_e4m3", cache_seqlens=lens)


def test_fp8_zero_head_gets_descale_one():
    k = np.zeros((1, 4, 2, 8), np.float16)
    k[0, :, 1] = 2.0
    q = fdpp.quantize_kv(k, k, "fp8_e4m3")
    assert q.k_descale.tolist() == [[1.0, np.float32(2.0) / np.float32(448)]]
    assert np.all(q.k[0, :, 0].view(np.uint8) == 0) and np.all(q.k[0, :, 1].astype(np.float32) == 448)


@pytest.mark.parametrize("dt", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_fp8_input_dtypes_convert_exactly(dt, rng):
    k, v = _kv(rng, (1, 10, 2, 32), dt=dt, scale=5.0)
    q = fdpp.quantize_kv(k, v, "fp8_e5m2")
    x = k.astype(np.float32)
    want = fp8_encode_bits(x / q.k_descale[:, None, :, None], "fp8_e5m2")
    assert np.array_equal(q.k.view(np.uint8), want)


# ---- INT4 --------------------------------------------------------------------------------------
def test_int4_nibble_order_hand_made():
    # one group of 32: min 0, max 15 -> scale 1, zero 0, codes = values
    vals = np.array(list(range(16)) + list(range(15, -1, -1)), np.float16)
    k = vals.reshape(1, 1, 1, 32)
    q = fdpp.quantize_kv(k, k, "int4", group_size=32)
    assert q.k.dtype == np.uint8 and q.k.shape == (1, 1, 1, 16)
    assert q.k[0, 0, 0, :3].tolist() == [0x10, 0x32, 0x54] and q.k[0, 0, 0, 8:10].tolist() == [0xEF, 0xCD]
    assert q.k_scale.dtype == np.float16 and q.k_scale.shape == (1, 1, 1, 1)
    assert q.k_scale.item() == 1.0 and q.k_zero.item() == 0.0
    dk, _ = fdpp.dequantize_kv(q)
    assert np.array_equal(dk.reshape(-1), vals.astype(np.float32))
    # dequant_int4 of a byte: low nibble first
    packed = np.array([[0x21] + [0] * 15], np.uint8)
    out = dequant_int4(packed, np.array([[0.5]], np.float16), np.array([[-1.0]], np.float16), 32)
    assert out[0, :2].tolist() == [-0.5, 0.0] and np.all(out[0, 2:] == -1.0)


def _ulp16(x):
    a = np.abs(np.asarray(x, np.float64))
    e = np.floor(np.log2(np.maximum(a, 2.0**-14)))
    return 2.0 ** (e - 10)


@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_int4_round_trip_within_half_scale(g, layout, rng):
    shape = (2, 9, 2, 128) if layout == "NHD" else (2, 2, 9, 128)
    k, v = _kv(rng, shape, scale=2.0)
    k[..., 5] *= 12  # an outlier channel
    q = fdpp.quantize_kv(k, v, "int4", group_size=g, kv_layout=layout)
    assert q.k.shape == (*shape[:3], 64) and q.k_scale.shape == (*shape[:3], 128 // g) == q.v_zero.shape
    assert q.group_size == g and q.k_descale is None
    dk, dv = fdpp.dequantize_kv(q)
    for x, deq, s, z in ((k, dk, q.k_scale, q.k_zero), (v, dv, q.v_scale, q.v_zero)):
        x32 = x.astype(np.float64)
        xg = x32.reshape(*x32.shape[:-1], 128 // g, g)
        assert np.array_equal(z, xg.min(-1).astype(np.float16))
        assert np.array_equal(s, ((xg.max(-1) - xg.min(-1)).astype(np.float32) / np.float32(15)).astype(np.float16))
        s64 = np.repeat(s.astype(np.float64), g, -1)
        z64 = np.repeat(z.astype(np.float64), g, -1)
        bound = s64 * (0.5 + 16 * 2.0**-11) + _ulp16(z64) + _ulp16(x32)
        err = np.abs(x32 - deq)
        assert np.all(err <= bound), float((err / bound).max())
        assert float((err / s64).max()) > 0.3  # the bound is not vacuous: rounding errors near s/2 occur


def test_int4_dequant_rounds_once_to_fp16():
    rng = np.random.default_rng(3)
    m = 3000
    scale = (rng.uniform(0.5, 2, m) * 2.0 ** rng.integers(-12, 4, m)).astype(np.float16)
    zero = (rng.standard_normal(m) * 2.0 ** rng.integers(-6, 6, m)).astype(np.float16)
    n = rng.integers(0, 16, m)
    packed = np.zeros((m, 16), np.uint8)
    packed[:, 0] = n.astype(np.uint8)
    out = dequant_int4(packed, scale[:, None], zero[:, None], 32)[:, 0]
    for i in range(0, m, 7):
        exact = Fraction(int(n[i])) * Fraction(float(scale[i])) + Fraction(float(zero[i]))
        f = np.float16(out[i])
        lo, hi = np.nextafter(f, np.float16(-np.inf)), np.nextafter(f, np.float16(np.inf))
        d = abs(Fraction(float(f)) - exact)
        assert d <= abs(Fraction(float(lo)) - exact) and d <= abs(Fraction(float(hi)) - exact), (i, exact, f)
        if d == abs(Fraction(float(lo)) - exact) or d == abs(Fraction(float(hi)) - exact):
            assert int(f.view(np.uint16)) % 2 == 0  # a tie goes to even


def test_int4_dequant_is_not_double_rounded():
    # 3 * 683/2048 + 2^-24 = 1 + 2^-11 + 2^-24: one rounding gives 1 + 2^-10 (what fma.rn.f16 and
    # hfma2 give); through float32 it would tie twice and give 1.0
    packed = np.zeros((1, 16), np.uint8)
    packed[0, 0] = 3
    out = dequant_int4(packed, np.array([[683 / 2048]], np.float16), np.array([[2.0**-24]], np.float16), 32)
    assert np.float16(out[0, 0]).view(np.uint16) == 0x3C01


def test_int4_degenerate_groups():
    k = np.zeros((1, 2, 1, 32), np.float16)
    k[0, 1] = 3.0  # constant groups: scale rounds to 0 -> 1, every code 0
    k[0, 0, 0, 0] = 1e-7  # (max - min) / 15 underflows fp16 to 0 -> scale 1
    q = fdpp.quantize_kv(k, k, "int4", group_size=32)
    assert q.k_scale.reshape(-1).tolist() == [1.0, 1.0] and q.k_zero.reshape(-1).tolist() == [0.0, 3.0]
    assert np.all(q.k == 0)
    dk, _ = fdpp.dequantize_kv(q)
    assert np.all(dk[0, 1] == 3.0) and np.all(dk[0, 0] == 0.0)
    z = np.zeros((1, 1, 1, 32), np.float16)
    z[..., 1::2] = -0.0  # a zero minimum is +0 whichever zero a reduction meets first
    for x in (z, -z, np.abs(z)):
        q = fdpp.quantize_kv(x, x, "int4", group_size=32)
        assert _bits(q.k_zero).tolist() == [[[[0]]]] and q.k_scale.item() == 1.0 and np.all(q.k == 0)


def test_int4_overflow_and_nan_raise():
    k = np.ones((1, 3, 1, 32), np.float32)
    v = k.copy()
    v[0, 2, 0, 4] = 1e6  # zero / scale do not fit fp16
    with pytest.raises(ValueError, match="^v holds non-finite.*float16"):
        fdpp.quantize_kv(k, v, "int4", group_size=32)
    q = fdpp.quantize_kv(k, v, "int4", group_size=32, cache_seqlens=[2])  # past the length: fine
    assert np.isinf(q.v_scale[0, 2]).all()
    k[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="^k holds non-finite"):
        fdpp.quantize_kv(k, k, "int4", group_size=32)


@pytest.mark.parametrize("row", [[65504.0], [65504.0, -65504.0], [65500.0]])
def test_int4_levels_past_float16_raise(row):
    """fp16 inputs near +-65504: scale and zero are finite, but the top level 15 * scale + zero (the
    scale rounded up) would read back as inf; quantize_kv and a NumPy PagedKVCache refuse them."""
    k = np.zeros((1, 1, 1, 64), np.float16)
    k[0, 0, 0, :len(row)] = row
    s, z = fdpp.quant.int4_quantize(k, 64)[1:]
    assert np.isfinite(s).all() and np.isfinite(z).all()
    ok = np.zeros_like(k)
    with pytest.raises(ValueError, match="^v holds .*top level overflows float16"):
        fdpp.quantize_kv(ok, k, "int4")
    cache = fdpp.PagedKVCache(1, 4, 4, 1, 64, kv_format="int4", backend="numpy")
    a = cache.allocate()
    cache.set_batch([a])
    cache.reserve(1)
    with pytest.raises(ValueError, match="^k holds .*top level overflows float16"):
        cache.append(0, k[0], ok[0])
    cache.append(0, ok[0], ok[0])  # the refused write left the cache usable


def test_hnd_is_the_transpose_of_nhd(rng):
    k, v = _kv(rng, (2, 12, 3, 64), dt=ml_dtypes.bfloat16)
    lens = [5, 12]
    for fmt in ("fp8_e4m3", "int4"):
        a = fdpp.quantize_kv(k, v, fmt, group_size=32, cache_seqlens=lens)
        b = fdpp.quantize_kv(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), fmt, group_size=32,
                             kv_layout="HND", cache_seqlens=lens)
        assert np.array_equal(a.k.view(np.uint8).transpose(0, 2, 1, 3), b.k.view(np.uint8))
        if fmt == "int4":
            assert np.array_equal(a.v_scale.transpose(0, 2, 1, 3), b.v_scale)
        else:
            assert np.array_equal(a.v_descale, b.v_descale)
        da, db = fdpp.dequantize_kv(a), fdpp.dequantize_kv(b)
        assert np.array_equal(da[1].transpose(0, 2, 1, 3), db[1])


# ---- errors ----------------------------------------------------------------------------------
def _err(exc, match, *args, **kw):
    with pytest.raises(exc, match=match):
        fdpp.quantize_kv(*args, **kw)


def test_argument_errors():
    k = np.zeros((1, 4, 2, 64), np.float16)
    _err(ValueError, "fmt must be one of", k, k, "fp4")
    _err(TypeError, "fmt must be a string", k, k, 8)
    _err(ValueError, "scale must be one of", k, k, "fp8_e4m3", scale="per_token")
    _err(ValueError, "kv_layout must be one of", k, k, kv_layout="NDH")
    _err(ValueError, "group_size must be one of", k, k, "int4", group_size=16)
    _err(TypeError, "group_size must be an int", k, k, "int4", group_size=32.0)
    _err(ValueError, "group_size 128 does not divide head_dim 64", k, k, "int4", group_size=128)
    _err(TypeError, "k dtype must be one of", k.astype(np.int8), k)
    _err(TypeError, "v dtype float32 must match k dtype float16", k, k.astype(np.float32))
    _err(ValueError, r"k must have shape \[B, N, Hkv, D\]", k[0], k[0])
    _err(ValueError, r"v must have shape \[B, Hkv, N, D\]", k, k[0], kv_layout="HND")
    _err(ValueError, "k and v must have the same shape", k, k[:, :3])
    _err(ValueError, "head_dim .* multiple of 8", k[..., :12], k[..., :12])
    _err(ValueError, "no empty axis", k[:, :0], k[:, :0])
    _err(TypeError, "k must be a NumPy array", k.tolist(), k)
    _err(TypeError, "v must be a NumPy array", k, k.tolist())
    _err(ValueError, r"cache_seqlens must have shape \[B\]", k, k, cache_seqlens=[1, 2])
    _err(ValueError, r"cache_seqlens values must be in \[0, N\]", k, k, cache_seqlens=[5])
    _err(TypeError, "cache_seqlens must be an integer array", k, k, cache_seqlens=[1.5])
    with pytest.raises(TypeError, match="qkv must be a QuantizedKV"):
        fdpp.dequantize_kv((k, k))
    with pytest.raises(TypeError, match="codes must be uint8 or float8_e5m2"):
        dequant_fp8(np.zeros(4, ml_dtypes.float8_e4m3fn), "fp8_e5m2", 1.0)
    with pytest.raises(ValueError, match="fmt must be one of"):
        dequant_fp8(np.zeros(4, np.uint8), "int4", 1.0)
    with pytest.raises(ValueError, match="scale and zero must have shape"):
        dequant_int4(np.zeros((2, 16), np.uint8), np.ones((2, 2), np.float16), np.ones((2, 2), np.float16), 32)


def test_dequantize_checks_a_hand_built_quantized_kv(rng):
    """QuantizedKV is public: its fields are checked before any dequantisation (NumPy and device)."""
    from dataclasses import replace

    k = rng.standard_normal((2, 5, 2, 64)).astype(np.float16)
    q8, q4 = fdpp.quantize_kv(k, k, "fp8_e4m3"), fdpp.quantize_kv(k, k, "int4", group_size=32)
    cases = [
        (replace(q8, k_descale=None), TypeError, "qkv.k_descale must be a float32 array"),
        (replace(q8, v_descale=np.ones((3, 3), np.float32)), ValueError, r"qkv.v_descale must have shape \(2, 2\)"),
        (replace(q8, k_descale=np.ones((2, 2))), TypeError, "qkv.k_descale must be float32"),
        (replace(q8, fmt="int4"), TypeError, r"qkv.k must hold int4 codes \(uint8\)"),
        (replace(q4, group_size=0), ValueError, "group_size must be one of"),
        (replace(q4, group_size=None), TypeError, "group_size must be an int"),
        (replace(q4, group_size=64), ValueError, r"qkv.k_scale must have shape \(2, 5, 2, 1\)"),
        (replace(q4, v_zero=None), TypeError, "qkv.v_zero must be a float16 array"),
        (replace(q4, k_scale=q4.k_scale.astype(np.float32)), TypeError, "qkv.k_scale must be float16"),
        (replace(q4, v=q4.v[:, :3]), ValueError, "qkv.k and qkv.v must be 4-D codes of one shape"),
    ]
    for bad, exc, words in cases:
        with pytest.raises(exc, match=words):
            fdpp.dequantize_kv(bad)
    fdpp.dequantize_kv(q8), fdpp.dequantize_kv(q4)  # the originals are fine


def test_quantized_kv_is_frozen_and_exported():
    q = fdpp.quantize_kv(np.ones((1, 1, 1, 8), np.float16), np.ones((1, 1, 1, 8), np.float16))
    assert isinstance(q, fdpp.QuantizedKV) and fdpp.QuantizedKV is QuantizedKV and q.head_dim == 8
    with pytest.raises(AttributeError):
        q.fmt = "int4"  # type: ignore[misc]
    assert {"quantize_kv", "dequantize_kv", "QuantizedKV"} <= set(fdpp.__all__)


def test_kernel_config_names():
    space = quant.quant_compile_space()
    by_key = {c.key: c for c in space}
    assert by_key["quantize_fp8.f16.fp8_e4m3"].name_expression() == "fdpp::quantize_fp8<fdpp::half_t,1>"
    assert by_key["quantize_int4.bf16.g64"].name_expression() == "fdpp::quantize_int4<fdpp::bfloat16_t,64>"
    assert by_key["kv_descale.fp8_e5m2"].name_expression() == "fdpp::kv_descale<2>"
    assert by_key["kv_amax.f32"].threads == 256 and by_key["dequant_int4.g32"].threads == 128
    assert all(c.source == "quantize_kv.cu" and c.smem_bytes() == 0 for c in space)


# ---- the device path's host side, on CPU stand-ins (tests/fakegpu.py: no kernel runs) ---------
@pytest.fixture
def fake(monkeypatch):
    sys.path.insert(0, str(Path(__file__).parent))
    import fakegpu

    fakegpu.install(monkeypatch)
    fdpp.set_checks(False)
    keys = []
    monkeypatch.setattr(registry, "get_kernel", lambda cfg, dev=None: (keys.append(cfg.key), fakegpu._KERNEL)[1])
    fakegpu.KEYS = keys  # the variant of each launch
    return fakegpu


def _launched(fake):
    return [(grid, np.frombuffer(args[0], dtype=quant.QUANT_PARAMS.dtype if len(args[0]) == quant.QUANT_PARAMS.dtype.itemsize
                                 else quant.DEQUANT_PARAMS.dtype)[0]) for grid, _, args, _, _ in fake.LAUNCHES]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("scale", ["per_head", "per_tensor"])
def test_device_fp8_launches(fake, layout, scale):
    b, n, h, d = 2, 100, 4, 128
    shape = (b, n, h, d) if layout == "NHD" else (b, h, n, d)
    k, v = fake.ndarray(shape, ml_dtypes.bfloat16), fake.ndarray(shape, ml_dtypes.bfloat16)
    q = fdpp.quantize_kv(k, v, "fp8_e5m2", scale=scale, kv_layout=layout)
    assert q.k.shape == shape and q.k.dtype == np.uint8 and q.k_descale.shape == ((b, h) if scale == "per_head" else ())
    (g1, p1), (g2, p2), (g3, p3) = _launched(fake)
    assert p1["splits"] == quant.amax_splits(n, d) == 1  # 100 tokens: one chunk
    assert g1 == (b * h, 2, 1) and g2 == (1, 2, 1) and g3 == (-(-b * n * h * d // 8 // 128), 2, 1)
    assert p1.tobytes() == p2.tobytes() == p3.tobytes()
    assert fake.KEYS == ["kv_amax.bf16", "kv_descale.fp8_e5m2", "quantize_fp8.bf16.fp8_e5m2"]
    assert (p1["k_src"], p1["v_src"], p1["k_out"], p1["v_out"]) == (k.data.ptr, v.data.ptr, q.k.data.ptr, q.v.data.ptr)
    assert (p1["k_descale"], p1["v_descale"]) == (q.k_descale.data.ptr, q.v_descale.data.ptr) and p1["seqlens"] == 0
    st = (n * h * d, h * d, d) if layout == "NHD" else (h * n * d, d, n * d)  # request, token, head
    assert (p1["k_sb"], p1["k_sn"], p1["k_sh"]) == st == (p1["v_sb"], p1["v_sn"], p1["v_sh"])
    assert (p1["rows"], p1["batch"], p1["seqlen"], p1["heads"], p1["head_dim"]) == (b * n * h, b, n, h, d)
    assert (p1["hnd"], p1["per_tensor"]) == (layout == "HND", scale == "per_tensor")
    fake.LAUNCHES.clear()
    dk, dv = fdpp.dequantize_kv(q)
    assert dk.shape == shape and dk.dtype == np.float32
    (g4, p4), (_, p5) = _launched(fake)
    assert g4 == (-(-b * n * h * d // 8 // 128), 1, 1) and fake.KEYS[3:] == ["dequant_fp8.fp8_e5m2"] * 2
    assert (p4["codes"], p4["out"], p4["descale"], p5["codes"], p5["out"]) == (
        q.k.data.ptr, dk.data.ptr, q.k_descale.data.ptr, q.v.data.ptr, dv.data.ptr)
    assert (p4["rows"], p4["seqlen"], p4["heads"], p4["head_dim"], p4["hnd"], p4["per_tensor"]) == (
        b * n * h, n, h, d, layout == "HND", scale == "per_tensor")


def test_amax_splits(fake):
    assert [quant.amax_splits(n, 128) for n in (1, 255, 256, 512, 4096, 65536, 10**6)] == [1, 1, 1, 2, 16, 64, 64]
    assert quant.amax_splits(3, 1 << 22) == 3  # never more chunks than tokens
    k = fake.ndarray((1, 65536, 8, 128), np.float16)
    q = fdpp.quantize_kv(k, k, "fp8_e4m3", cache_seqlens=None)
    (g1, p1), _, _ = _launched(fake)
    assert g1 == (8, 2, 64) and p1["splits"] == 64 and q.k_descale.shape == (1, 8)


def test_device_int4_launch_and_strided_input(fake):
    b, n, h, d = 1, 33, 2, 64
    big = fake.ndarray((b, n + 7, h, d), np.float16)
    k = fake.ndarray((b, n, h, d), np.float16, ptr=big.data.ptr + 3 * h * d * 2, strides=(((n + 7) * h * d), h * d, d, 1))
    q = fdpp.quantize_kv(k, k, "int4", group_size=32)
    assert q.k.shape == (b, n, h, d // 2) and q.k_scale.shape == (b, n, h, 2) and q.k_scale.dtype == np.float16
    ((grid, p),) = _launched(fake)
    assert grid == (-(-b * n * h * d // 8 // 128), 2, 1) and fake.KEYS == ["quantize_int4.f16.g32"]
    assert p["k_src"] == k.data.ptr and p["k_sb"] == (n + 7) * h * d and p["k_sn"] == h * d  # read in place
    assert (p["k_scale"], p["k_zero"], p["v_scale"], p["v_zero"]) == tuple(x.data.ptr for x in (q.k_scale, q.k_zero, q.v_scale, q.v_zero))
    fake.LAUNCHES.clear()
    fdpp.dequantize_kv(q)
    (_, pk), (_, pv) = _launched(fake)
    assert (pk["scale"], pk["zero"], pv["scale"]) == (q.k_scale.data.ptr, q.k_zero.data.ptr, q.v_scale.data.ptr)


# ---- the CUDA source itself, compiled for the host ------------------------------------------
_HOST_SHIM = r"""
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <vector>
#define __device__
#define __forceinline__ inline
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
namespace fdpp {
%s
}
using namespace fdpp;
static std::vector<float> slurp(const char* path) {
  FILE* f = std::fopen(path, "rb"); std::fseek(f, 0, SEEK_END); long n = std::ftell(f) / 4; std::rewind(f);
  std::vector<float> v(n); if (std::fread(v.data(), 4, n, f) != (size_t)n) std::exit(2); std::fclose(f); return v;
}
int main(int argc, char** argv) {
  std::vector<float> x = slurp(argv[2]);
  FILE* o = std::fopen(argv[3], "wb");
  if (argv[1][0] == 'e') {          // encode: n bytes E4M3, then n bytes E5M2
    for (float v : x) std::fputc((int)f32_to_fp8<KV_FP8_E4M3>(v), o);
    for (float v : x) std::fputc((int)f32_to_fp8<KV_FP8_E5M2>(v), o);
  } else if (argv[1][0] == 'd') {   // decode all codes: 256 floats E4M3, 256 E5M2
    for (unsigned c = 0; c < 256; ++c) { float f = fp8_to_f32<KV_FP8_E4M3>(c); std::fwrite(&f, 4, 1, o); }
    for (unsigned c = 0; c < 256; ++c) { float f = fp8_to_f32<KV_FP8_E5M2>(c); std::fwrite(&f, 4, 1, o); }
  } else {                          // int4 codes of (x, scale, zero) triples
    for (size_t i = 0; i + 2 < x.size(); i += 3) std::fputc((int)int4_code(x[i], x[i + 1], x[i + 2]), o);
  }
  std::fclose(o);
  return 0;
}
"""


@pytest.fixture(scope="module")
def host_quant(tmp_path_factory):
    """quant.cuh's host-testable part (its text, unchanged) compiled with g++ as a small program."""
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a host C++ compiler (g++)")
    src = registry.kernel_source("quant.cuh")
    part = src[src.index("// ---- host-testable part"):src.index("// ---- end of the host-testable part")]
    d = tmp_path_factory.mktemp("quant_host")
    (d / "q.cpp").write_text(_HOST_SHIM % part)
    subprocess.run([cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-o", str(d / "q"), str(d / "q.cpp")],
                   check=True, capture_output=True)

    def run(mode, x):
        np.ascontiguousarray(x, np.float32).tofile(d / "in.bin")
        subprocess.run([str(d / "q"), mode, str(d / "in.bin"), str(d / "out.bin")], check=True)
        return np.fromfile(d / "out.bin", dtype=np.float32 if mode == "d" else np.uint8)

    return run


def test_cuda_fp8_source_matches_mirror_on_the_host(host_quant):
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 1 << 32, size=1 << 18, dtype=np.uint64).astype(np.uint32).view(np.float32)
    with np.errstate(invalid="ignore"):
        x = np.concatenate([ALL_F16, ALL_F16 * np.float32(2.0**-14), bits, _ties("fp8_e4m3"), _ties("fp8_e5m2")])
    out = host_quant("e", x)
    for i, fmt in enumerate(FP8_FMTS):
        got = out[i * x.size:(i + 1) * x.size]
        assert np.array_equal(got, fp8_encode_bits(x, fmt)), fmt
        assert np.array_equal(got, _ml(x, fmt)), fmt
    dec = host_quant("d", np.zeros(1, np.float32)).reshape(2, 256)
    for i, fmt in enumerate(FP8_FMTS):
        assert np.array_equal(dec[i].view(np.uint32), fp8_decode_bits(np.arange(256, dtype=np.uint8), fmt).view(np.uint32))


def test_cuda_int4_code_matches_mirror_on_the_host(host_quant):
    rng = np.random.default_rng(12)
    m = 1 << 16
    scale = (rng.uniform(0.5, 2, m) * 2.0 ** rng.integers(-10, 4, m)).astype(np.float16).astype(np.float32)
    zero = (rng.standard_normal(m) * 4).astype(np.float16).astype(np.float32)
    x = (zero + scale * rng.uniform(-1, 16, m)).astype(np.float32)
    x[:64] = zero[:64] + scale[:64] * (np.arange(64) % 16 + np.float32(0.5))  # exact halves: ties to even
    x[64] = np.nan
    got = host_quant("i", np.stack([x, scale, zero], axis=1).reshape(-1))
    assert np.array_equal(got, quant._int4_codes(x, scale, zero))


def test_tiny_float32_amax_never_gives_a_zero_descale():
    """amax / 448 rounds to 0 in float32 below 448 * 2^-149: the descale was 0 and the codes NaN
    (0 / 0). It is now at least 2^-149, so codes stay finite and decode near the input."""
    k = np.zeros((1, 8, 1, 64), np.float32)
    k[0, 0, 0, 0] = 1e-44
    v = np.ones_like(k)
    qkv = fdpp.quantize_kv(k, v)
    assert qkv.k_descale[0, 0] == np.float32(np.finfo(np.float32).smallest_subnormal)
    kd = fdpp.dequantize_kv(qkv)[0]
    assert np.isfinite(kd).all() and abs(float(kd[0, 0, 0, 0]) - 1e-44) <= 1e-45
    q = np.ones((1, 1, 64), np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = fdpp.decode_attention(q, qkv.k, qkv.v, k_descale=qkv.k_descale, v_descale=qkv.v_descale)
    np.testing.assert_array_equal(out, np.ones_like(out))
    w = np.ones((3, 64), np.float32)
    w[1] = 0
    w[1, 5] = 1e-44
    codes, scale = fdpp.quantize_weight(w)
    assert (scale > 0).all() and np.isfinite(codes.astype(np.float32)).all()


# ---- CuPy's -ftz=true ------------------------------------------------------------------------
# float32 instructions the quantizers may keep with .ftz, each unable to meet a subnormal: the
# truncation of a whole-number code, fp8_to_f32's subnormal scale (m <= 7 times 2^-16 / 2^-9 /
# 2^-17 / 2^-10: normal results), the clamps of rint'ed INT4 codes, and the NaN test.
_FTZ_BENIGN = re.compile(r"^(cvt\.rzi\.ftz\.u32\.f32|mul\.ftz\.f32 \S+ \S+ 0f(37800000|3B000000|B7800000|BB000000|"
                         r"37000000|3A800000|B7000000|BA800000)|setp\.ge\.ftz\.f32 \S+ \S+ 0f41700000|"
                         r"setp\.ltu\.ftz\.f32 \S+ \S+ 0f00000000|setp\.nan\.ftz\.f32) ")


@pytest.mark.parametrize("source", ["quantize_kv.cu", "paged_append.cu"])
def test_quantizers_keep_subnormals_under_cupys_ftz(source):
    """CuPy appends -ftz=true to every NVRTC compile, and under it float32 division, subtraction,
    fabsf and comparisons written in C flush subnormals: on an H100, K = 1e-44 (float32) got amax 0,
    descale 1 and code 0 where NumPy gives descale 2^-149 and code 78 (run Z16). The quantizers'
    float32 operations are PTX without .ftz (quant.cuh's f32_*); only instructions that cannot meet
    a subnormal may carry .ftz."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs the cuda-bindings NVRTC wheel")
    from fdpp.cache import append_quant_compile_space

    assert "-ftz=true" in registry.NVRTC_OPTIONS  # the offline compile builds what CuPy's builds
    space = quant.quant_compile_space() if source == "quantize_kv.cu" else append_quant_compile_space()
    ptx = registry.compile_ptx(space, "sm_90")
    ftz = [" ".join(ln.replace(",", " ").replace(";", " ").split()) for ln in ptx.splitlines() if ".ftz" in ln]
    assert ftz, "no .ftz at all: did the compile still get -ftz=true?"
    bad = sorted({ln for ln in ftz if not _FTZ_BENIGN.match(ln + " ")})
    assert not bad, f"float32 instructions that flush subnormals in {source}: {bad[:8]}"
