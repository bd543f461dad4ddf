"""The NumPy split-KV emulator against the plain float64 reference (CPU)."""

import math

import ml_dtypes
import numpy as np
import pytest

from fdpp.reference import assert_close, attention_reference, max_rel_err, split_kv_emulator


def _make(rng, b, hq, hkv, d, n, layout, dtype=np.float32, scale=1.0):
    q = (rng.standard_normal((b, hq, d)) * scale).astype(dtype)
    shape = (b, n, hkv, d) if layout == "NHD" else (b, hkv, n, d)
    k = rng.standard_normal(shape).astype(dtype)
    v = rng.standard_normal(shape).astype(dtype)
    return q, k, v


def test_reference_matches_naive_loop(rng):
    q, k, v = _make(rng, 2, 6, 2, 64, 13, "NHD")
    lens = np.array([13, 5])
    out, lse = attention_reference(q, k, v, lens, softmax_scale=0.3)
    for i in range(2):
        for h in range(6):
            n = lens[i]
            s = k[i, :n, h // 3].astype(np.float64) @ q[i, h].astype(np.float64) * 0.3
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ v[i, :n, h // 3]
            # float64 vs float64 in another summation order: relative to the row's
            # scale, since one element can sit near a cancellation
            np.testing.assert_allclose(out[i, h], want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
            np.testing.assert_allclose(lse[i, h], s.max() + np.log(p.sum()), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("ratio", [1, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 54, 97, 4097])
def test_emulator_equals_reference_any_chunk(rng, layout, ratio, n):
    hkv = 2
    q, k, v = _make(rng, 3, hkv * ratio, hkv, 64, n, layout)
    ref, ref_lse = attention_reference(q, k, v, kv_layout=layout)
    for chunk in (1, 7, 64, 256, n, n + 5):
        if chunk == 1 and n > 100:
            continue  # same code path as chunk 7, only slower
        out, lse = split_kv_emulator(q, k, v, kv_layout=layout, chunk=chunk)
        assert max_rel_err(out, ref) < 1e-5, chunk
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_emulator_varlen_and_empty_requests(rng):
    q, k, v = _make(rng, 17, 8, 2, 128, 97, "NHD")
    lens = rng.integers(0, 98, size=17)
    lens[0], lens[1], lens[2] = 0, 1, 97
    ref, ref_lse = attention_reference(q, k, v, lens)
    out, lse = split_kv_emulator(q, k, v, lens, chunk=16)
    assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0]))
    assert max_rel_err(out, ref) < 1e-5
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)


def test_emulator_huge_logits(rng):
    # scores in the thousands: any missing max-subtraction overflows exp
    q, k, v = _make(rng, 2, 4, 4, 64, 300, "NHD", scale=400.0)
    ref, ref_lse = attention_reference(q, k, v)
    assert np.abs(ref_lse).max() > 1000
    # the algorithm is exact: in float64 it matches to float64 rounding
    out64, lse64 = split_kv_emulator(q, k, v, chunk=32, accum=np.float64)
    assert max_rel_err(out64, ref) < 1e-10
    np.testing.assert_allclose(lse64, ref_lse, rtol=1e-12)
    # in float32, scores of |s| ~ 1e3 carry ~1e-4 absolute error, so exp(s - m) does too
    out, lse = split_kv_emulator(q, k, v, chunk=32)
    assert np.isfinite(out).all()
    assert max_rel_err(out, ref) < 1e-3
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_emulator_low_precision_inputs(rng, dtype):
    q, k, v = _make(rng, 2, 8, 2, 128, 97, "HND", dtype=dtype)
    ref, _ = attention_reference(q, k, v, kv_layout="HND")  # float64 of the same rounded inputs
    out, _ = split_kv_emulator(q, k, v, kv_layout="HND", chunk=32)
    assert max_rel_err(out, ref) < 1e-5


def test_max_rel_err_catches_nan_and_shape():
    a = np.ones((2, 3))
    b = a.copy()
    b[0, 0] = np.nan
    assert max_rel_err(b, a) == math.inf
    with pytest.raises(ValueError):
        max_rel_err(a, np.ones((3, 2)))
    with pytest.raises(AssertionError):
        assert_close(b, a, "fp16")
    with pytest.raises(AssertionError):
        assert_close(a * 1.01, a, "fp32")
    assert_close(a * 1.001, a, "fp16")
