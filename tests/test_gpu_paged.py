"""fdpp.paged_decode_attention on the GPU against the independent float64 reference (H200).

Pages are shuffled (a random permutation of the pool), lengths are not multiples of the page,
outputs are poisoned (NaN) before every call. The reference gathers the pages through the block
table with plain fancy indexing (fdpp.reference.paged_attention_reference) and never calls an
fdpp kernel.
"""

import dataclasses
import itertools

import numpy as np
import pytest

import fdpp
from fdpp import configs, dispatch
from fdpp.dtypes import DTYPES
from fdpp.reference import assert_close, paged_attention_reference

pytestmark = pytest.mark.gpu


def _cp():
    import cupy

    return cupy


def _rand(shape, dt, rng, scale=1.0):
    x = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(DTYPES[dt].np_dtype)
    return _cp().asarray(x)


def _paged(b, hq, hkv, d, page, lens, dt, layout, rng, spare=3, shared_prefix=0):
    """q, pools and a shuffled block table holding requests of ``lens`` tokens; the first
    ``shared_prefix`` pages of every request are the same pages (a shared prompt)."""
    cp = _cp()
    pages_per = [-(-int(n) // page) for n in lens]
    width = max(1, max(pages_per))
    own = [max(0, p - shared_prefix) for p in pages_per]
    num_pages = shared_prefix + sum(own) + spare
    perm = rng.permutation(num_pages)
    table = np.zeros((b, width), np.int32)
    nxt = shared_prefix
    for i, p in enumerate(pages_per):
        row = [perm[j] for j in range(min(p, shared_prefix))] + [perm[nxt + j] for j in range(own[i])]
        nxt += own[i]
        table[i, :len(row)] = row
        table[i, len(row):] = rng.integers(-5, 2 * num_pages, size=width - len(row))  # never read
    shape = (num_pages, page, hkv, d) if layout == "NHD" else (num_pages, hkv, page, d)
    return (_rand((b, hq, d), dt, rng), _rand(shape, dt, rng), _rand(shape, dt, rng),
            cp.asarray(table), cp.asarray(np.asarray(lens, np.int32)))


def _poisoned(b, hq, d, dt):
    return _cp().full((b, hq, d), np.nan, dtype=np.float32).astype(DTYPES[dt].np_dtype)


def _check(out, lse, q, kp, vp, table, lens, layout, dt):
    cp = _cp()
    ref, ref_lse = paged_attention_reference(q, kp, vp, table, lens, kv_layout=layout)
    assert_close(cp.asnumpy(out.astype(cp.float32)), cp.asnumpy(ref), dt)
    lse, ref_lse = cp.asnumpy(lse), cp.asnumpy(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-4, atol=1e-3)


def _call(q, kp, vp, table, lens, layout, dt, **kw):
    out = _poisoned(q.shape[0], q.shape[1], q.shape[2], dt)
    res, lse = fdpp.paged_decode_attention(q, kp, vp, table, lens, kv_layout=layout, return_lse=True, out=out, **kw)
    assert res is out
    return out, lse


GRID = list(itertools.product(["fp16", "bf16", "fp32"], ["NHD", "HND"], [1, 16, 64, 256]))


@pytest.mark.parametrize("dt, layout, page", GRID)
def test_against_reference(dt, layout, page, rng):
    for ratio, (b, lens) in itertools.product([1, 3, 4, 8], [(1, [4097]), (17, None)]):
        if lens is None:
            lens = rng.integers(0, 3000, size=b)
            lens[:4] = [0, 1, 54, 97]
        d = 128 if ratio != 3 else 64
        args = _paged(b, 2 * ratio, 2, d, page, lens, dt, layout, rng)
        out, lse = _call(*args, layout, dt)
        _check(out, lse, *args, layout, dt)


@pytest.mark.parametrize("page", [1, 16])
def test_head_dims_and_split_counts(page, rng):
    for d, splits in itertools.product([64, 96, 256], [1, 3, 64, None]):
        args = _paged(3, 8, 2, d, page, [1000, 33, 517], "fp16", "NHD", rng)
        out, lse = _call(*args, "NHD", "fp16", num_splits=splits)
        _check(out, lse, *args, "NHD", "fp16")


def test_shared_prefix_pages(rng):
    args = _paged(5, 32, 8, 128, 16, [300, 290, 512, 257, 256], "fp16", "NHD", rng, shared_prefix=16)
    table = _cp().asnumpy(args[3])
    assert (table[:, :16] == table[0, :16]).all()
    out, lse = _call(*args, "NHD", "fp16")
    _check(out, lse, *args, "NHD", "fp16")


@pytest.mark.parametrize("page", [1, 16, 64])
def test_bitwise_equal_to_contiguous(page, rng):
    """Same chunks (whole pages) and grid: the paged kernel must equal the contiguous one bit for
    bit, so the page policy changes addressing and nothing else."""
    cp = _cp()
    b, n = 3, 4096
    q, kp, vp, table, lens = _paged(b, 32, 8, 128, page, [n, 4000, 77], "bf16", "NHD", rng)
    from fdpp.reference import gather_pages

    kc, vc = gather_pages(kp, table, lens), gather_pages(vp, table, lens)  # zeros past each length
    for splits in (1, 16):
        cfg = configs.DecodeConfig("bf16", 128, 4, 4, 3, 1, mma=True)  # the same variant for both
        with dispatch.forced_plan(configs.LaunchPlan.split_kv(dataclasses.replace(cfg, page_size=page), splits)):
            o_p, l_p = fdpp.paged_decode_attention(q, kp, vp, table, lens, return_lse=True)
        with dispatch.forced_plan(configs.LaunchPlan.split_kv(cfg, splits)):
            o_c, l_c = fdpp.decode_attention(q, kc, vc, cache_seqlens=lens, return_lse=True)
        assert cp.array_equal(o_p, o_c) and cp.array_equal(l_p, l_c)


def test_large_logits(rng):
    q, kp, vp, table, lens = _paged(2, 32, 8, 128, 16, [4097, 1000], "fp16", "NHD", rng)
    q = q * 60
    out, lse = _call(q, kp, vp, table, lens, "NHD", "fp16", num_splits=16)
    assert float(abs(lse).max()) > 100
    _check(out, lse, q, kp, vp, table, lens, "NHD", "fp16")


def test_bad_pages_and_lengths_give_nan_for_that_request_only(rng):
    cp = _cp()
    q, kp, vp, table, lens = _paged(4, 32, 8, 128, 16, [100, 200, 300, 50], "fp16", "NHD", rng)
    good, good_lse = _call(q, kp, vp, table, lens, "NHD", "fp16")
    bad_table = table.copy()
    bad_table[1, 3] = kp.shape[0]  # one past the pool
    bad_table[2, 0] = -1
    bad_lens = lens.copy()
    bad_lens[3] = table.shape[1] * 16 + 1  # beyond what the row addresses
    for splits in (1, 8):
        out, lse = _call(q, kp, vp, bad_table, bad_lens, "NHD", "fp16", num_splits=splits)
        o, lh = cp.asnumpy(out.astype(cp.float32)), cp.asnumpy(lse)
        assert np.isnan(o[1:]).all() and np.isnan(lh[1:]).all()
        ref = fdpp.paged_decode_attention(q[:1], kp, vp, table[:1], lens[:1], num_splits=splits)
        np.testing.assert_array_equal(o[0], cp.asnumpy(ref.astype(cp.float32))[0])
    neg = lens.copy()
    neg[0] = -3
    out, _ = _call(q, kp, vp, table, neg, "NHD", "fp16")
    assert np.isnan(cp.asnumpy(out[0].astype(cp.float32))).all()
    assert not np.isnan(cp.asnumpy(out[1:].astype(cp.float32))).any()
    assert cp.array_equal(out[1:], good[1:])


def test_checking_mode_raises_naming_the_request(rng):
    q, kp, vp, table, lens = _paged(3, 8, 2, 128, 16, [100, 200, 30], "fp16", "NHD", rng)
    bad = table.copy()
    bad[2, 1] = 10_000
    fdpp.set_checks(True)
    try:
        with pytest.raises(ValueError, match=r"block_table\[2, 1\] = 10000"):
            fdpp.paged_decode_attention(q, kp, vp, bad, lens)
        big = lens.copy()
        big[1] = 10_000
        with pytest.raises(ValueError, match="request 1"):
            fdpp.paged_decode_attention(q, kp, vp, table, big)
    finally:
        fdpp.set_checks(False)


def test_numpy_cupy_torch_same_result(rng):
    torch = pytest.importorskip("torch")
    cp = _cp()
    args = _paged(3, 32, 8, 128, 16, [1000, 3, 517], "fp16", "NHD", rng)
    o_cp = fdpp.paged_decode_attention(*args)
    o_np = fdpp.paged_decode_attention(*(cp.asnumpy(x) for x in args))
    o_t = fdpp.paged_decode_attention(*(torch.from_dlpack(x) for x in args))
    assert isinstance(o_np, np.ndarray) and isinstance(o_t, torch.Tensor) and o_t.is_cuda
    np.testing.assert_array_equal(cp.asnumpy(o_cp), o_np)
    np.testing.assert_array_equal(o_t.cpu().numpy(), o_np)


def test_torch_combined_kv_tensor_views(rng):
    """FlashInfer-style [num_pages, 2, page, Hkv, D]: K and V passed as strided views."""
    torch = pytest.importorskip("torch")
    import cupy as cp

    pool = torch.randn(40, 2, 16, 8, 128, device="cuda", dtype=torch.float16)
    table = torch.tensor(rng.permutation(40)[:30].reshape(3, 10), device="cuda", dtype=torch.int32)
    lens = torch.tensor([160, 1, 77], device="cuda", dtype=torch.int32)
    q = torch.randn(3, 32, 128, device="cuda", dtype=torch.float16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = fdpp.paged_decode_attention(q, pool[:, 0], pool[:, 1], table, lens)
    s.synchronize()
    ref, _ = paged_attention_reference(*(cp.from_dlpack(x.contiguous()) for x in (q, pool[:, 0], pool[:, 1], table, lens)))
    assert_close(out.float().cpu().numpy(), cp.asnumpy(ref), "fp16")


def test_cupy_graph_capture_sees_new_tables(rng):
    cp = _cp()
    q, kp, vp, table, lens = _paged(2, 32, 8, 128, 16, [4000, 2000], "fp16", "NHD", rng, spare=300)
    fdpp.paged_decode_attention(q, kp, vp, table, lens)  # compile, size the workspace
    out = _poisoned(2, 32, 128, "fp16")
    s = cp.cuda.Stream(non_blocking=True)
    s.wait_event(cp.cuda.get_current_stream().record())  # the work queued before (inputs) first
    with s:
        s.begin_capture()
        fdpp.paged_decode_attention(q, kp, vp, table, lens, out=out)
        g = s.end_capture()
        new = cp.asarray(rng.permutation(kp.shape[0])[:table.size].reshape(table.shape).astype(np.int32))
        table[...] = new  # same buffer, new contents: the graph must read them
        lens[...] = cp.asarray([1234, 3999], cp.int32)
        g.launch()
    s.synchronize()
    ref = fdpp.paged_decode_attention(q, kp, vp, table, lens)
    assert cp.array_equal(out, ref)


def test_torch_graph_capture(rng):
    torch = pytest.importorskip("torch")
    args = [torch.from_dlpack(x) for x in _paged(4, 32, 8, 128, 16, [4096, 1, 100, 3000], "bf16", "HND", rng)]
    eager = fdpp.paged_decode_attention(*args, kv_layout="HND")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fdpp.paged_decode_attention(*args, kv_layout="HND")
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = fdpp.paged_decode_attention(*args, kv_layout="HND")
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_contiguous_bad_lengths_are_nan(rng):
    """The contiguous path shares the policy: a device length outside [0, N_max] is NaN."""
    cp = _cp()
    q = _rand((3, 8, 128), "fp16", rng)
    k = _rand((3, 100, 2, 128), "fp16", rng)
    lens = cp.asarray([100, 101, -1], cp.int32)
    out = fdpp.decode_attention(q, k, k, cache_seqlens=lens)
    o = cp.asnumpy(out.astype(cp.float32))
    assert not np.isnan(o[0]).any() and np.isnan(o[1:]).all()
