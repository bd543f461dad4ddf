"""The fused single launch, the cluster merge, the sliced combine and batch-invariant plans on the
GPU (run on the H200).

Every plan is forced (``fdpp.dispatch.forced_plan``) so each merge path runs whatever the tables
say; outputs are poisoned (NaN) before each call and compared with the float64 reference, which
never calls an fdpp kernel.
"""

import itertools
from dataclasses import replace

import numpy as np
import pytest

import fdpp
from fdpp import dispatch, plan, workspace
from fdpp.configs import CombineConfig, DecodeProblem, LaunchPlan, default_kernel
from fdpp.dtypes import DTYPES
from fdpp.reference import assert_close, attention_reference, paged_attention_reference

pytestmark = pytest.mark.gpu


def _cp():
    import cupy

    return cupy


def _rand(shape, dt, scale=1.0):
    cp = _cp()
    x = cp.random.standard_normal(shape, dtype=cp.float32) * scale
    if dt == "bf16":
        return cp.asarray(cp.asnumpy(x).astype(DTYPES["bf16"].np_dtype))
    return x.astype(DTYPES[dt].np_dtype)


def _plan(prob, splits, mode, bucket=0, slices=1):
    cfg = default_kernel(prob, split=True)
    if mode == "cluster":  # splits: the cluster size
        return LaunchPlan.cluster_merge(cfg, splits, source="test")
    if mode == "fused":
        return LaunchPlan.split_kv(cfg, splits, source="test", fused=True, bucket=bucket)
    return LaunchPlan.split_kv(cfg, splits, CombineConfig(prob.dtype, prob.head_dim, 4, slices), source="test")


def _lens(cp, b, n, seed):
    r = np.random.default_rng(seed)
    lens = r.integers(0, n + 1, size=b).astype(np.int32)
    lens[0] = n  # one full request, one empty, one not a multiple of anything
    if b > 1:
        lens[1] = 0
    if b > 2:
        lens[2] = max(1, n - 37)
    return cp.asarray(lens)


def _check(out, lse, ref, ref_lse, dt):
    cp = _cp()
    assert_close(cp.asnumpy(out.astype(cp.float32)), cp.asnumpy(ref), dt)
    lse, ref_lse = cp.asnumpy(lse), cp.asnumpy(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-4, atol=1e-3)


MODES = [("fused", 0, 1), ("fused", 4, 1), ("combine", 0, 1), ("combine", 0, 4), ("combine", 0, 8)]
CASES = list(itertools.product(["fp16", "bf16", "fp32"], [(32, 8), (8, 1), (4, 4)], [64, 128, 256],
                               [2, 7, 40, 132]))


@pytest.mark.parametrize("dt, heads, d, splits", CASES)
def test_merge_paths_match_reference(dt, heads, d, splits):
    cp = _cp()
    hq, hkv = heads
    b, n = 3, 5000 if splits > 16 else 1000
    q, k, v = _rand((b, hq, d), dt), _rand((b, n, hkv, d), dt), _rand((b, n, hkv, d), dt)
    lens = _lens(cp, b, n, splits + d)
    ref, ref_lse = attention_reference(q, k, v, lens)
    prob = DecodeProblem(b, hq, hkv, d, n, dt)
    for mode, bucket, slices in MODES:
        if d % (4 * slices):
            continue
        out = cp.full((b, hq, d), np.nan, dtype=np.float32).astype(q.dtype)
        with dispatch.forced_plan(_plan(prob, splits, mode, bucket, slices)):
            o, lse = fdpp.decode_attention(q, k, v, cache_seqlens=lens, return_lse=True, out=out)
        _check(o, lse, ref, ref_lse, dt)


