"""paged_decode_attention on the CPU: argument validation (every bad input raises naming the
argument) and the NumPy emulator path against the independent float64 reference."""

import itertools
import warnings

import numpy as np
import pytest

import fdpp
from fdpp.reference import assert_close, gather_pages, paged_attention_reference

B, HQ, HKV, D, PAGE, PAGES = 3, 8, 2, 64, 16, 12


def _shuffled(rng, b=B, hq=HQ, hkv=HKV, d=D, page=PAGE, pages=PAGES, layout="NHD", dt=np.float16):
    shape = (pages, page, hkv, d) if layout == "NHD" else (pages, hkv, page, d)
    q = rng.standard_normal((b, hq, d)).astype(dt)
    kp = rng.standard_normal(shape).astype(dt)
    vp = rng.standard_normal(shape).astype(dt)
    table = rng.permutation(pages)[: b * (pages // b)].reshape(b, pages // b).astype(np.int32)
    return q, kp, vp, table


def _call(*args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fdpp.paged_decode_attention(*args, **kw)


@pytest.mark.parametrize("layout, page, ratio", list(itertools.product(["NHD", "HND"], [1, 16, 64], [1, 4])))
def test_emulator_matches_reference(rng, layout, page, ratio):
    pages = 3 * max(1, 160 // page)
    q, kp, vp, table = _shuffled(rng, hq=HKV * ratio, page=page, pages=pages, layout=layout)
    cap = table.shape[1] * page
    lens = np.array([cap, 0, min(cap, 97)], np.int32)
    out, lse = _call(q, kp, vp, table, lens, kv_layout=layout, return_lse=True)
    ref, ref_lse = paged_attention_reference(q, kp, vp, table, lens, kv_layout=layout)
    assert_close(out, ref, "fp16")
    assert np.isneginf(lse[1]).all() and (out[1] == 0).all()
    np.testing.assert_allclose(lse[[0, 2]], ref_lse[[0, 2]], rtol=1e-5, atol=1e-5)


def test_gather_pages_is_the_page_table(rng):
    q, kp, vp, table = _shuffled(rng)
    lens = np.array([20, 64, 3], np.int32)
    k = gather_pages(kp, table, lens)
    for b, t in itertools.product(range(B), range(table.shape[1] * PAGE)):
        want = kp[table[b, t // PAGE], t % PAGE] if t < lens[b] else 0
        np.testing.assert_array_equal(k[b, t], want)


def test_unused_block_table_entries_are_not_read(rng):
    q, kp, vp, table = _shuffled(rng)
    lens = np.array([17, 1, 0], np.int32)
    junk = table.copy()
    junk[0, 2:] = -7
    junk[1, 1:] = 10**6
    junk[2, :] = -1
    np.testing.assert_array_equal(_call(q, kp, vp, junk, lens), _call(q, kp, vp, table, lens))


@pytest.mark.parametrize(
    "mutate, exc, words",
    [
        (lambda a: {**a, "k": a["k"][0]}, ValueError, "k_pages must have shape"),
        (lambda a: {**a, "v": a["v"][:5]}, ValueError, "same shape"),
        (lambda a: {**a, "k": a["k"][:, :12], "v": a["v"][:, :12]}, ValueError, "page_size"),
        (lambda a: {**a, "k": a["k"].astype(np.float32)}, TypeError, "k_pages dtype"),
        (lambda a: {**a, "bt": a["bt"][0]}, ValueError, "block_table must have shape"),
        (lambda a: {**a, "bt": a["bt"][:2]}, ValueError, "block_table must have shape"),
        (lambda a: {**a, "bt": a["bt"].astype(np.float32)}, TypeError, "block_table must be an integer"),
        (lambda a: {**a, "bt": None}, TypeError, "block_table must be"),
        (lambda a: {**a, "lens": None}, TypeError, "cache_seqlens must be"),
        (lambda a: {**a, "lens": a["lens"][:2]}, ValueError, "cache_seqlens must have shape"),
        (lambda a: {**a, "lens": a["lens"] + 1000}, ValueError, r"cache_seqlens values must be in \[0, 64\]"),
        (lambda a: {**a, "lens": a["lens"] - 100}, ValueError, "request 0"),
        (lambda a: {**a, "bt": a["bt"] + 100}, ValueError, r"block_table\[0, 0\] = \d+ is outside the pool"),
        (lambda a: {**a, "bt": a["bt"].tolist()}, TypeError, "block_table must be the same array type"),
        (lambda a: {**a, "q": a["q"][:, :3]}, ValueError, "multiple of num_kv_heads"),
    ],
)
def test_bad_arguments(rng, mutate, exc, words):
    q, kp, vp, table = _shuffled(rng)
    a = mutate({"q": q, "k": kp, "v": vp, "bt": table, "lens": np.array([64, 30, 1], np.int32)})
    with pytest.raises(exc, match=words):
        _call(a["q"], a["k"], a["v"], a["bt"], a["lens"])


def test_bad_keywords(rng):
    q, kp, vp, table = _shuffled(rng)
    lens = np.array([5, 6, 7], np.int32)
    with pytest.raises(ValueError, match="kv_layout"):
        _call(q, kp, vp, table, lens, kv_layout="NDH")
    with pytest.raises(ValueError, match="num_splits"):
        _call(q, kp, vp, table, lens, num_splits=0)
    with pytest.raises(ValueError, match="out must not overlap k_pages"):
        _call(q, kp, vp, table, lens, out=kp.reshape(-1)[: q.size].reshape(q.shape))


def test_inputs_not_modified(rng):
    q, kp, vp, table = _shuffled(rng)
    lens = np.array([64, 30, 1], np.int32)
    before = [x.copy() for x in (q, kp, vp, table, lens)]
    _call(q, kp, vp, table, lens)
    for a, b in zip(before, (q, kp, vp, table, lens), strict=True):
        np.testing.assert_array_equal(a, b)


def test_num_splits_do_not_change_the_answer(rng):
    q, kp, vp, table = _shuffled(rng, page=1, pages=300)
    lens = np.array([100, 57, 1], np.int32)
    ref, _ = paged_attention_reference(q, kp, vp, table, lens)
    for s in (1, 2, 7, 64):
        assert_close(_call(q, kp, vp, table, lens, num_splits=s), ref, "fp16")


def test_decode_plan_numpy_path(rng):
    q, kp, vp, table = _shuffled(rng)
    lens = np.array([64, 30, 1], np.int32)
    plan = fdpp.DecodePlan(B, HQ, HKV, D, table.shape[1] * PAGE, dtype="fp16", page_size=PAGE, return_lse=True)
    o, lse = _run_plan(plan, q, kp, vp, table, lens)
    o2, lse2 = _call(q, kp, vp, table, lens, return_lse=True)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(lse, lse2)
    with pytest.raises(TypeError, match="paged DecodePlan"):
        plan.run(q, kp, vp)
    with pytest.raises(ValueError, match="do not match the plan"):
        _run_plan(plan, q[:2], kp, vp, table[:2], lens[:2])
    k = rng.standard_normal((B, 40, HKV, D)).astype(np.float16)
    cplan = fdpp.DecodePlan(B, HQ, HKV, D, 40, dtype="fp16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        short = np.minimum(lens, 40)
        np.testing.assert_array_equal(cplan.run(q, k, k, cache_seqlens=short), fdpp.decode_attention(q, k, k, cache_seqlens=short))
    with pytest.raises(TypeError, match="contiguous DecodePlan"):
        cplan.run(q, k)


def _run_plan(plan, *arrays):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return plan.run(*arrays)
