"""Programmatic dependent launch on the GPU (run on the H200): the same bits with and without PDL,
and chains of back-to-back calls whose kernels overlap their neighbours (the split workspace
reused by every call, inputs written by an ordinary kernel just before each call), eager and in a
CUDA graph, each output compared with the float64 reference (which never calls an fdpp kernel)."""

import numpy as np
import pytest
from gpu_util import assert_graph_replay_matches

import fdpp
from fdpp import dispatch, launch, plan
from fdpp.configs import CombineConfig, DecodeProblem, LaunchPlan, default_kernel
from fdpp.reference import assert_close, attention_reference

pytestmark = pytest.mark.gpu


def _cp():
    import cupy

    return cupy


@pytest.fixture
def pdl(monkeypatch):
    """Set launch.PDL for the test (records are keyed on it): True = every family, False = none."""
    def set_(on: bool):
        monkeypatch.setattr(launch, "PDL", frozenset(launch.PDL_FAMILIES if on else ()))
    plan.clear()  # records of earlier tests in this worker
    yield set_
    plan.clear()


def _plan(prob, splits, mode):
    cfg = default_kernel(prob, split=True)
    if mode == "fused":
        return LaunchPlan.split_kv(cfg, splits, source="test", fused=True)
    return LaunchPlan.split_kv(cfg, splits, CombineConfig(prob.dtype, prob.head_dim, 4, 1), source="test")


def _inputs(b, hq, hkv, n, d, seed):
    cp = _cp()
    rs = cp.random.RandomState(seed)
    q = rs.standard_normal((b, hq, d), dtype=cp.float32).astype(cp.float16)
    k = rs.standard_normal((b, n, hkv, d), dtype=cp.float32).astype(cp.float16)
    v = rs.standard_normal((b, n, hkv, d), dtype=cp.float32).astype(cp.float16)
    return q, k, v


def _ref(q, k, v):
    cp = _cp()
    return attention_reference(cp.asnumpy(q), cp.asnumpy(k), cp.asnumpy(v))[0]


@pytest.mark.parametrize("mode, splits", [("combine", 16), ("combine", 1), ("fused", 16), ("fused", 132)])
@pytest.mark.parametrize("heads", [(32, 8), (8, 1)])
def test_pdl_gives_the_same_bits(pdl, mode, splits, heads):
    cp = _cp()
    hq, hkv = heads
    q, k, v = _inputs(3, hq, hkv, 3000, 128, 1)
    prob = DecodeProblem(3, hq, hkv, 128, 3000, "fp16")
    outs = {}
    for on in (False, True):
        pdl(on)
        with dispatch.forced_plan(_plan(prob, splits, mode)):
            out = cp.full((3, hq, 128), np.nan, dtype=cp.float16)
            fdpp.decode_attention(q, k, v, out=out)
            rec = next(iter(plan._records.values()))
            expect = (on and launch.LAUNCHER != "cupy" and launch.HAVE_BINDINGS and launch.pdl_supported(0)
                      and prob.kv_bytes() <= launch.PDL_ATTENTION_MAX_BYTES)
            assert all(c.pdl is expect for c in rec.calls)
        outs[on] = cp.asnumpy(out)
        plan.clear()
    np.testing.assert_array_equal(outs[True].view(np.uint16), outs[False].view(np.uint16))
    assert_close(outs[True].astype(np.float32), _ref(q, k, v), "fp16")


def _chain(problems, outs, srcs, qs):
    """One call per problem, back to back on the current stream; before each, an ordinary CuPy
    kernel writes that call's q (so a phase-1 kernel that read q before waiting would see stale
    data: qs are poisoned before the chain)."""
    cp = _cp()
    for (k, v, forced), out, src, q in zip(problems, outs, srcs, qs, strict=True):
        cp.multiply(src, 1, out=q)
        with dispatch.forced_plan(forced):
            fdpp.decode_attention(q, k, v, out=out)