@pytest.mark.parametrize("page, mode", list(itertools.product([1, 16], ["fused", "combine"])))
def test_paged_fused_matches_reference(page, mode):
    cp = _cp()
    b, hq, hkv, d, pages_per = 17, 32, 8, 128, -(-3000 // page)
    n = pages_per * page
    pool = b * pages_per + 3
    kp, vp = _rand((pool, page, hkv, d), "fp16"), _rand((pool, page, hkv, d), "fp16")
    table = cp.asarray(np.random.default_rng(page).permutation(pool)[:b * pages_per].reshape(b, pages_per)
                       .astype(np.int32))
    lens = _lens(cp, b, n, page)
    q = _rand((b, hq, d), "fp16")
    ref, ref_lse = paged_attention_reference(q, kp, vp, table, lens)
    prob = DecodeProblem(b, hq, hkv, d, n, "fp16", page_size=page)
    for splits in (3, 24):
        with dispatch.forced_plan(_plan(prob, splits, mode, bucket=5)):
            o, lse = fdpp.paged_decode_attention(q, kp, vp, table, lens, return_lse=True)
        _check(o, lse, ref, ref_lse, "fp16")


CLUSTER_CASES = [*itertools.product(["fp16", "bf16"], [(32, 8), (8, 1), (24, 8), (4, 4)], [64, 128, 256], [2, 16]),
                 ("fp16", (32, 8), 128, 4), ("bf16", (32, 8), 128, 8), ("fp16", (8, 1), 64, 8),
                 # 2, 5, 6 and 7 query heads per CTA (passed in run Z1, since when
                 # configs.CLUSTER_HEURISTIC_GROUPS takes them): qwen2.5-7b's 28 / 4 among them
                 *itertools.product(["fp16", "bf16"], [(16, 8), (10, 2), (12, 2), (28, 4)], [64, 128], [2, 8]),
                 # sizes other than 2 / 4 / 8 / 16 (configs.MAX_CLUSTER): a rank's columns end inside
                 # a head row (G x D not a multiple of the size), and past the last item
                 *itertools.product(["fp16"], [(32, 8), (8, 1), (28, 4)], [64, 128], [3, 12]),
                 ("bf16", (32, 8), 256, 11), ("fp16", (8, 1), 128, 14)]


@pytest.mark.parametrize("dt, heads, d, cluster", CLUSTER_CASES)
def test_cluster_merge_matches_reference(dt, heads, d, cluster):
    """The cluster merge (sm_90) against the float64 reference: GQA 1 / 3 / 4 / 8, a request of
    length 0 and one not a multiple of the chunk, lse."""
    cp = _cp()
    hq, hkv = heads
    b, n = 3, 1000
    q, k, v = _rand((b, hq, d), dt), _rand((b, n, hkv, d), dt), _rand((b, n, hkv, d), dt)
    lens = _lens(cp, b, n, cluster + d)
    ref, ref_lse = attention_reference(q, k, v, lens)
    prob = DecodeProblem(b, hq, hkv, d, n, dt)
    out = cp.full((b, hq, d), np.nan, dtype=np.float32).astype(q.dtype)
    p = _plan(prob, cluster, "cluster")
    assert p.mode == "cluster" and p.split.cluster == cluster
    with dispatch.forced_plan(p):
        o, lse = fdpp.decode_attention(q, k, v, cache_seqlens=lens, return_lse=True, out=out)
    assert o is out
    _check(o, lse, ref, ref_lse, dt)


@pytest.mark.parametrize("dt, heads, group, paged", [("fp16", (8, 1), 4, False), ("bf16", (8, 1), 4, True),
                                                     ("fp16", (8, 1), 2, False), ("fp16", (16, 4), 2, True),
                                                     ("bf16", (32, 8), 2, False)])
def test_half_group_plans_match_reference(dt, heads, group, paged):
    """Fewer query heads per CTA than ``group_size_for`` (the tuner's half groups, where KV heads
    are few): each KV head is read by ratio / group CTAs; every merge path, lengths 0 and odd."""
    cp = _cp()
    hq, hkv = heads
    b, d, page = 3, 128, 16
    n = 2000 if not paged else -(-2000 // page) * page
    q = _rand((b, hq, d), dt)
    lens = _lens(cp, b, n, group + hq)
    prob = DecodeProblem(b, hq, hkv, d, n, dt, page_size=page if paged else 0)
    if paged:
        pool = b * (n // page) + 2
        kp, vp = _rand((pool, page, hkv, d), dt), _rand((pool, page, hkv, d), dt)
        table = cp.asarray(np.random.default_rng(group).permutation(pool)[:b * (n // page)]
                           .reshape(b, n // page).astype(np.int32))
        ref, ref_lse = paged_attention_reference(q, kp, vp, table, lens)
        call = lambda out: fdpp.paged_decode_attention(q, kp, vp, table, lens, return_lse=True, out=out)  # noqa: E731
    else:
        k, v = _rand((b, n, hkv, d), dt), _rand((b, n, hkv, d), dt)
        ref, ref_lse = attention_reference(q, k, v, lens)
        call = lambda out: fdpp.decode_attention(q, k, v, cache_seqlens=lens, return_lse=True, out=out)  # noqa: E731
    cfg = replace(default_kernel(prob, split=True), group_size=group)
    plans = [LaunchPlan.split_kv(cfg, 24, CombineConfig(dt, d, 4, 2), source="test"),
             LaunchPlan.split_kv(cfg, 24, source="test", fused=True),
             LaunchPlan.cluster_merge(cfg, 16, source="test")]
    for p in plans:
        out = cp.full((b, hq, d), np.nan, dtype=np.float32).astype(q.dtype)
        with dispatch.forced_plan(p):
            o, lse = call(out)
        assert p.split.grid(prob, p.effective_splits(n))[1] == hq // group
        _check(o, lse, ref, ref_lse, dt)


@pytest.mark.parametrize("n, b", [(5, 17), (50, 17), (16 * 64 + 1, 4), (40000, 2)])
def test_cluster_merge_short_and_long(n, b):
    """Fewer tokens than CTAs (empty trailing CTAs), odd lengths, batch 17, a long cache; the
    cluster plan reads no workspace (its record has no partials)."""
    cp = _cp()
    hq, hkv, d = 32, 8, 128
    q, k, v = _rand((b, hq, d), "fp16"), _rand((b, n, hkv, d), "fp16"), _rand((b, n, hkv, d), "fp16", 3.0)
    lens = _lens(cp, b, n, n)
    ref, ref_lse = attention_reference(q, k, v, lens)
    prob = DecodeProblem(b, hq, hkv, d, n, "fp16")
    with dispatch.forced_plan(_plan(prob, 16, "cluster")):
        o, lse = fdpp.decode_attention(q, k, v, cache_seqlens=lens, return_lse=True)
        rec = next(r for r in plan._records.values() if r.plan.mode == "cluster" and r.prob == prob)
    assert rec.part_floats == 0 and rec.counter_words == 0
    _check(o, lse, ref, ref_lse, "fp16")


@pytest.mark.parametrize("page, cluster", [(1, 4), (1, 16), (16, 16), (64, 8)])
def test_paged_cluster_merge_matches_reference(page, cluster):
    cp = _cp()
    b, hq, hkv, d, pages_per = 17, 32, 8, 128, -(-3000 // page)
    n = pages_per * page
    pool = b * pages_per + 3
    kp, vp = _rand((pool, page, hkv, d), "fp16"), _rand((pool, page, hkv, d), "fp16")
    table = cp.asarray(np.random.default_rng(page).permutation(pool)[:b * pages_per].reshape(b, pages_per)
                       .astype(np.int32))
    lens = _lens(cp, b, n, page + cluster)
    q = _rand((b, hq, d), "fp16")
    ref, ref_lse = paged_attention_reference(q, kp, vp, table, lens)
    prob = DecodeProblem(b, hq, hkv, d, n, "fp16", page_size=page)
    with dispatch.forced_plan(_plan(prob, cluster, "cluster")):
        o, lse = fdpp.paged_decode_attention(q, kp, vp, table, lens, return_lse=True)
    _check(o, lse, ref, ref_lse, "fp16")


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int4"])
def test_quantized_cluster_merge_matches_reference(fmt, rng):
    """FP8 and INT4 caches through the cluster merge, against the float64 reference of the
    dequantised cache (the V descale is applied in the merge)."""
    from int4_util import dequant, random_int4
    from int4_util import reference as int4_reference

    from fdpp.dtypes import KV_FORMATS
    from fdpp.reference import dequant_fp8_cache

    cp = _cp()
    b, hq, hkv, d, n = 3, 32, 8, 128, 3001
    q = rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16)
    lens = np.array([3001, 0, 1777], np.int32)
    if fmt == "int4":
        (kc, ks, kz), (vc, vs, vz) = (random_int4((b, n, hkv, d), 64, rng, outliers=True),
                                      random_int4((b, n, hkv, d), 64, rng))
        ref, ref_lse = int4_reference(q, dequant(kc, ks, kz), dequant(vc, vs, vz), lens)
        kw = dict(kv_dtype="int4", k_descale=cp.asarray(ks), v_descale=cp.asarray(vs), k_zero=cp.asarray(kz),
                  v_zero=cp.asarray(vz))
        kernel_kv = "int4_g64"
    else:
        f = KV_FORMATS[fmt]
        kc, vc = (np.clip(rng.standard_normal((b, n, hkv, d), dtype=np.float32) * f.max / 4, -f.max, f.max)
                  .astype(f.np_dtype).view(np.uint8) for _ in range(2))
        kd, vd = (rng.uniform(0.0005, 0.01, size=(b, hkv)).astype(np.float32) for _ in range(2))
        kf, vf = dequant_fp8_cache(kc, fmt, kd), dequant_fp8_cache(vc, fmt, vd)
        ref, ref_lse = attention_reference(q, kf, vf, lens)
        kw = dict(kv_dtype=fmt, k_descale=cp.asarray(kd), v_descale=cp.asarray(vd))
        kernel_kv = fmt
    prob = DecodeProblem(b, hq, hkv, d, n, "fp16", kernel_kv)
    out = cp.full((b, hq, d), np.nan, dtype=np.float16)
    with dispatch.forced_plan(_plan(prob, 16, "cluster")):
        fdpp.decode_attention(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), cache_seqlens=cp.asarray(lens),
                              out=out, **kw)
    assert_close(cp.asnumpy(out.astype(cp.float32)), np.asarray(ref), "fp16")


def _assert_replays_bitwise(plan_, q, k, v, check=None):
    """100 replays of one captured call of ``plan_`` give bitwise equal results matching the
    reference; ``check()`` (if given) holds after the eager call and after the replays."""
    cp = _cp()
    out = cp.empty(q.shape, dtype=q.dtype)
    stream = cp.cuda.Stream(non_blocking=True)
    stream.wait_event(cp.cuda.get_current_stream().record())  # the work queued before (inputs) first
    with dispatch.forced_plan(plan_), stream:
        fdpp.decode_attention(q, k, v, out=out)  # compile, workspace and tickets exist before capture
        stream.synchronize()
        assert check is None or check()
        stream.begin_capture()
        fdpp.decode_attention(q, k, v, out=out)
        graph = stream.end_capture()
    first = None
    for _ in range(100):
        out.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        got = cp.asnumpy(out).view(np.uint16)
        if first is None:
            first = got
            ref, _ = attention_reference(q, k, v, None)
            assert_close(cp.asnumpy(out.astype(cp.float32)), cp.asnumpy(ref), "fp16")
        np.testing.assert_array_equal(got, first)
    assert check is None or check()


def test_cluster_graph_replays_are_bitwise_reproducible():
    """100 replays of one captured cluster launch give bitwise equal results (the merge reads the
    CTAs in rank order, whatever order they finish in)."""
    b, hq, hkv, d, n = 2, 32, 8, 128, 16384
    q, k, v = _rand((b, hq, d), "fp16"), _rand((b, n, hkv, d), "fp16"), _rand((b, n, hkv, d), "fp16")
    _assert_replays_bitwise(_plan(DecodeProblem(b, hq, hkv, d, n, "fp16"), 16, "cluster"), q, k, v)


def test_cluster_bad_page_and_length_nan_for_that_request_only():
    """A block-table entry past the pool and a length past the capacity poison only their request."""
    cp = _cp()
    b, hq, hkv, d, page, per = 4, 32, 8, 128, 16, 20
    pool = b * per
    kp, vp = _rand((pool, page, hkv, d), "fp16"), _rand((pool, page, hkv, d), "fp16")
    table = np.random.default_rng(3).permutation(pool).reshape(b, per).astype(np.int32)
    lens = np.array([320, 200, 97, 40], np.int32)
    q = _rand((b, hq, d), "fp16")
    prob = DecodeProblem(b, hq, hkv, d, per * page, "fp16", page_size=page)
    with dispatch.forced_plan(_plan(prob, 16, "cluster")):
        clean = cp.asnumpy(fdpp.paged_decode_attention(q, kp, vp, cp.asarray(table), cp.asarray(lens))).view(np.uint16)
        t = table.copy()
        t[1, 5] = pool  # one past the pool, inside request 1's length
        ln = lens.copy()
        ln[3] = per * page + 1
        for bad, tt, ll in ((1, t, lens), (3, table, ln)):
            o = fdpp.paged_decode_attention(q, kp, vp, cp.asarray(tt), cp.asarray(ll))
            o16 = cp.asnumpy(o).view(np.uint16)
            assert np.isnan(cp.asnumpy(o.astype(cp.float32))[bad]).all()
            keep = [i for i in range(b) if i != bad]
            np.testing.assert_array_equal(o16[keep], clean[keep])


def _tickets_zero():
    cp = _cp()
    views = [cp.ndarray((size,), dtype=np.uint32, memptr=mem) for mem, size in workspace._tickets.values()]
    return bool(views) and all(int(cp.count_nonzero(x)) == 0 for x in views)


@pytest.mark.parametrize("heads, splits, bucket", [((32, 8), 16, 0), ((8, 1), 132, 0), ((8, 1), 132, 4)])
def test_fused_graph_replays_are_bitwise_reproducible(heads, splits, bucket):
    """100 replays of one captured fused launch give bitwise equal results, and the tickets are
    back to zero after every launch (the kernel resets them)."""
    hq, hkv = heads
    b, d, n = 2, 128, 16384
    q, k, v = _rand((b, hq, d), "fp16"), _rand((b, n, hkv, d), "fp16"), _rand((b, n, hkv, d), "fp16")
    plan_ = _plan(DecodeProblem(b, hq, hkv, d, n, "fp16"), splits, "fused", bucket)
    _assert_replays_bitwise(plan_, q, k, v, check=_tickets_zero)


def _alone_and_in_batches(paged):
    """One request's output alone, then inside batches of 7 and 64 at several positions and with a
    larger N_max: every result bitwise equal."""
    cp = _cp()
    hq, hkv, d, n_req = 32, 8, 128, 3333
    rng = np.random.default_rng(7)
    q1 = _rand((1, hq, d), "fp16")
    k1, v1 = _rand((1, n_req, hkv, d), "fp16"), _rand((1, n_req, hkv, d), "fp16")
    results = []
    for batch, pos, n_max in [(1, 0, n_req), (7, 3, 4096), (64, 0, 5000), (64, 63, 8192), (7, 6, 3400)]:
        q = _rand((batch, hq, d), "fp16")
        q[pos] = q1[0]
        lens = cp.asarray(rng.integers(1, n_max + 1, size=batch).astype(np.int32))
        lens[pos] = n_req
        k, v = _rand((batch, n_max, hkv, d), "fp16"), _rand((batch, n_max, hkv, d), "fp16")
        k[pos, :n_req], v[pos, :n_req] = k1[0], v1[0]
        if paged:
            page = 16
            per = n_max // page if n_max % page == 0 else n_max // page + 1
            pool = batch * per
            perm = rng.permutation(pool).astype(np.int32).reshape(batch, per)
            kp = cp.zeros((pool, page, hkv, d), dtype=k.dtype)
            vp = cp.zeros_like(kp)
            kpad = cp.zeros((batch, per * page, hkv, d), dtype=k.dtype)
            vpad = cp.zeros_like(kpad)
            kpad[:, :n_max], vpad[:, :n_max] = k, v
            kp[cp.asarray(perm.ravel())] = kpad.reshape(batch * per, page, hkv, d)
            vp[cp.asarray(perm.ravel())] = vpad.reshape(batch * per, page, hkv, d)
            out, lse = fdpp.paged_decode_attention(q, kp, vp, cp.asarray(perm), lens, return_lse=True,
                                                   batch_invariant=True)
        else:
            out, lse = fdpp.decode_attention(q, k, v, cache_seqlens=lens, return_lse=True, batch_invariant=True)
        results.append((cp.asnumpy(out[pos]).view(np.uint16), cp.asnumpy(lse[pos]).view(np.uint32)))
    ref, ref_lse = attention_reference(q1, k1, v1, None)
    assert_close(results[0][0].view(np.float16).astype(np.float32)[None], cp.asnumpy(ref), "fp16")
    for o, lse in results[1:]:
        np.testing.assert_array_equal(o, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])


def test_batch_invariant_contiguous():
    _alone_and_in_batches(paged=False)


def test_batch_invariant_paged():
    _alone_and_in_batches(paged=True)


def test_default_plan_is_not_batch_invariant_by_construction():
    """The check above can fail: the default plans of batches 1 and 64 use other split sizes."""
    from fdpp.configs import SM90, default_config

    p1 = default_config(DecodeProblem(1, 32, 8, 128, 4096, "fp16"), SM90)
    p64 = default_config(DecodeProblem(64, 32, 8, 128, 4096, "fp16"), SM90)
    assert p1.chunk(4096) != p64.chunk(4096)


@pytest.mark.parametrize("mode", ["fused", "combine", "cluster"])
def test_nan_in_one_request_stays_there(mode):
    cp = _cp()
    b, hq, hkv, d, n = 4, 8, 1, 128, 4096
    q, k, v = _rand((b, hq, d), "fp16"), _rand((b, n, hkv, d), "fp16"), _rand((b, n, hkv, d), "fp16")
    k[2, 100, 0, 5] = np.nan  # NaN: every head of request 2 (an Inf would give -inf scores for some)
    prob = DecodeProblem(b, hq, hkv, d, n, "fp16")
    with dispatch.forced_plan(_plan(prob, 16 if mode == "cluster" else 40, mode, bucket=6, slices=4)):
        out, lse = fdpp.decode_attention(q, k, v, return_lse=True)
    o = cp.asnumpy(out.astype(cp.float32))
    assert np.isnan(o[2]).all() and np.isnan(cp.asnumpy(lse)[2]).all()
    assert np.isfinite(o[[0, 1, 3]]).all()


@pytest.mark.parametrize("mode", ["fused", "combine", "cluster"])
def test_torch_capture_on_a_fresh_stream(mode):
    """Warm-up on the default stream, capture on a side stream fdpp has never seen (torch's usual
    pattern): the stream's first partials and tickets cannot be CUDA allocations inside the
    capture; the replays must equal eager calls."""
    torch = pytest.importorskip("torch")
    b, hq, hkv, d, n = 2, 32, 8, 128, 4096
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(b, n, hkv, d, device="cuda", dtype=torch.float16) for _ in range(2))
    prob = DecodeProblem(b, hq, hkv, d, n, "fp16")
    with dispatch.forced_plan(_plan(prob, 16, mode, slices=4)):
        want = fdpp.decode_attention(q, k, v)
        torch.cuda.synchronize()
        out = torch.empty_like(q)
        g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.graph(g, stream=s):
            fdpp.decode_attention(q, k, v, out=out)
        for _ in range(3):
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)
