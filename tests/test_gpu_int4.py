"""INT4 K/V caches on the GPU against the float64 reference of the dequantised cache.

The reference (tests/int4_util.py) unpacks the nibbles and dequantises ``float16(n * scale +
zero)`` itself and runs plain float64 attention, never an fdpp kernel, so the tolerance (q's
dtype, ``fdpp.reference.assert_close``) measures kernel error, not quantisation error. Fresh
random codes, scales and zeros per test (K with large-magnitude groups), outputs poisoned (NaN)
before each call, pages shuffled, lengths not multiples of a chunk or page; batch 17, GQA 1 / 3 /
4 / 8, groups 32 / 64 / 128, D 64 / 128, NHD / HND, fp16 and bf16 q, CuPy and torch, lse, a
DecodePlan under CUDA-graph replay, the cache's own int4 pools.
"""

import itertools

import numpy as np
import pytest
from gpu_util import assert_graph_replay_matches
from gpu_util import poisoned as _poisoned
from int4_util import dequant, random_int4, reference
from paged_util import fill_sequences, ragged_table

import fdpp
from fdpp.dtypes import DTYPES
from fdpp.reference import assert_close

pytestmark = pytest.mark.gpu


def _cp():
    import cupy

    return cupy


def _check(out, lse, ref, ref_lse, dt):
    cp = _cp()
    assert_close(cp.asnumpy(out.astype(cp.float32)), ref, dt)
    if lse is not None:
        lse = cp.asnumpy(lse)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        fin = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-4, atol=1e-3)


def _dev(*xs):
    return [_cp().asarray(x) for x in xs]


def _kw(ks, vs, kz, vz):
    return dict(kv_dtype="int4", k_descale=ks, v_descale=vs, k_zero=kz, v_zero=vz)


GRID = [(dt, layout, d, g) for dt, layout, (d, g) in itertools.product(
    ["fp16", "bf16"], ["NHD", "HND"], [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128)])]


@pytest.mark.parametrize("dt, layout, d, g", GRID)
def test_contiguous_against_reference(dt, layout, d, g, rng):
    cp = _cp()
    b, hq, hkv, n = 3, 8, 2, 1000
    q = rng.standard_normal((b, hq, d), dtype=np.float32).astype(DTYPES[dt].np_dtype)
    shape = (b, n, hkv, d) if layout == "NHD" else (b, hkv, n, d)
    (kc, ks, kz), (vc, vs, vz) = random_int4(shape, g, rng, outliers=True), random_int4(shape, g, rng)
    lens = np.array([1000, 333, 0], np.int32)
    ref, ref_lse = reference(q, dequant(kc, ks, kz), dequant(vc, vs, vz), lens, layout=layout)
    dq, dk, dv, dks, dvs, dkz, dvz = _dev(q, kc, vc, ks, vs, kz, vz)
    for splits in (None, 1, 7):
        out = _poisoned(b, hq, d, dt)
        res, lse = fdpp.decode_attention(dq, dk, dv, cache_seqlens=cp.asarray(lens), kv_layout=layout,
                                         num_splits=splits, return_lse=True, out=out, **_kw(dks, dvs, dkz, dvz))
        assert res is out
        _check(out, lse, ref, ref_lse, dt)
    np.testing.assert_array_equal(cp.asnumpy(dk), kc)  # inputs untouched
    np.testing.assert_array_equal(cp.asnumpy(dks), ks)


@pytest.mark.parametrize("hq, hkv, g, layout", [(8, 8, 64, "NHD"), (9, 3, 128, "NHD"), (12, 3, 32, "HND"),
                                                 (32, 4, 128, "HND"), (64, 8, 64, "NHD"), (3, 1, 128, "NHD")])