@pytest.mark.parametrize("capture", [False, True])
def test_back_to_back_calls_overlap_safely(pdl, capture):
    """Alternating problems and merge modes share the stream's split workspace: a call's phase 1
    overwrites the partials the previous call's merge reads unless it waits for it."""
    cp = _cp()
    pdl(True)
    b, hq, hkv, d = 2, 32, 8, 128
    problems, srcs, refs = [], [], []
    for i in range(12):
        n = (4096, 1000, 64, 2500)[i % 4]
        q, k, v = _inputs(b, hq, hkv, n, d, 100 + i)
        prob = DecodeProblem(b, hq, hkv, d, n, "fp16")
        forced = _plan(prob, (16, 7, 132, 40)[i % 4], "fused" if i % 3 == 0 else "combine")
        problems.append((k, v, forced))
        srcs.append(q)
        refs.append(_ref(q, k, v))
    qs = [cp.full_like(s, np.nan) for s in srcs]
    outs = [cp.full((b, hq, d), np.nan, dtype=cp.float16) for _ in problems]
    _chain(problems, outs, srcs, qs)
    cp.cuda.get_current_stream().synchronize()
    for out, ref in zip(outs, refs, strict=True):
        assert_close(cp.asnumpy(out).astype(np.float32), ref, "fp16")
    if capture:  # the same chain in one graph, replayed with outputs and qs poisoned before each
        for q in qs:
            q[...] = np.nan
        for out in outs:
            out[...] = np.nan
        stream = cp.cuda.Stream(non_blocking=True)
        stream.wait_event(cp.cuda.get_current_stream().record())
        with stream:
            stream.begin_capture()
            _chain(problems, outs, srcs, qs)
            graph = stream.end_capture()
            for _ in range(20):
                for x in (*qs, *outs):
                    x[...] = np.nan
                graph.launch(stream)
            stream.synchronize()
        for out, ref in zip(outs, refs, strict=True):
            assert_close(cp.asnumpy(out).astype(np.float32), ref, "fp16")


def test_pdl_graph_replays_are_bitwise_stable(pdl):
    cp = _cp()
    pdl(True)
    q, k, v = _inputs(1, 8, 1, 16384, 128, 7)
    prob = DecodeProblem(1, 8, 1, 128, 16384, "fp16")
    out = cp.full((1, 8, 128), np.nan, dtype=cp.float16)
    with dispatch.forced_plan(_plan(prob, 132, "combine")):
        fdpp.decode_attention(q, k, v, out=out)
        assert_graph_replay_matches(lambda: fdpp.decode_attention(q, k, v, out=out), out, 100)
    assert_close(cp.asnumpy(out).astype(np.float32), _ref(q, k, v), "fp16")


@pytest.mark.parametrize("impl", ["flat", "tma", "gemv"])
def test_gemm_chain_reads_the_previous_output(pdl, impl):
    """y_{i+1} = y_i W_i^T, each GEMM a PDL launch consuming its predecessor's output (a kernel
    that read x before waiting would see the poisoned buffer), eager and replayed in a graph."""
    cp = _cp()
    from fdpp import gemm

    pdl(True)
    if impl == "tma" and not launch.pdl_supported(0):
        pytest.skip("flat_tma needs sm_90")
    space = {"flat": gemm.flat_space, "tma": gemm.tma_space, "gemv": gemm.gemv_space}[impl]
    forced = gemm.GemmPlan(impl, next(iter(space("fp16"))), None, "test")
    rs = cp.random.RandomState(5)
    m, d, steps = 4, 1024, 6
    ws = [(rs.standard_normal((d, d), dtype=cp.float32) / np.sqrt(d)).astype(cp.float16) for _ in range(steps)]
    x0 = rs.standard_normal((m, d), dtype=cp.float32).astype(cp.float16)
    ref = cp.asnumpy(x0).astype(np.float64)
    for w in ws:
        ref = (ref @ cp.asnumpy(w).astype(np.float64).T).astype(np.float16).astype(np.float64)
    ys = [cp.full((m, d), np.nan, dtype=cp.float16) for _ in range(steps)]

    def chain():
        x = x0
        with gemm.forced_plan(forced):
            for w, y in zip(ws, ys, strict=True):
                gemm.flat_gemm(x, w, out=y)
                x = y

    chain()
    np.testing.assert_allclose(cp.asnumpy(ys[-1]).astype(np.float64), ref, rtol=2e-2, atol=2e-2)
    stream = cp.cuda.Stream(non_blocking=True)
    stream.wait_event(cp.cuda.get_current_stream().record())
    with stream:
        stream.begin_capture()
        chain()
        graph = stream.end_capture()
        for _ in range(10):
            for y in ys:
                y[...] = np.nan
            graph.launch(stream)
        stream.synchronize()
    np.testing.assert_allclose(cp.asnumpy(ys[-1]).astype(np.float64), ref, rtol=2e-2, atol=2e-2)
