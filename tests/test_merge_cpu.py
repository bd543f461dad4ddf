"""fdpp.merge_states / fdpp.merge_state_ on NumPy (no GPU needed).

The meaningful check: a KV cache cut into pieces, each piece's (out, lse) from the float64
reference attention (fdpp.reference, never an fdpp kernel), merged, equals the reference attention
over the whole cache. Plus the semantics of empty (-inf) parts, NaN/+inf rows, S = 1, large lse
gaps, argument validation and the in-place variant.
"""

import ctypes
import itertools
import warnings

import numpy as np
import pytest

import fdpp
from fdpp import merge
from fdpp.dtypes import DTYPES
from fdpp.merge import MERGE_PARAMS, MergeConfig, merge_config, merge_variants
from fdpp.reference import assert_close, attention_reference, merge_states_reference

DTS = ["fp16", "bf16", "fp32"]


def _parts(rng, s, b, h, d, dt, spread=5.0):
    outs = rng.standard_normal((s, b, h, d)).astype(DTYPES[dt].np_dtype)
    lses = (rng.standard_normal((s, b, h)) * spread).astype(np.float32)
    return outs, lses


def _check(out, lse, ref, ref_lse, dt):
    assert out.dtype == DTYPES[dt].np_dtype and lse.dtype == np.float32
    assert_close(out.astype(np.float64), ref, dt)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-6, atol=1e-5)


# ---- against the float64 merge reference ----------------------------------------------------------
@pytest.mark.parametrize("dt, s, d", list(itertools.product(DTS, [1, 2, 3, 7], [8, 64, 128, 256])))
def test_numpy_matches_reference(dt, s, d, rng):
    outs, lses = _parts(rng, s, 3, 5, d, dt)
    ref, ref_lse = merge_states_reference(outs, lses)
    for o_in, l_in in ((outs, lses), (list(outs), list(lses)), (tuple(outs), lses), (outs, list(lses))):
        out, lse = fdpp.merge_states(o_in, l_in)
        assert out.shape == (3, 5, d) and lse.shape == (3, 5)
        _check(out, lse, ref, ref_lse, dt)


def test_reference_definition():
    """The reference itself against the formula, on one hand-made row."""
    o = np.array([[[[1.0, 2.0]]], [[[3.0, -1.0]]], [[[100.0, 100.0]]]])  # [S=3, 1, 1, 2]
    lse_s = np.array([[[0.0]], [[np.log(3.0)]], [[-np.inf]]])  # weights 1 : 3, the third empty
    out, lse = merge_states_reference(o, lse_s)
    np.testing.assert_allclose(out[0, 0], [(1 + 9) / 4, (2 - 3) / 4])
    np.testing.assert_allclose(lse[0, 0], np.log(4.0))


# ---- the meaningful check: split a cache, merge, compare with attention over the whole -----------
def _split_lengths(lens, bounds):
    """Per piece [lo, hi): each request's number of valid tokens inside it."""
    return [np.clip(lens - lo, 0, hi - lo) for lo, hi in bounds]


