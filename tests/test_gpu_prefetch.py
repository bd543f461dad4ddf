"""L2 prefetch before the PDL wait on the GPU (run on the H200): the same bits with the prefetch off,
partial and whole-chunk, on every cache and merge path; and chains of PDL calls whose K/V cache,
block table, quantisation arrays or GEMM weights an ordinary kernel writes just before each call
(the prefetch runs before griddepcontrol.wait and may see stale memory, the loads after it must
not), eager and in a CUDA graph. Outputs (and written inputs) are poisoned before each run and
compared with a float64 reference that never calls an fdpp kernel."""

import functools
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from int4_util import dequant, random_int4

import fdpp
from fdpp import dispatch, gemm, launch, plan
from fdpp.configs import DecodeProblem, LaunchPlan, default_kernel
from fdpp.dtypes import KV_FORMATS
from fdpp.reference import assert_close, attention_reference, dequant_fp8_cache, gather_pages

pytestmark = pytest.mark.gpu

HUGE, SMALL = 1 << 40, 1 << 18  # budgets: attention prefetches whole chunks / nothing (the call is larger)
QUANT = ("k_descale", "v_descale", "k_zero", "v_zero")
WRITTEN = ("k", "v", "table", *QUANT)  # what the chains write right before each call
PAGES = {"paged16": 16, "paged1": 1, "int4_paged16": 16}


def _cp():
    import cupy

    return cupy


def _clear():
    plan.clear()
    gemm._records.clear()


@pytest.fixture
def state(monkeypatch):
    """state(pdl, budget) sets launch.PDL (all families / none) and launch.L2_PREFETCH_BYTES, and
    clears both record caches (keyed on both; the tests read the records a call built)."""
    def set_(pdl: bool, budget: int):
        monkeypatch.setattr(launch, "PDL", frozenset(launch.PDL_FAMILIES if pdl else ()))
        monkeypatch.setattr(launch, "L2_PREFETCH_BYTES", int(budget))
        _clear()
    _clear()
    yield set_
    _clear()


def _need_pdl():
    if not (launch.LAUNCHER != "cupy" and launch.HAVE_BINDINGS and launch.pdl_supported(0)):
        pytest.skip("no PDL launches here (sm_90, cuda.bindings, a by-address launcher): nothing prefetches")


@functools.cache
def _copy_kernel():
    """An ordinary (non-PDL) CuPy kernel: y = x elementwise, any dtype."""
    return _cp().ElementwiseKernel("T x", "T y", "y = x", "fdpp_test_prefetch_copy")


def _replay(chain, poison, check, times):
    """Capture chain() on a non-blocking stream (after the work queued before), then replay it
    ``times`` times with poison(r) before and check() after each replay."""
    cp = _cp()
    stream = cp.cuda.Stream(non_blocking=True)
    stream.wait_event(cp.cuda.get_current_stream().record())
    with stream:
        stream.begin_capture()
        chain()
        graph = stream.end_capture()
        for r in range(times):
            poison(r)
            graph.launch(stream)
            check()