def test_gqa_and_batch_17(hq, hkv, g, layout, rng):
    """GQA 1 / 3 / 4 / 8; an odd head count with one group per row (g = D: 2-byte parameter rows at
    odd offsets, the loader's aligned-word path)."""
    cp = _cp()
    b, d = 17, 128
    lens = rng.integers(0, 777, size=b).astype(np.int32)
    lens[0], lens[1] = 777, 1
    n = 777
    q = rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16)
    shape = (b, n, hkv, d) if layout == "NHD" else (b, hkv, n, d)
    (kc, ks, kz), (vc, vs, vz) = random_int4(shape, g, rng, outliers=True), random_int4(shape, g, rng)
    ref, ref_lse = reference(q, dequant(kc, ks, kz), dequant(vc, vs, vz), lens, layout=layout)
    dq, dk, dv, dks, dvs, dkz, dvz = _dev(q, kc, vc, ks, vs, kz, vz)
    out = _poisoned(b, hq, d, "fp16")
    _, lse = fdpp.decode_attention(dq, dk, dv, cache_seqlens=cp.asarray(lens), kv_layout=layout, out=out,
                                   return_lse=True, **_kw(dks, dvs, dkz, dvz))
    _check(out, lse, ref, ref_lse, "fp16")


@pytest.mark.parametrize("g, d", [(64, 128), (128, 128), (64, 64), (32, 128)])
def test_v_scales_outside_the_factored_window(g, d, rng):
    """Scales far from the usual range, in some 16-token blocks of a request and not others (request
    2 all large): V scales >= 1.5, fp16-subnormal, zero and exactly 1.5; K scales from 1e-6 to 40.
    (Run P1's factored kernel, which folded V's scales into P only inside [2^-14, 1.5), needed
    this; it guards any later kernel that treats scales by range.)"""
    cp = _cp()
    b, hq, hkv, n = 4, 32, 8, 1000
    q = rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16)
    (kc, ks, kz), (vc, vs, vz) = random_int4((b, n, hkv, d), g, rng, True), random_int4((b, n, hkv, d), g, rng)
    vs = vs.astype(np.float32)
    vs[0, 100:140] *= 12.0          # >= 1.5 in part of those tokens' groups
    vs[0, 500:503] = 3e-7           # fp16 subnormal
    vs[1, 37] = 0.0                 # one zero scale
    vs[1, 600:700, :, 0] = 1.5      # exactly at the edge, one group only
    vs[2] = rng.uniform(1.5, 6.0, size=vs[2].shape)
    vs = vs.astype(np.float16)
    ks = ks.astype(np.float32)
    ks[3, :300] *= 1e-5
    ks[3, 300:600] *= 40.0
    ks = ks.astype(np.float16)
    lens = np.array([1000, 777, 1000, 999], np.int32)
    ref, ref_lse = reference(q, dequant(kc, ks, kz), dequant(vc, vs, vz), lens)
    dq, dk, dv, dks, dvs, dkz, dvz = _dev(q, kc, vc, ks, vs, kz, vz)
    for splits in (None, 1, 5):
        out = _poisoned(b, hq, d, "fp16")
        _, lse = fdpp.decode_attention(dq, dk, dv, cache_seqlens=cp.asarray(lens), num_splits=splits, out=out,
                                       return_lse=True, **_kw(dks, dvs, dkz, dvz))
        _check(out, lse, ref, ref_lse, "fp16")


def test_v_scale_nan_gives_nan_rows(rng):
    """A NaN V scale makes that (request, KV head)'s output NaN, as the dequantised reference's."""
    cp = _cp()
    b, hq, hkv, d, g, n = 2, 8, 2, 128, 64, 300
    q = rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16)
    (kc, ks, kz), (vc, vs, vz) = random_int4((b, n, hkv, d), g, rng), random_int4((b, n, hkv, d), g, rng)
    vs[1, 123, 1, 0] = np.nan
    out = cp.asnumpy(fdpp.decode_attention(*_dev(q, kc, vc), **_kw(*_dev(ks, vs, kz, vz))).astype(np.float32))
    ref, _ = reference(q, dequant(kc, ks, kz), dequant(vc, vs, vz), [n, n])
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    assert np.isnan(out[1, 4:, :64]).all() and np.isfinite(out[0]).all()
    assert_close(out[0], ref[0], "fp16")


def _paged_case(rng, b, hq, hkv, d, g, page, layout, max_len=700):
    lens = rng.integers(0, max_len, size=b).astype(np.int32)
    lens[0], lens[1] = max_len, 1
    table, num_pages = ragged_table(rng, lens, page)
    shape = (num_pages, page, hkv, d) if layout == "NHD" else (num_pages, hkv, page, d)
    kq, vq = random_int4(shape, g, rng, outliers=True), random_int4(shape, g, rng)

    def contig(pool):  # [B, width * page, Hkv, X] by hand
        p = pool if layout == "NHD" else pool.transpose(0, 2, 1, 3)
        return np.stack([np.concatenate([p[table[i, j]] for j in range(table.shape[1])]) for i in range(b)])

    k = dequant(*(contig(x) for x in kq))
    v = dequant(*(contig(x) for x in vq))
    return lens, table, kq, vq, k, v


