"""Argument validation and the NumPy (emulator) path of fdpp.decode_attention, on the CPU."""

import math
import warnings

import numpy as np
import pytest

import fdpp
from fdpp.configs import DecodeProblem
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
        ({"softmax_scale": 10**400}, ValueError, "softmax_scale must be at most"),
        ({"num_splits": 2.5}, TypeError, "num_splits"),
        ({"num_splits": True}, TypeError, "num_splits"),
        ({"cache_seqlens": np.array([1, 2, 3], np.int32)}, ValueError, "cache_seqlens must have shape"),
        ({"cache_seqlens": np.array([1.0, 2.0])}, TypeError, "cache_seqlens must be an integer"),
        ({"cache_seqlens": np.array([1, N + 1], np.int32)}, ValueError, r"cache_seqlens values must be in \[0, 37\]"),
        ({"cache_seqlens": np.array([-1, 3], np.int32)}, ValueError, "cache_seqlens values"),
        ({"cache_seqlens": np.array([3, 2**63 + 5], np.uint64)}, ValueError, "got 9223372036854775813 for request 1"),
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
    with pytest.warns(RuntimeWarning, match="no GPU found") as got:
        res, lse = fdpp.decode_attention(q, k, v, cache_seqlens=lens, return_lse=True, out=out, num_splits=3)
    assert got[0].filename == __file__  # the warning names the user's line, not one inside fdpp
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


def test_out_overlap_seen_through_negative_strides_and_small_inputs(rng):
    """A reversed view of out reaches below its pointer; out may not overlap cache_seqlens either."""
    k = rng.standard_normal((B, N, HKV, D)).astype(np.float16)
    buf = rng.standard_normal((B, HQ, D)).astype(np.float16)
    before = buf.copy()
    with pytest.raises(ValueError, match="overlap q"):
        _call(buf[::-1], k, k, out=buf)
    assert np.array_equal(buf, before)
    raw = np.zeros(B * HQ * D * 2, np.uint8)
    lens = raw[:4 * B].view(np.int32)
    lens[:] = N
    with pytest.raises(ValueError, match="out must not overlap cache_seqlens"):
        _call(rng.standard_normal((B, HQ, D)).astype(np.float16), k, k, cache_seqlens=lens,
              out=raw.view(np.float16).reshape(B, HQ, D))
    assert (lens == N).all()