@pytest.mark.parametrize("dt, layout, ratio, d", [
    ("fp32", "NHD", 1, 64), ("fp16", "NHD", 4, 128), ("bf16", "HND", 3, 64), ("fp32", "HND", 8, 256),
    ("fp16", "HND", 1, 96),
])
def test_split_cache_merge_equals_full_attention(dt, layout, ratio, d, rng):
    b, hkv, n = 5, 2, 300
    hq = hkv * ratio
    npdt = DTYPES[dt].np_dtype
    q = rng.standard_normal((b, hq, d)).astype(npdt)
    shape = (b, n, hkv, d) if layout == "NHD" else (b, hkv, n, d)
    k, v = rng.standard_normal(shape).astype(npdt), rng.standard_normal(shape).astype(npdt)
    lens = np.array([300, 0, 1, 97, 154])  # one empty request, one of a single token
    bounds = [(0, 54), (54, 55), (55, 97), (97, 97), (97, 300)]  # uneven pieces, one of size 0
    axis = 1 if layout == "NHD" else 2
    outs, lses = [], []
    for (lo, hi), plen in zip(bounds, _split_lengths(lens, bounds), strict=True):
        sl = [slice(None)] * 4
        sl[axis] = slice(lo, hi)
        o, lse = attention_reference(q, k[tuple(sl)], v[tuple(sl)], plen, kv_layout=layout)
        outs.append(o.astype(npdt))  # what decode_attention would hand over: the output dtype, f32 lse
        lses.append(lse.astype(np.float32))
    ref, ref_lse = attention_reference(q, k, v, lens, kv_layout=layout)
    assert np.isneginf(lses[3]).all() and np.isneginf(ref_lse[1]).all()
    out, lse = fdpp.merge_states(outs, lses)
    _check(out, lse, ref, ref_lse, dt)
    np.testing.assert_array_equal(out[1].astype(np.float32), 0)  # the empty request: zeros, as decode_attention
    # two at a time with the in-place variant gives the same
    acc_o, acc_l = outs[0].copy(), lses[0].copy()
    for o, lse_p in zip(outs[1:], lses[1:], strict=True):
        fdpp.merge_state_(acc_o, acc_l, o, lse_p)
    _check(acc_o, acc_l, ref, ref_lse, dt)