@pytest.mark.parametrize("page, layout, g, dt", [(1, "NHD", 64, "fp16"), (16, "NHD", 32, "bf16"),
                                                  (16, "HND", 128, "fp16"), (64, "HND", 64, "bf16"),
                                                  (64, "NHD", 128, "fp16"), (1, "HND", 32, "fp16")])
def test_paged_against_reference(page, layout, g, dt, rng):
    cp = _cp()
    b, hq, hkv, d = 17, 32, 8, 128
    lens, table, kq, vq, k, v = _paged_case(rng, b, hq, hkv, d, g, page, layout)
    q = rng.standard_normal((b, hq, d), dtype=np.float32).astype(DTYPES[dt].np_dtype)
    ref, ref_lse = reference(q, k, v, lens)
    (kc, ks, kz), (vc, vs, vz) = kq, vq
    dq, dk, dv, dks, dvs, dkz, dvz = _dev(q, kc, vc, ks, vs, kz, vz)
    for splits in (None, 3):
        out = _poisoned(b, hq, d, dt)
        _, lse = fdpp.paged_decode_attention(dq, dk, dv, cp.asarray(table), cp.asarray(lens), kv_layout=layout,
                                             num_splits=splits, out=out, return_lse=True,
                                             **_kw(dks, dvs, dkz, dvz))
        _check(out, lse, ref, ref_lse, dt)


def test_paged_d64_and_strided_halves(rng):
    """D = 64, page 16, K and V as the halves of one [pages, 2, page, Hkv, D // 2] pool (strides)."""
    cp = _cp()
    b, hq, hkv, d, g, page = 5, 8, 2, 64, 32, 16
    lens, table, kq, vq, k, v = _paged_case(rng, b, hq, hkv, d, g, page, "NHD", 300)
    both = cp.asarray(np.stack([kq[0], vq[0]], axis=1))
    q = rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16)
    ref, _ = reference(q, k, v, lens)
    out = _poisoned(b, hq, d, "fp16")
    fdpp.paged_decode_attention(cp.asarray(q), both[:, 0], both[:, 1], cp.asarray(table), cp.asarray(lens),
                                out=out, **_kw(*_dev(kq[1], vq[1], kq[2], vq[2])))
    _check(out, None, ref, None, "fp16")


def test_torch_contiguous_and_paged(rng):
    torch = pytest.importorskip("torch")
    b, hq, hkv, d, g, n = 2, 32, 8, 128, 64, 513
    q = rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16)
    (kc, ks, kz), (vc, vs, vz) = random_int4((b, n, hkv, d), g, rng, True), random_int4((b, n, hkv, d), g, rng)
    lens = np.array([513, 100], np.int32)
    t = [torch.from_numpy(x).cuda() for x in (q, kc, vc, ks, vs, kz, vz)]
    out, lse = fdpp.decode_attention(t[0], t[1], t[2], cache_seqlens=torch.from_numpy(lens).cuda(), return_lse=True,
                                     **_kw(*t[3:]))
    ref, ref_lse = reference(q, dequant(kc, ks, kz), dequant(vc, vs, vz), lens)
    assert_close(out.float().cpu().numpy(), ref, "fp16")
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, rtol=1e-4, atol=1e-3)
    lens, table, kq, vq, k, v = _paged_case(rng, 3, 8, 2, 64, 64, 16, "HND", 200)
    qp = rng.standard_normal((3, 8, 64), dtype=np.float32).astype(np.float16)
    tp = [torch.from_numpy(x).cuda() for x in (qp, kq[0], vq[0], table, lens, kq[1], vq[1], kq[2], vq[2])]
    out = fdpp.paged_decode_attention(*tp[:5], kv_layout="HND", **_kw(*tp[5:]))
    assert_close(out.float().cpu().numpy(), reference(qp, k, v, lens)[0], "fp16")