def _table(rng, lens, page, spare=3):
    """Shuffled pages; entries past a request's pages are garbage in [-5, 2 x pool) (never read by
    the attention; skipped, or harmlessly prefetched, by the hint)."""
    per = -(-np.asarray(lens) // page)
    pool = int(per.sum()) + spare
    perm, nxt = rng.permutation(pool), 0
    table = rng.integers(-5, 2 * pool, size=(len(lens), int(per.max()))).astype(np.int32)
    for i, p in enumerate(per):
        table[i, :p], nxt = perm[nxt:nxt + p], nxt + p
    return table, pool


def _case(cache, mode, rng, b=3, hq=8, hkv=2, d=128, n=3000):
    """One call: device arrays ``dev``, keyword arguments ``kw``, the forced ``plan`` (None:
    decode_attention_nosplit), the float64 ``ref``, an ``out``. Lengths 3000 / 0 / 1777."""
    cp = _cp()
    lens = np.array([n, 0, 1777], np.int32)
    page, layout = PAGES.get(cache, 0), "HND" if cache == "hnd" else "NHD"
    kv = "int4_g64" if cache.startswith("int4") else "fp8_e4m3" if cache == "fp8" else ""
    table, pool = _table(rng, lens, page) if page else (None, b)
    n_max = table.shape[1] * page if page else n
    shape = (pool, page or n, hkv, d) if layout == "NHD" else (pool, hkv, page or n, d)

    def dense(x):  # [B, N_max, ...] (paged: through the table; zeros past each length)
        return gather_pages(x, table, lens, layout) if page else x

    host = {"q": rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16), "lens": lens}
    if page:
        host["table"] = table
    if kv.startswith("int4"):
        kq, vq = random_int4(shape, 64, rng, outliers=True), random_int4(shape, 64, rng)
        host.update(k=kq[0], v=vq[0], k_descale=kq[1], v_descale=vq[1], k_zero=kq[2], v_zero=vq[2])
        kf, vf = (dequant(*(dense(x) for x in t)) for t in (kq, vq))
    elif kv:
        f = KV_FORMATS[kv]
        kc, vc = (np.clip(rng.standard_normal(shape, dtype=np.float32) * f.max / 4, -f.max, f.max)
                  .astype(f.np_dtype).view(np.uint8) for _ in range(2))
        kd, vd = (rng.uniform(0.0005, 0.01, size=(b, hkv)).astype(np.float32) for _ in range(2))  # (b, head)
        host.update(k=kc, v=vc, k_descale=kd, v_descale=vd)
        kf, vf = (dequant_fp8_cache(dense(c), kv, s, layout) for c, s in ((kc, kd), (vc, vd)))
    else:
        host["k"], host["v"] = (rng.standard_normal(shape, dtype=np.float32).astype(np.float16) for _ in "kv")
        kf, vf = dense(host["k"]), dense(host["v"])
    kw = {"kv_layout": layout, **({"kv_dtype": "int4" if kv.startswith("int4") else kv} if kv else {})}
    if mode.startswith("umax_"):
        kw.update(softmax_mode="unified_max",
                  unified_max=fdpp.calibrate_unified_max(host["q"], kf, kv_layout=layout, cache_seqlens=lens))
    cfg = default_kernel(DecodeProblem(b, hq, hkv, d, n_max, "fp16", kv, page_size=page))
    plans = {"combine": LaunchPlan.split_kv(cfg, 7, source="test"), "nosplit": None,
             "single": LaunchPlan.split_kv(cfg, 1, source="test"),
             "fused": LaunchPlan.split_kv(cfg, 40, source="test", fused=True),
             "cluster": LaunchPlan.cluster_merge(cfg, 16, source="test")}
    ref = np.asarray(attention_reference(host["q"], kf, vf, lens, kv_layout=layout)[0])
    return SimpleNamespace(dev={k: cp.asarray(x) for k, x in host.items()}, kw=kw, ref=ref,
                           plan=plans[mode.removeprefix("umax_")],
                           out=cp.full((b, hq, d), np.nan, dtype=cp.float16))


def _attend(c, out):
    a = c.dev
    kw = dict(c.kw, out=out, **{nm: a[nm] for nm in QUANT if nm in a})
    if c.plan is None:
        return fdpp.decode_attention_nosplit(a["q"], a["k"], a["v"], cache_seqlens=a["lens"], **kw)
    with dispatch.forced_plan(c.plan):
        if "table" in a:
            return fdpp.paged_decode_attention(a["q"], a["k"], a["v"], a["table"], a["lens"], **kw)
        return fdpp.decode_attention(a["q"], a["k"], a["v"], cache_seqlens=a["lens"], **kw)


def _check(c):
    assert_close(_cp().asnumpy(c.out).astype(np.float32), c.ref, "fp16")


CACHES = ["nhd", "hnd", "paged16", "paged1", "fp8", "int4", "int4_paged16"]
CASES = [*itertools.product(CACHES, ["combine", "fused", "cluster"]), ("nhd", "single"),
         ("paged16", "single"), ("nhd", "nosplit"), ("nhd", "umax_combine"), ("nhd", "umax_cluster")]


@pytest.mark.parametrize("cache, mode", CASES)
def test_prefetch_gives_the_same_bits(state, cache, mode, rng):
    """Plain launches (no prefetch whatever the budget), PDL without prefetch, a few rows, whole
    chunks: the same bits, each close to the reference."""
    _need_pdl()
    c, bits = _case(cache, mode, rng), []
    for pdl, budget in ((False, HUGE), (True, 0), (True, SMALL), (True, HUGE)):
        state(pdl, budget)
        c.out[...] = np.nan
        assert _attend(c, c.out) is c.out
        (rec,) = plan._records.values()
        assert rec.prob.kv_bytes() <= launch.PDL_ATTENTION_MAX_BYTES  # PDL not refused for size
        assert all(k.pdl is pdl for k in rec.calls)
        pf, chunk = int(rec.params["l2_prefetch"][0]), int(rec.params["chunk"][0])
        # plain launches, a zero budget and a budget below the call's K/V (SMALL) prefetch nothing;
        # HUGE: every CTA its whole chunk (launch.attention_prefetch)
        assert pf == (chunk if pdl and budget == HUGE else 0), (pf, chunk)
        assert budget != SMALL or rec.prob.kv_bytes() > SMALL
        bits.append(_cp().asnumpy(c.out).view(np.uint16))
        _check(c)
    for got in bits[1:]:
        np.testing.assert_array_equal(got, bits[0])