def test_split_matches_decode_attention_emulator(rng):
    """Pieces computed by fdpp.decode_attention (the emulator here) merge to the whole."""
    b, hq, hkv, d, n = 3, 8, 2, 128, 200
    q = rng.standard_normal((b, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, n, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, n, hkv, d)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the emulator's one-time notice
        parts = [fdpp.decode_attention(q, k[:, :64], v[:, :64], return_lse=True),
                 fdpp.decode_attention(q, k[:, 64:], v[:, 64:], return_lse=True)]
    out, lse = fdpp.merge_states([p[0] for p in parts], [p[1] for p in parts])
    ref, ref_lse = attention_reference(q, k, v)
    _check(out, lse, ref, ref_lse, "fp32")


# ---- semantics ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", DTS)
def test_empty_parts_are_skipped_and_not_read(dt, rng):
    outs, lses = _parts(rng, 4, 2, 3, 64, dt)
    lses[1] = -np.inf  # part 1 empty everywhere, its output garbage
    outs[1] = np.nan
    lses[3, 0, 0] = -np.inf
    outs[3, 0, 0] = np.inf
    out, lse = fdpp.merge_states(outs, lses)
    keep = [0, 2, 3]
    ref, ref_lse = merge_states_reference(outs[keep], np.where(np.isneginf(lses[keep]), -np.inf, lses[keep]))
    _check(out, lse, ref, ref_lse, dt)
    assert not np.isnan(out.astype(np.float32)).any()


@pytest.mark.parametrize("dt", DTS)
def test_all_parts_empty(dt, rng):
    outs, lses = _parts(rng, 3, 2, 2, 64, dt)
    outs[:] = np.nan
    lses[:, 1, 0] = -np.inf  # one row with every part empty
    outs[:, 1, 0] = np.nan
    outs[:, :, 1] = 1
    outs[:, 0, 0] = 2
    out, lse = fdpp.merge_states(outs, lses)
    np.testing.assert_array_equal(out[1, 0].astype(np.float32), 0)
    assert np.isneginf(lse[1, 0])
    assert np.isfinite(lse[[0, 0, 1], [0, 1, 1]]).all()
    np.testing.assert_allclose(out[0, 0].astype(np.float32), 2, rtol=DTYPES[dt].rtol)
    lses[:] = -np.inf
    out, lse = fdpp.merge_states(outs, lses)
    assert (out.astype(np.float32) == 0).all() and np.isneginf(lse).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("dt", DTS)
def test_nan_or_inf_lse_poisons_only_its_row(bad, dt, rng):
    outs, lses = _parts(rng, 3, 4, 5, 128, dt)
    clean_o, clean_l = fdpp.merge_states(outs, lses)
    lses[1, 2, 3] = bad
    lses[0, 0, 0] = -np.inf  # an empty part elsewhere stays fine
    out, lse = fdpp.merge_states(outs, lses)
    assert np.isnan(out[2, 3].astype(np.float32)).all() and np.isnan(lse[2, 3])
    mask = np.ones((4, 5), bool)
    mask[2, 3] = mask[0, 0] = False
    np.testing.assert_array_equal(out[mask], clean_o[mask])
    np.testing.assert_array_equal(lse[mask], clean_l[mask])
    assert np.isfinite(out[0, 0].astype(np.float32)).all() and np.isfinite(lse[0, 0])


def test_nan_in_an_output_stays_in_its_row(rng):
    outs, lses = _parts(rng, 2, 2, 2, 64, "fp32")
    outs[1, 1, 0, 5] = np.nan
    out, lse = fdpp.merge_states(outs, lses)
    assert np.isnan(out[1, 0, 5]) and np.isfinite(np.delete(out.reshape(-1), 2 * 64 + 5)).all()
    assert np.isfinite(lse).all()


@pytest.mark.parametrize("dt", DTS)
def test_single_part_is_identity(dt, rng):
    outs, lses = _parts(rng, 1, 3, 4, 256, dt)
    lses[0, 0, 0] = -np.inf
    outs[0, 0, 0] = 0
    out, lse = fdpp.merge_states(outs, lses)
    np.testing.assert_array_equal(out, outs[0])
    np.testing.assert_array_equal(lse, lses[0])


def test_large_lse_gaps(rng):
    outs, lses = _parts(rng, 3, 2, 8, 64, "fp32")
    lses[0], lses[1], lses[2] = 80.0, -80.0, 79.0
    lses[:, 1, :4] = [[-80.0], [80.0], [-np.inf]]
    out, lse = fdpp.merge_states(outs, lses)
    ref, ref_lse = merge_states_reference(outs, lses)
    _check(out, lse, ref, ref_lse, "fp32")
    np.testing.assert_allclose(lse[1, :4], 80.0, rtol=1e-7)
    np.testing.assert_allclose(out[1, :4], outs[1, 1, :4], rtol=1e-6)  # exp(-160) is below fp32


def test_inputs_are_not_modified(rng):
    outs, lses = _parts(rng, 3, 2, 2, 64, "bf16")
    lses[0, 0, 0] = np.nan
    o0, l0 = outs.copy(), lses.copy()
    fdpp.merge_states(list(outs), lses)
    np.testing.assert_array_equal(outs.view(np.uint16), o0.view(np.uint16))
    np.testing.assert_array_equal(lses.view(np.uint32), l0.view(np.uint32))


def test_out_and_lse_out_are_written(rng):
    outs, lses = _parts(rng, 2, 3, 4, 64, "fp16")
    out = np.full((3, 4, 64), np.nan, np.float16)
    lse_out = np.full((3, 4), np.nan, np.float32)
    res, lse = fdpp.merge_states(outs, lses, out=out, lse_out=lse_out)
    assert res is out and lse is lse_out
    ref, ref_lse = merge_states_reference(outs, lses)
    _check(out, lse_out, ref, ref_lse, "fp16")


@pytest.mark.parametrize("dt", DTS)
def test_merge_state_in_place(dt, rng):
    outs, lses = _parts(rng, 2, 3, 4, 128, dt)
    out, lse = outs[0].copy(), lses[0].copy()
    other, other_lse = outs[1].copy(), lses[1].copy()
    res = fdpp.merge_state_(out, lse, other, other_lse)
    assert res[0] is out and res[1] is lse
    want_o, want_l = fdpp.merge_states(outs, lses)
    np.testing.assert_array_equal(out, want_o)
    np.testing.assert_array_equal(lse, want_l)
    np.testing.assert_array_equal(other, outs[1])  # the other part untouched
    np.testing.assert_array_equal(other_lse, lses[1])


def test_merge_state_empty_sides(rng):
    outs, lses = _parts(rng, 2, 1, 2, 64, "fp32")
    out, lse = outs[0].copy(), np.full((1, 2), -np.inf, np.float32)  # nothing accumulated yet
    out[:] = np.nan
    fdpp.merge_state_(out, lse, outs[1], lses[1])
    np.testing.assert_array_equal(out, outs[1])
    np.testing.assert_array_equal(lse, lses[1])
    fdpp.merge_state_(out, lse, outs[0], np.full((1, 2), -np.inf, np.float32))  # merging an empty part
    np.testing.assert_array_equal(out, outs[1])


def test_zero_rows(rng):
    out, lse = fdpp.merge_states(np.zeros((2, 0, 4, 64), np.float16), np.zeros((2, 0, 4), np.float32))
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


# ---- validation -----------------------------------------------------------------------------------
def _ok(s=2, b=2, h=3, d=64, dt=np.float16):
    return np.zeros((s, b, h, d), dt), np.zeros((s, b, h), np.float32)


def _bad_cases():
    o, lse = _ok()
    ro = np.zeros((2, 3, 64), np.float16)
    ro.flags.writeable = False
    return [
        ("S=0 stacked", dict(outs=np.zeros((0, 2, 3, 64), np.float16), lses=np.zeros((0, 2, 3), np.float32)),
         ValueError, "outs"),
        ("S=0 list", dict(outs=[], lses=[]), ValueError, "outs"),
        ("outs None", dict(outs=None, lses=lse), TypeError, "outs"),
        ("outs ndim", dict(outs=o[0], lses=lse), ValueError, "outs"),
        ("outs list ndim", dict(outs=[o[0], o[1, 0]], lses=list(lse)), ValueError, r"outs\[1\]"),
        ("outs list shape", dict(outs=[o[0], o[1, :, :2]], lses=list(lse)), ValueError, r"outs\[1\]"),
        ("outs list dtype", dict(outs=[o[0], o[1].astype(np.float32)], lses=list(lse)), TypeError, r"outs\[1\]"),
        ("outs dtype", dict(outs=o.astype(np.float64), lses=lse), TypeError, "outs"),
        ("outs int", dict(outs=o.astype(np.int32), lses=lse), TypeError, "outs"),
        ("outs head_dim", dict(outs=np.zeros((2, 2, 3, 60), np.float16), lses=lse), ValueError, "head_dim"),
        ("outs list element", dict(outs=[o[0], [1, 2]], lses=list(lse)), TypeError, r"outs\[1\]"),
        ("lses None", dict(outs=o, lses=None), TypeError, "lses"),
        ("lses dtype", dict(outs=o, lses=lse.astype(np.float16)), TypeError, "lses"),
        ("lses list dtype", dict(outs=o, lses=[lse[0], lse[1].astype(np.float64)]), TypeError, r"lses\[1\]"),
        ("lses ndim", dict(outs=o, lses=lse[0]), ValueError, "lses"),
        ("lses shape", dict(outs=o, lses=lse[:, :, :2]), ValueError, "lses"),
        ("lses count", dict(outs=o, lses=np.zeros((3, 2, 3), np.float32)), ValueError, "lses"),
        ("lses list count", dict(outs=list(o), lses=[lse[0]]), ValueError, "lses"),
        ("lses empty list", dict(outs=o, lses=[]), ValueError, "lses"),
        ("out shape", dict(outs=o, lses=lse, out=np.zeros((2, 3, 32), np.float16)), ValueError, "out"),
        ("out dtype", dict(outs=o, lses=lse, out=np.zeros((2, 3, 64), np.float32)), TypeError, "out"),
        ("out read-only", dict(outs=o, lses=lse, out=ro), ValueError, "out"),
        ("out overlaps outs", dict(outs=o, lses=lse, out=o[1]), ValueError, "out must not overlap outs"),
        ("out wrong type", dict(outs=o, lses=lse, out=[[0.0]]), TypeError, "out"),
        ("lse_out shape", dict(outs=o, lses=lse, lse_out=np.zeros((2,), np.float32)), ValueError, "lse_out"),
        ("lse_out dtype", dict(outs=o, lses=lse, lse_out=np.zeros((2, 3), np.float64)), TypeError, "lse_out"),
        ("lse_out overlaps lses", dict(outs=o, lses=lse, lse_out=lse[0]), ValueError, "lse_out must not overlap"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_arguments_name_themselves(case):
    _, kwargs, exc, match = case
    outs, lses = kwargs.pop("outs"), kwargs.pop("lses")
    with pytest.raises(exc, match=match):
        fdpp.merge_states(outs, lses, **kwargs)


@pytest.mark.parametrize("which, make, exc, match", [
    ("lse", lambda o, ls, oo, lo: (o, None, oo, lo), TypeError, "lse"),
    ("out_other", lambda o, ls, oo, lo: (o, ls, oo.astype(np.float32), lo), TypeError, "out_other"),
    ("out_other", lambda o, ls, oo, lo: (o, ls, oo[:1], lo), ValueError, "out_other"),
    ("lse_other", lambda o, ls, oo, lo: (o, ls, oo, lo.astype(np.float64)), TypeError, "lse_other"),
    ("lse", lambda o, ls, oo, lo: (o, ls[:1], oo, lo), ValueError, "lse"),
    ("out", lambda o, ls, oo, lo: (o, ls, o, lo), ValueError, "out must not overlap out_other"),
    ("lse", lambda o, ls, oo, lo: (o, ls, oo, ls), ValueError, "lse must not overlap lse_other"),
    ("out", lambda o, ls, oo, lo: (o[None], ls, oo, lo), ValueError, "out"),
])
def test_merge_state_bad_arguments(which, make, exc, match):
    o, lse = _ok()
    args = make(o[0].copy(), lse[0].copy(), o[1].copy(), lse[1].copy())
    with pytest.raises(exc, match=match):
        fdpp.merge_state_(*args)


def test_merge_state_read_only_out():
    o, lse = _ok()
    out = o[0].copy()
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out must be a writable"):
        fdpp.merge_state_(out, lse[0].copy(), o[1], lse[1])


# ---- the kernel config ----------------------------------------------------------------------------
def test_config_keys_are_derived_and_deterministic():
    cfgs = merge_variants()
    keys = [c.key for c in cfgs]
    assert len(set(keys)) == len(keys) == 9
    assert merge_config("fp16", 128).key == "merge_states.f16.d128.r8"
    assert merge_config("fp16", 128) == MergeConfig("fp16", 128, 8)
    assert merge_config("fp32", 256).name_expression() == "fdpp::merge_states<float,256,2>"
    for c in cfgs:
        assert c.is_valid() and c.threads <= 128 and c.smem_bytes() == 0 and c.source == "merge_states.cu"
        assert c.key == f"merge_states.{DTYPES[c.dtype].tag}.d{c.head_dim}.r{c.rows_per_cta}"
    assert "head_dim" in MergeConfig("fp32", 6, 1).check()
    assert "threads" in MergeConfig("fp32", 256, 32).check()
    assert MERGE_PARAMS.itemsize % 8 == 0 and MERGE_PARAMS.alignment == 8


# ---- the device launch's argument struct, checked on the host ---------------------------------------
def _mem(ptr, dtype, count):
    """``count`` elements of ``dtype`` at host address ``ptr`` (a writable view)."""
    dtype = np.dtype(dtype)
    return np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(ptr), dtype=dtype)


def _run_struct(p, np_dtype, d):
    """What kernels_cu/merge_states.cu does with a MergeParams, in NumPy (float64), reading and
    writing host memory through the struct's pointers and strides."""
    isz = np.dtype(np_dtype).itemsize
    n, st = int(p["num_parts"]), int(p["stacked"])
    for row in range(int(p["rows"])):
        b, h = divmod(row, int(p["num_heads"]))
        ls, os_ = [], []
        for s in range(n):
            k, so = (0, s) if st & 2 else (s, 0)
            off = so * int(p["l_ss"]) + b * int(p["l_sb"][k]) + h * int(p["l_sh"][k])
            ls.append(float(_mem(int(p["lse_part"][k]) + 4 * off, np.float32, 1)[0]))
            k, so = (0, s) if st & 1 else (s, 0)
            off = so * int(p["o_ss"]) + b * int(p["o_sb"][k]) + h * int(p["o_sh"][k])
            os_.append(_mem(int(p["out_part"][k]) + isz * off, np_dtype, d).astype(np.float64))
        o, lse = merge_states_reference(np.array(os_)[:, None, None], np.array(ls)[:, None, None])
        off = b * int(p["out_sb"]) + h * int(p["out_sh"])
        _mem(int(p["out"]) + isz * off, np_dtype, d)[:] = o[0, 0].astype(np_dtype)
        _mem(int(p["lse"]) + 4 * (b * int(p["lse_sb"]) + h * int(p["lse_sh"])), np.float32, 1)[0] = lse[0, 0]


def _struct_merge(outs, lses, out, lse_out):
    op, lp = merge._Parts("outs", outs, 3), merge._Parts("lses", lses, 2)
    _, views = merge._gather([op, lp], {"out": out, "lse_out": lse_out})
    _, _, _, d, dt = merge._check_parts(op, lp)
    params = merge.build_params(op, lp, views["out"], views["lse_out"])
    assert params.dtype == MERGE_PARAMS
    _run_struct(params, dt.np_dtype, d)


def test_struct_addresses_strided_stacked_views(rng):
    big = rng.standard_normal((3, 4, 6, 7, 64)).astype(np.float16)
    outs = big[:, 1, ::2, 2:6]  # [S=3, B=3, H=4, D]: strided in S, B and H
    lbig = rng.standard_normal((5, 3, 9)).astype(np.float32) * 3
    lses = lbig[::2, :, 1::2]  # [3, 3, 4], strided
    lses[1, 0, 0] = -np.inf
    out = np.full((3, 2, 4, 64), np.nan, np.float16)[:, 1]  # strided output
    lse_out = np.full((4, 3), np.nan, np.float32).T  # transposed
    _struct_merge(outs, lses, out, lse_out)
    want_o, want_l = fdpp.merge_states(outs, lses)
    np.testing.assert_array_equal(out, want_o)
    np.testing.assert_allclose(lse_out, want_l, rtol=1e-6)


def test_struct_addresses_lists_and_mixed_forms(rng):
    a = rng.standard_normal((2, 3, 128)).astype(np.float32)
    b_ = rng.standard_normal((2, 5, 3, 128)).astype(np.float32)[:, 1]  # other strides than a
    c = np.asfortranarray(rng.standard_normal((3, 2, 128)).astype(np.float32)).transpose(1, 0, 2).copy()
    outs = [a, b_, c]
    lses = rng.standard_normal((3, 2, 3)).astype(np.float32)
    for l_in in (lses, list(lses), [lses[0], lses[1].T.copy().T, lses[2]]):
        out = np.full((2, 3, 128), np.nan, np.float32)
        lse_out = np.full((2, 3), np.nan, np.float32)
        _struct_merge(outs, l_in, out, lse_out)
        want_o, want_l = fdpp.merge_states(outs, lses)
        np.testing.assert_allclose(out, want_o, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(lse_out, want_l, rtol=1e-6)