def test_numpy_in_runs_on_the_gpu(rng):
    b, hq, hkv, d, g, n = 2, 8, 2, 128, 32, 300
    q = rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16)
    (kc, ks, kz), (vc, vs, vz) = random_int4((b, n, hkv, d), g, rng), random_int4((b, n, hkv, d), g, rng)
    out = fdpp.decode_attention(q, kc, vc, **_kw(ks, vs, kz, vz))
    assert isinstance(out, np.ndarray)
    assert_close(out.astype(np.float32), reference(q, dequant(kc, ks, kz), dequant(vc, vs, vz), [n, n])[0], "fp16")


def test_decode_plan_and_graph_replay(rng):
    cp = _cp()
    b, hq, hkv, d, g, n = 4, 32, 8, 128, 64, 4096
    q = rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16)
    (kc, ks, kz), (vc, vs, vz) = random_int4((b, n, hkv, d), g, rng, True), random_int4((b, n, hkv, d), g, rng)
    lens = np.array([4096, 100, 4000, 1], np.int32)
    ref, _ = reference(q, dequant(kc, ks, kz), dequant(vc, vs, vz), lens)
    plan = fdpp.DecodePlan(b, hq, hkv, d, n, dtype="fp16", kv_dtype="int4", group_size=g)
    dq, dk, dv, dks, dvs, dkz, dvz = _dev(q, kc, vc, ks, vs, kz, vz)
    dl = cp.asarray(lens)
    out = _poisoned(b, hq, d, "fp16")
    plan.run(dq, dk, dv, cache_seqlens=dl, out=out, k_descale=dks, v_descale=dvs, k_zero=dkz, v_zero=dvz)
    _check(out, None, ref, None, "fp16")
    assert_graph_replay_matches(
        lambda: plan.run(dq, dk, dv, cache_seqlens=dl, out=out, k_descale=dks, v_descale=dvs, k_zero=dkz, v_zero=dvz),
        out, 10)


def test_int4_paged_cache_attention_kwargs(rng):
    cp = _cp()
    from fdpp.reference import gather_pages

    hkv, d, page = 8, 128, 16
    cache = fdpp.PagedKVCache(1, 64, page, hkv, d, dtype="fp16", kv_format="int4", group_size=64, backend="cupy",
                              max_batch=2)
    fill_sequences(cache, (300, 17), rng, cp.asarray)
    q = cp.asarray(rng.standard_normal((2, 32, d)).astype(np.float16))
    kw = cache.attention_kwargs(0)
    out = fdpp.paged_decode_attention(q, cache.k_pages(0), cache.v_pages(0), cache.block_table, cache.seqlens, **kw)
    t, lens = (cp.asnumpy(x) for x in (cache.block_table, cache.seqlens))
    g = {n: gather_pages(cp.asnumpy(x), t, lens) for n, x in kw.items() if n != "kv_dtype"}
    k = dequant(gather_pages(cp.asnumpy(cache.k_pages(0)), t, lens), g["k_descale"], g["k_zero"])
    v = dequant(gather_pages(cp.asnumpy(cache.v_pages(0)), t, lens), g["v_descale"], g["v_zero"])
    assert_close(cp.asnumpy(out.astype(cp.float32)), reference(cp.asnumpy(q), k, v, lens)[0], "fp16")


def test_device_argument_errors(rng):
    cp = _cp()
    b, hq, hkv, d, g, n = 2, 8, 2, 128, 32, 64
    q = cp.zeros((b, hq, d), cp.float16)
    kc = cp.zeros((b, n, hkv, d // 2), cp.uint8)
    s = cp.ones((b, n, hkv, d // g), cp.float16)
    with pytest.raises(ValueError, match="k_zero must be contiguous in its last axis"):
        fdpp.decode_attention(q, kc, kc, **_kw(s, s, cp.ones((b, n, hkv, 2 * d // g), cp.float16)[..., ::2], s))
    with pytest.raises(ValueError, match="rows must be 4-byte aligned"):
        big = cp.ones((b, n, hkv, d // g + 1), cp.float16)
        fdpp.decode_attention(q, kc, kc, **_kw(big[..., 1:], s, s, s))
    with pytest.raises(TypeError, match="same array type"):
        fdpp.decode_attention(q, kc, kc, **_kw(cp.asnumpy(s), s, s, s))
