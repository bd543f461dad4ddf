"""FP8 K/V caches without a GPU: the NumPy path (the split-KV emulator over the dequantised
cache) against the float64 reference, the config rules and argument errors."""

import numpy as np
import pytest
from paged_util import fill_sequences

import fdpp
from fdpp import api, configs
from fdpp.dtypes import KV_FORMATS
from fdpp.reference import attention_reference, dequant_fp8_cache

pytestmark = pytest.mark.filterwarnings("ignore:fdpp. no GPU found")


def _codes(shape, fmt, rng):
    f = KV_FORMATS[fmt]
    x = rng.standard_normal(shape, dtype=np.float32) * (f.max / 4)
    return np.clip(x, -f.max, f.max).astype(f.np_dtype)


@pytest.mark.skipif(api.gpu_available(), reason="the NumPy emulator runs only without a GPU")
@pytest.mark.parametrize("fmt", sorted(KV_FORMATS))
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_numpy_emulator_matches_reference_of_dequantised_cache(fmt, layout, rng):
    b, hq, hkv, d, n = 2, 8, 2, 64, 300
    q = rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16)
    shape = (b, n, hkv, d) if layout == "NHD" else (b, hkv, n, d)
    kc, vc = _codes(shape, fmt, rng), _codes(shape, fmt, rng)
    kd = rng.uniform(0.001, 0.01, size=(b, hkv)).astype(np.float32)
    lens = np.array([300, 77], np.int32)
    out, lse = fdpp.decode_attention(q, kc, vc, cache_seqlens=lens, kv_layout=layout, k_descale=kd,
                                     v_descale=0.004, return_lse=True)
    ref, ref_lse = attention_reference(q, dequant_fp8_cache(kc, fmt, kd, layout),
                                       dequant_fp8_cache(vc, fmt, 0.004, layout), lens, kv_layout=layout)
    np.testing.assert_allclose(out.astype(np.float32), ref, rtol=4e-3, atol=4e-3)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # [Hkv] descales: the same for every request
    kh = kd[1]
    out_h = fdpp.decode_attention(q, kc, vc, cache_seqlens=lens, kv_layout=layout, k_descale=kh, v_descale=0.004)
    ref_h, _ = attention_reference(q, dequant_fp8_cache(kc, fmt, kh, layout), dequant_fp8_cache(vc, fmt, 0.004, layout),
                                   lens, kv_layout=layout)
    np.testing.assert_allclose(out_h.astype(np.float32), ref_h, rtol=4e-3, atol=4e-3)
    # uint8 codes with the format named: the same numbers
    out8 = fdpp.decode_attention(q, kc.view(np.uint8), vc.view(np.uint8), cache_seqlens=lens, kv_layout=layout,
                                 kv_dtype=fmt, k_descale=kd, v_descale=0.004)
    np.testing.assert_array_equal(out8, out)


def test_dequantisation_is_code_times_descale():
    codes = np.arange(256, dtype=np.uint8).reshape(1, 4, 1, 64)
    for fmt, f in KV_FORMATS.items():
        x = dequant_fp8_cache(codes, fmt, np.array([[0.5]], np.float32))
        want = codes.view(f.np_dtype).astype(np.float32) * np.float32(0.5)
        np.testing.assert_array_equal(x, want)


def test_config_rules_for_fp8_caches():
    ok = configs.DecodeConfig("bf16", 128, 4, 4, 3, 1, mma=True, kv_dtype="fp8_e5m2")
    assert ok.kv_dtype == "fp8_e5m2" and ok.is_valid() and ok.key == "decode_split_mma.bf16.kve5m2.d128.g4.w4.s3.u1"
    assert "fdpp::fp8_e5m2_t" in ok.name_expression()
    assert "no such KV-type policy" in configs.DecodeConfig("fp32", 128, kv_dtype="fp8_e4m3").check()
    assert "head_dim" in configs.DecodeConfig("fp16", 96, kv_dtype="fp8_e4m3").check()
    assert "unquantised" in configs.DecodeConfig("fp16", 128, kernel="decode_nosplit", kv_dtype="fp8_e4m3").check()
    prob = configs.DecodeProblem(1, 32, 8, 128, 65536, "fp16", "fp8_e4m3")
    assert prob.quantized and prob.kv_bytes() == 2 * 65536 * 8 * 128 + 8 * 8  # codes + float32 descales
    plan = configs.default_config(prob)
    assert plan.split.mma and plan.split.kv_dtype == "fp8_e4m3"
    assert configs.cache_parts("fp16", "fp8_e4m3", 16) == ["kve4m3", "p16"]