def _poison(x, src, r):
    if x.dtype == np.int32:  # block table: invalid pages, or valid pages of other tokens
        x[...] = -1 if r % 2 == 0 else _cp().roll(src, 1, axis=1)
    else:
        x[...] = 0xFF if x.dtype == np.uint8 else np.nan  # codes: FP8 e4m3 NaN, INT4 15s


@pytest.mark.parametrize("capture", [False, True])
@pytest.mark.parametrize("cache", ["nhd", "paged16", "paged1", "fp8", "int4_paged16"])
def test_prefetch_sees_kv_written_just_before(state, cache, capture, rng):
    """Before each PDL call an ordinary kernel copies its K, V (block table, quantisation arrays)
    from a source into poisoned buffers; every call prefetches its whole chunks first."""
    _need_pdl()
    state(True, HUGE)
    cases = [_case(cache, m, rng) for m in ("combine", "fused", "cluster", "combine")]  # last: a record hit
    srcs = [{nm: a.copy() for nm, a in c.dev.items() if nm in WRITTEN} for c in cases]

    def poison(r):
        for c, src in zip(cases, srcs, strict=True):
            c.out[...] = np.nan
            for nm, s in src.items():
                _poison(c.dev[nm], s, r)

    def chain():
        for c, src in zip(cases, srcs, strict=True):
            for nm, s in src.items():
                _copy_kernel()(s, c.dev[nm])
            _attend(c, c.out)

    def check():
        _cp().cuda.get_current_stream().synchronize()
        for c in cases:
            _check(c)

    for r in range(1 if capture else 4):  # the first run compiles, sizes the workspace and tickets
        poison(r)
        chain()
        check()
    assert len(plan._records) == 3 and all(
        int(rec.params["l2_prefetch"][0]) == int(rec.params["chunk"][0]) > 0 and all(k.pdl for k in rec.calls)
        for rec in plan._records.values())
    if capture:
        _replay(chain, poison, check, 16)


@pytest.mark.parametrize("grid", [None, 37])
@pytest.mark.parametrize("impl", ["flat", "tma", "gemv"])
def test_gemm_prefetch_same_bits_and_fresh_weights(state, impl, grid, rng):
    """y_{i+1} = y_i W_i^T, each W_i written by an ordinary kernel (poisoned first) just before its
    PDL GEMM, whose CTAs prefetch W before waiting: prefetch 0 and whole shares give the same bits,
    eager and replayed in a graph. N and K not multiples of the tiles; a forced odd grid."""
    _need_pdl()
    cp = _cp()
    space = {"flat": gemm.flat_space, "tma": gemm.tma_space, "gemv": gemm.gemv_space}[impl]
    forced = gemm.GemmPlan(impl, next(iter(space("fp16"))), grid, "test")
    dims, m = (1024, 1000, 1528, 776, 1000), 4
    srcs = [cp.asarray((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16))
            for k, n in itertools.pairwise(dims)]
    x0 = cp.asarray(rng.standard_normal((m, dims[0])).astype(np.float16))
    refs, r = [], cp.asnumpy(x0).astype(np.float64)
    for s in srcs:
        r = (r @ cp.asnumpy(s).astype(np.float64).T).astype(np.float16).astype(np.float64)
        refs.append(r)
    ws = [cp.full_like(s, np.nan) for s in srcs]
    ys = [cp.full((m, s.shape[0]), np.nan, dtype=cp.float16) for s in srcs]

    def poison(_r=0):
        for a in (*ws, *ys):
            a[...] = np.nan

    def chain():
        x = x0
        with gemm.forced_plan(forced):
            for s, w, y in zip(srcs, ws, ys, strict=True):
                _copy_kernel()(s, w)
                x = gemm.flat_gemm(x, w, out=y)

    def check():
        cp.cuda.get_current_stream().synchronize()
        for y, ref in zip(ys, refs, strict=True):
            np.testing.assert_allclose(cp.asnumpy(y).astype(np.float64), ref, rtol=2e-2, atol=2e-2)
        return [cp.asnumpy(y).view(np.uint16) for y in ys]

    bits = {}
    for budget in (0, HUGE):
        state(True, budget)
        poison()
        chain()
        bits[budget] = check()
        recs = list(gemm._records.values())
        assert len(recs) == len(srcs) and all(rec.call.pdl for rec in recs)
        for rec in recs:  # HUGE: every w iteration of the CTA
            a = rec.args[0]
            want = -(-int(a["total_iters"]) // int(a["grid"])) if budget else 0
            assert int(a["prefetch"]) == int(rec.tail[-2]) == want and (want > 0) == (budget > 0)

    def same_bits():
        for b0, b1 in zip(bits[0], check(), strict=True):
            np.testing.assert_array_equal(b1, b0)

    same_bits()
    _replay(chain, poison, same_bits, 12)