@pytest.mark.skipif(fdpp.gpu_available(), reason="checks the NumPy path (the GPU's: tests/test_hostile_gpu.py)")
@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_nan_poisons_lse_so_a_merge_keeps_it(rng, where, splits):
    """NaN in q or K: that head's output and lse are NaN. An lse of -inf would mark the part empty
    and merge_states would drop the NaN, returning a finite answer."""
    q = rng.standard_normal((B, HQ, D)).astype(np.float16)
    k = rng.standard_normal((B, N, HKV, D)).astype(np.float16)
    if where == "q":
        q[1, 3, 5] = np.nan
    else:
        k[1, 4, 3 // (HQ // HKV), 5] = np.nan  # a token within every length
    r = HQ // HKV  # query heads per KV head: NaN in KV head 3 // r reaches all r of them
    heads = [3] if where == "q" else list(range((3 // r) * r, (3 // r + 1) * r))
    o, lse = _call(q, k, k, return_lse=True, num_splits=splits)
    assert np.isnan(o[1, heads]).all() and np.isnan(lse[1, heads]).all()
    assert np.isfinite(lse[0]).all() and np.isfinite(o[0]).all()
    o2, lse2 = _call(rng.standard_normal((B, HQ, D)).astype(np.float16), k[:, :5], k[:, :5], return_lse=True)
    merged, _ = fdpp.merge_states([o, o2], [lse, lse2])
    assert np.isnan(merged[1, heads]).all() and np.isfinite(merged[0]).all()


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


@pytest.mark.parametrize("over, exc, words", [
    ({"batch": 0}, ValueError, "batch must be >= 1"),
    ({"batch": 2.7}, TypeError, "batch must be an int"),
    ({"batch": "2"}, TypeError, "batch must be an int"),
    ({"num_kv_heads": 0}, ValueError, "num_kv_heads must be >= 1"),
    ({"num_q_heads": 7}, ValueError, r"num_q_heads \(7\) must be a positive multiple"),
    ({"head_dim": 0}, ValueError, "head_dim must be >= 1"),
    ({"head_dim": 32}, ValueError, "head_dim must be one of"),
    ({"seqlen": -5}, ValueError, "seqlen must be >= 0"),
    ({"page_size": 3}, ValueError, "page_size must be 0"),
    ({"page_size": 16, "seqlen": 40}, ValueError, r"seqlen must be max_pages_per_seq \* page_size"),
    ({"kv_layout": "XYZ"}, ValueError, "kv_layout"),
    ({"num_splits": 0}, ValueError, "num_splits must be in"),
    ({"softmax_scale": "x"}, TypeError, "softmax_scale must be a float"),
    ({"softmax_scale": 10**400}, ValueError, "softmax_scale must be at most"),
    ({"softmax_scale": float("nan")}, ValueError, "softmax_scale must be finite"),
    ({"batch_invariant": 1}, TypeError, "batch_invariant must be a bool"),
    ({"return_lse": "no"}, TypeError, "return_lse must be a bool"),
    ({"kv_dtype": "int4", "group_size": 0}, ValueError, "group_size must be one of"),
    ({"kv_dtype": "int4", "dtype": "fp32"}, TypeError, "takes fp16 or bf16 q"),
    ({"kv_dtype": "fp8_e4m3", "head_dim": 256}, ValueError, "takes head_dim in"),
    ({"num_splits": 2, "batch_invariant": True}, ValueError, "num_splits and batch_invariant=True exclude"),
])
def test_decode_plan_checks_its_arguments(over, exc, words):
    args = {"batch": 2, "num_q_heads": 8, "num_kv_heads": 2, "head_dim": 64, "seqlen": 48, **over}
    with pytest.raises(exc, match=words):
        fdpp.DecodePlan(**args)
    fdpp.DecodePlan(2, 8, 2, 64, 48)  # the base arguments are valid


@pytest.mark.parametrize("problem, num_splits, exc, words", [
    (DecodeProblem(1, 32, 0, 128, 4096), None, ValueError, "problem.num_kv_heads must be >= 1"),
    (DecodeProblem(0, 32, 8, 128, 4096), None, ValueError, "problem.batch must be >= 1"),
    (DecodeProblem(1, 32, 8, 128, 4096, "fp64"), None, ValueError, "problem.dtype must be one of"),
    (DecodeProblem(1, 7, 2, 128, 4096), None, ValueError, "must be a positive multiple of num_kv_heads"),
    (DecodeProblem(1, 32, 8, 32, 4096), None, ValueError, "problem.head_dim must be one of"),
    (DecodeProblem(1, 32, 8, 128, 4096), 2.5, TypeError, "num_splits must be an int"),
    (DecodeProblem(1, 32, 8, 128, 4096), True, TypeError, "num_splits must be an int"),
    ((1, 32, 8, 128, 4096), None, TypeError, r"problem must be a fdpp\.configs\.DecodeProblem"),
    (DecodeProblem(1, 32, 8, 128, 100, page_size=16), None, ValueError, "problem.seqlen must be pages per request"),
    (DecodeProblem(1, 32, 8, 128, 4096, "fp32", "fp8_e4m3"), None, ValueError, "takes fp16 or bf16 q"),
    (DecodeProblem(1, 32, 8, 256, 4096, "fp16", "int4_g64"), None, ValueError, "takes head_dim in"),
    (DecodeProblem(1, 32, 8, 128, 4096, "fp16", "bf16"), None, ValueError, "must be q's dtype 'fp16' or a quantized"),
])
def test_explain_checks_its_arguments(problem, num_splits, exc, words):
    with pytest.raises(exc, match=words):
        fdpp.explain(problem, num_splits=num_splits)
    assert "problem:" in fdpp.explain(DecodeProblem(1, 32, 8, 128, 4096), num_splits=3)


@pytest.mark.parametrize("flag", ["no", None, 1, np.array([True])])
def test_return_lse_must_be_a_bool(arrays, flag):
    """A truthy string or array once decided silently whether a tuple came back."""
    q, k, v = arrays
    pages = k.reshape(B * N, 1, HKV, D)
    table = np.arange(B * N, dtype=np.int32).reshape(B, N)
    lens = np.full(B, N, np.int32)
    calls = [lambda **kw: _call(q, k, v, **kw),
             lambda **kw: fdpp.decode_attention_nosplit(q, k, v, **kw),
             lambda **kw: fdpp.paged_decode_attention(q, pages, pages, table, lens, **kw)]
    for call in calls:
        with pytest.raises(TypeError, match="return_lse must be a bool"):
            call(return_lse=flag)
    for call in (calls[0], calls[2]):  # the no-split baseline runs on a GPU only
        out, lse = call(return_lse=np.True_)  # NumPy's bool is a bool
        assert out.shape == (B, HQ, D) and lse.shape == (B, HQ)


def test_set_checks_takes_a_bool():
    before = fdpp.api.checks_enabled()
    try:
        with pytest.raises(TypeError, match="enabled must be a bool"):
            fdpp.set_checks("no")  # once: bool("no") is True, host syncs on
        assert fdpp.api.checks_enabled() == before
    finally:
        fdpp.set_checks(before)


@pytest.mark.parametrize("text, on, warns", [
    ("", False, False), ("0", False, False), ("false", False, False), ("No", False, False), ("off", False, False),
    ("1", True, False), ("true", True, False), ("YES", True, False), ("on", True, False), ("enable", True, True),
])
def test_fdpp_checks_environment_words(monkeypatch, text, on, warns):
    """FDPP_CHECKS=false once turned the checks on (anything but "" and "0" did)."""
    monkeypatch.setenv("FDPP_CHECKS", text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fdpp.api._env_flag("FDPP_CHECKS") is on
    assert any("FDPP_CHECKS" in str(w.message) for w in caught) is warns


@pytest.mark.parametrize("kw, exc, words", [
    ({"softmax_scale": True}, TypeError, "softmax_scale must be a float"),
    ({"softmax_scale": "0.5"}, TypeError, "softmax_scale must be a float"),
    ({"softmax_scale": float("inf")}, ValueError, "softmax_scale must be finite"),
    ({"cache_seqlens": np.array([16.9, 1.5])}, TypeError, "cache_seqlens must hold integers"),
    ({"cache_seqlens": np.array([True, False])}, TypeError, "cache_seqlens must hold integers"),
    ({"cache_seqlens": [16, 1]}, TypeError, "cache_seqlens must be a NumPy, CuPy or torch array"),
    ({"kv_layout": "nhd"}, ValueError, "kv_layout"),
])
def test_calibrate_unified_max_checks_its_arguments(arrays, kw, exc, words):
    q, k, _ = arrays
    with pytest.raises(exc, match=words):
        fdpp.calibrate_unified_max(q, k, **kw)
    assert math.isfinite(fdpp.calibrate_unified_max(q, k, cache_seqlens=np.array([16, 1], np.int32)))


def test_explain_device_must_be_device_limits():
    with pytest.raises(TypeError, match="device must be a fdpp.configs.DeviceLimits"):
        fdpp.explain(DecodeProblem(1, 32, 8, 128, 4096), device="H100")


def test_emulator_batch_invariant_whatever_n_max():
    """batch_invariant promises the same bits whatever N_max and batch: the NumPy emulator's sums
    grouped their terms by the cache's length (4 of 17 x 32 x 128 fp16 outputs differed)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((17, 32, 128)).astype(np.float16)
    k = rng.standard_normal((17, 2100, 4, 128)).astype(np.float16)
    lens = rng.integers(1100, 1600, 17).astype(np.int32)
    a = _call(q, k[:, :1600].copy(), k[:, :1600].copy(), cache_seqlens=lens, batch_invariant=True)
    b = _call(q, k, k, cache_seqlens=lens, batch_invariant=True)
    np.testing.assert_array_equal(a, b)
    one = _call(q[3:4], k[3:4, :1600].copy(), k[3:4, :1600].copy(), cache_seqlens=lens[3:4], batch_invariant=True)
    np.testing.assert_array_equal(one, a[3:4])


@pytest.mark.parametrize("case", ["nhd", "hnd", "paged", "int4"])
def test_emulator_reads_only_the_tokens_below_the_longest_length(case, monkeypatch):
    """A NumPy PagedKVCache's block table is max_pages_per_seq wide (65,536 tokens for 4,096 pages of
    16), and the emulator once gathered and attended over all of it: 1.5-3 s a call for a few dozen
    tokens. It now stops at the longest length; the bits are those of the wide call."""
    from fdpp import reference

    seen = []
    real = reference.split_kv_emulator

    def spy(q, k, v, *a, **kw):
        seen.append(k.shape)
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(reference, "split_kv_emulator", spy)
    rng = np.random.default_rng(3)
    b, hq, hkv, d, page, wide = 3, 8, 2, 64, 16, 4096
    lens = np.array([37, 5, 70], np.int32)
    q = rng.standard_normal((b, hq, d)).astype(np.float16)
    kv = rng.standard_normal((2, b, 80, hkv, d)).astype(np.float16)
    kw = dict(cache_seqlens=lens, batch_invariant=True)
    if case == "paged":
        pool = np.zeros((2, 1 + b * wide // page, page, hkv, d), np.float16)
        table = np.zeros((b, wide // page), np.int32)
        table[:] = 1 + np.arange(b * wide // page).reshape(b, -1)
        for i in range(b):
            for t in range(80):
                pool[:, table[i, t // page], t % page] = kv[:, i, t]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got = fdpp.paged_decode_attention(q, pool[0], pool[1], table, lens, batch_invariant=True)
            narrow = fdpp.paged_decode_attention(q, pool[0], pool[1], table[:, :5], lens, batch_invariant=True)
        assert seen == [(b, 80, hkv, d)] * 2  # pages of the longest length only, whatever the table's width
    else:
        big = np.zeros((2, b, wide, hkv, d), np.float16)
        big[:, :, :80] = kv
        k, v, k80, v80 = big[0], big[1], kv[0], kv[1]
        if case == "hnd":
            k, v, k80, v80 = (x.transpose(0, 2, 1, 3).copy() for x in (k, v, k80, v80))
            kw["kv_layout"] = "HND"
        if case == "int4":
            qk, q80 = fdpp.quantize_kv(k, v, "int4", group_size=32), fdpp.quantize_kv(k80, v80, "int4", group_size=32)
            k, v, k80, v80 = qk.k, qk.v, q80.k, q80.v
            kw.update(kv_dtype="int4")
            wide_kw = dict(k_descale=qk.k_scale, v_descale=qk.v_scale, k_zero=qk.k_zero, v_zero=qk.v_zero)
            kw80 = dict(k_descale=q80.k_scale, v_descale=q80.v_scale, k_zero=q80.k_zero, v_zero=q80.v_zero)
        else:
            wide_kw = kw80 = {}
        got, narrow = _call(q, k, v, **kw, **wide_kw), _call(q, k80, v80, **kw, **kw80)
        axis = 2 if case == "hnd" else 1
        assert seen[0][axis] == 70 and seen[1][axis] == 70
    np.testing.assert_array_equal(got, narrow)
    if case != "int4":
        assert_close(got, attention_reference(q, kv[0], kv[1], lens)[0], "fp16")


def test_calibrate_unified_max_needs_a_head_dim():
    with pytest.raises(ValueError, match="head_dim"):
        fdpp.calibrate_unified_max(np.zeros((1, 1, 0), np.float16), np.zeros((1, 4, 1, 0), np.float16))