@pytest.mark.parametrize("kw, exc, msg", [
    (dict(kv_dtype="int3"), ValueError, "kv_dtype must be None or one of"),
    (dict(kv_dtype="int4"), ValueError, "k_cache last axis 64 must be head_dim // 2"),  # FP8 codes named int4
    (dict(k_descale=np.ones((2, 3), np.float32)), ValueError, "k_descale must have shape"),
    (dict(k_descale=np.ones((2, 2), np.float64)), TypeError, "k_descale must be float32"),
    (dict(v_descale=float("inf")), ValueError, "v_descale must be a finite"),
    (dict(k_descale=np.array([[1.0, np.nan]] * 2, np.float32)), ValueError, "k_descale must be finite"),
])
def test_bad_fp8_arguments(kw, exc, msg, rng):
    q = np.zeros((2, 4, 64), np.float16)
    kc = _codes((2, 16, 2, 64), "fp8_e4m3", rng)
    with pytest.raises(exc, match=msg):
        fdpp.decode_attention(q, kc, kc, **kw)


def test_mismatched_fp8_inputs(rng):
    q = np.zeros((2, 4, 64), np.float16)
    e4, e5 = _codes((2, 16, 2, 64), "fp8_e4m3", rng), _codes((2, 16, 2, 64), "fp8_e5m2", rng)
    with pytest.raises(TypeError, match="one element type"):
        fdpp.decode_attention(q, e4, e5)
    with pytest.raises(TypeError, match="kv_dtype='fp8_e4m3'"):
        fdpp.decode_attention(q, e4.view(np.uint8), e4.view(np.uint8))
    with pytest.raises(TypeError, match="is fp8_e4m3 but kv_dtype"):
        fdpp.decode_attention(q, e4, e4, kv_dtype="fp8_e5m2")
    with pytest.raises(TypeError, match="fp16 or bf16 q"):
        fdpp.decode_attention(q.astype(np.float32), e4, e4)
    with pytest.raises(ValueError, match="head_dim"):
        fdpp.decode_attention(np.zeros((2, 4, 96), np.float16), e4[..., :96].repeat(2, -1)[..., :96],
                              e4[..., :96].repeat(2, -1)[..., :96])
    with pytest.raises(ValueError, match="applies to FP8 caches only"):
        fdpp.decode_attention(q, np.zeros((2, 16, 2, 64), np.float16), np.zeros((2, 16, 2, 64), np.float16),
                              v_descale=2.0)


@pytest.mark.skipif(api.gpu_available(), reason="the NumPy emulator runs only without a GPU")
def test_fp8_paged_cache_feeds_paged_decode_attention(rng):
    """PagedKVCache(kv_format=...) quantizes on append; attention_kwargs gives paged_decode_attention
    the format and descales, and the result is attention over the dequantized cache."""
    from fdpp.reference import gather_pages

    hkv, d, page = 2, 64, 16
    cache = fdpp.PagedKVCache(1, 16, page, hkv, d, dtype="fp16", kv_format="fp8_e4m3", backend="numpy",
                              k_descale=np.array([0.01, 0.02], np.float32), v_descale=0.005, max_batch=2)
    fill_sequences(cache, (40, 7), rng)
    q = rng.standard_normal((2, 8, d)).astype(np.float16)
    kw = cache.attention_kwargs(0)
    assert kw["kv_dtype"] == "fp8_e4m3" and kw["k_descale"].shape == (hkv,)
    out = fdpp.paged_decode_attention(q, cache.k_pages(0), cache.v_pages(0), cache.block_table, cache.seqlens, **kw)
    lens = cache.seqlens
    k = dequant_fp8_cache(gather_pages(cache.k_pages(0), cache.block_table, lens), "fp8_e4m3", kw["k_descale"])
    v = dequant_fp8_cache(gather_pages(cache.v_pages(0), cache.block_table, lens), "fp8_e4m3", kw["v_descale"])
    ref, _ = attention_reference(q, k, v, lens)
    np.testing.assert_allclose(out.astype(np.float32), ref, rtol=4e-3, atol=4e-3)
    assert fdpp.PagedKVCache(1, 4, page, hkv, d, backend="numpy").attention_kwargs(0) == {}
    assert fdpp.PagedKVCache(1, 4, page, hkv, d, kv_format="int4", backend="numpy").attention_kwargs(0)["kv_dtype"] == "int4"
