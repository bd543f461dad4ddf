"""Argument validation and the NumPy (emulator) path of fdpp.decode_attention, on the CPU."""

import warnings

import numpy as np
import pytest

import fdpp
from fdpp.reference import assert_close, attention_reference

B, HQ, HKV, D, N = 2, 8, 2, 64, 37


@pytest.fixture
def arrays(rng):
    q = rng.standard_normal((B, HQ, D)).astype(np.float16)
    k = rng.standard_normal((B, N, HKV, D)).astype(np.float16)
    v = rng.standard_normal((B, N, HKV, D)).astype(np.float16)
    return q, k, v


def _call(q, k, v, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fdpp.decode_attention(q, k, v, **kw)


@pytest.mark.parametrize(
    "mutate, exc, words",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, "q must have shape"),
        (lambda q, k, v: (q, k[0], v), ValueError, "k_cache must have shape"),
        (lambda q, k, v: (q, k, v[:, :5]), ValueError, "same shape"),
        (lambda q, k, v: (q[:1], k, v), ValueError, "batch"),
        (lambda q, k, v: (q[:, :, :32], k, v), ValueError, "head_dim"),
        (lambda q, k, v: (q[:, :7], k, v), ValueError, "multiple of num_kv_heads"),
        (lambda q, k, v: (q, k.astype(np.float32), v), TypeError, "k_cache dtype"),
        (lambda q, k, v: (q.astype(np.float64), k, v), TypeError, "unsupported dtype"),
        (lambda q, k, v: (q.astype(np.int32), k, v), TypeError, "unsupported dtype"),
        (lambda q, k, v: (q.tolist(), k, v), TypeError, "q must be"),
        (lambda q, k, v: (q, k.tolist(), v), TypeError, "k_cache must be the same array type"),
    ],
)
def test_bad_arrays(arrays, mutate, exc, words):
    with pytest.raises(exc, match=words):
        _call(*mutate(*arrays))


def test_unsupported_head_dim(rng):
    q = rng.standard_normal((1, 2, 80)).astype(np.float16)
    k = rng.standard_normal((1, 4, 2, 80)).astype(np.float16)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        _call(q, k, k)


@pytest.mark.parametrize(
    "kw, exc, words",
    [
        ({"kv_layout": "BHND"}, ValueError, "kv_layout"),
        ({"softmax_scale": "x"}, TypeError, "softmax_scale"),
        ({"softmax_scale": float("nan")}, ValueError, "softmax_scale"),
        ({"num_splits": 2.5}, TypeError, "num_splits"),
        ({"num_splits": True}, TypeError, "num_splits"),
        ({"cache_seqlens": np.array([1, 2, 3], np.int32)}, ValueError, "cache_seqlens must have shape"),
        ({"cache_seqlens": np.array([1.0, 2.0])}, TypeError, "cache_seqlens must be an integer"),
        ({"cache_seqlens": np.array([1, N + 1], np.int32)}, ValueError, r"cache_seqlens values must be in \[0, 37\]"),
        ({"cache_seqlens": np.array([-1, 3], np.int32)}, ValueError, "cache_seqlens values"),
        ({"cache_seqlens": [1, 2]}, TypeError, "cache_seqlens must be the same array type"),
        ({"out": np.empty((B, HQ, D), np.float32)}, TypeError, "out dtype"),
        ({"out": np.empty((B, HQ, D + 1), np.float16)}, ValueError, "out must have shape"),
        ({"out": np.empty((B, D, HQ), np.float16).transpose(0, 2, 1)}, ValueError, "C-contiguous"),
    ],
)
def test_bad_keywords(arrays, kw, exc, words):
    with pytest.raises(exc, match=words):
        _call(*arrays, **kw)


def test_num_splits_range(arrays):
    with pytest.raises(ValueError, match="num_splits"):
        _call(*arrays, num_splits=0)


def test_out_must_not_alias_inputs(arrays):
    q, k, v = arrays
    with pytest.raises(ValueError, match="overlap q"):
        _call(q, k, v, out=q)


@pytest.mark.skipif(fdpp.gpu_available(), reason="checks the no-GPU emulator path")
def test_emulator_path_warns_once_and_is_correct(arrays, rng):
    q, k, v = arrays
    lens = np.array([N, 5], np.int32)
    snapshot = [a.copy() for a in (q, k, v, lens)]
    out = np.full((B, HQ, D), np.nan, np.float16)
    fdpp.api._warn_emulator.cache_clear()
    with pytest.warns(RuntimeWarning, match="no GPU found"):
        res, lse = fdpp.decode_attention(q, k, v, cache_seqlens=lens, return_lse=True, out=out, num_splits=3)
    assert res is out and res.dtype == np.float16 and lse.dtype == np.float32 and lse.shape == (B, HQ)
    ref, ref_lse = attention_reference(q, k, v, lens)
    assert_close(res, ref, "fp16")
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)
    for a, b in zip((q, k, v, lens), snapshot, strict=True):
        np.testing.assert_array_equal(a, b)  # inputs untouched
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is one-time
        fdpp.decode_attention(q, k, v)


@pytest.mark.skipif(fdpp.gpu_available(), reason="checks the no-GPU emulator path")
def test_emulator_path_empty_request_and_hnd(rng):
    q = rng.standard_normal((2, 6, 96)).astype(np.float32)
    k = rng.standard_normal((2, 2, 11, 96)).astype(np.float32)
    v = rng.standard_normal((2, 2, 11, 96)).astype(np.float32)
    lens = np.array([0, 11], np.int32)
    out, lse = _call(q, k, v, cache_seqlens=lens, kv_layout="HND", return_lse=True)
    assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0]))
    ref, _ = attention_reference(q, k, v, lens, kv_layout="HND")
    assert_close(out, ref, "fp32")


@pytest.mark.skipif(fdpp.gpu_available(), reason="checks the no-GPU path")
def test_nosplit_baseline_needs_gpu(arrays):
    with pytest.raises(RuntimeError, match="needs a GPU"):
        fdpp.decode_attention_nosplit(*arrays)


def test_out_partial_overlap_and_adjacent(rng):
    """The overlap check uses each array's byte span: half-overlapping fails, adjacent passes."""
    size = B * HQ * D
    buf = rng.standard_normal(3 * size).astype(np.float16)
    q = buf[:size].reshape(B, HQ, D)
    k = rng.standard_normal((B, N, HKV, D)).astype(np.float16)
    with pytest.raises(ValueError, match="overlap q"):
        _call(q, k, k, out=buf[size // 2:size // 2 + size].reshape(B, HQ, D))
    out = buf[size:2 * size].reshape(B, HQ, D)
    assert _call(q, k, k, out=out) is out


@pytest.mark.parametrize("spelling, name", [("fp16", "fp16"), ("half", "fp16"), (np.float16, "fp16"),
                                            (np.dtype(np.float32), "fp32"), ("bfloat16", "bf16")])
def test_dtype_resolution_is_stable(spelling, name):
    from fdpp.dtypes import get_dtype

    assert get_dtype(spelling).name == name
    assert get_dtype(spelling) is get_dtype(spelling)  # the remembered answer is the same entry
    for bad in ("int8", np.dtype(np.int32), [np.float16]):  # never remembered as supported
        for _ in range(2):
            with pytest.raises(TypeError, match="unsupported dtype"):
                get_dtype(bad)
