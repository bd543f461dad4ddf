"""softmax_mode="unified_max" without a GPU: argument checks, calibrate_unified_max against a direct
computation, the NumPy path (the emulator's exact softmax), the launch record's DecodeParams words
(CuPy stand-ins, tests/fakegpu.py), explain, and a float64/fp16 model of the tensor-core kernels'
block rule (kernels_cu/decode_split.cu) that shows why the first-block low rule exists: without
it, fp16 probabilities from a phi far above the scores underflow and the output is wrong."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import fakegpu  # noqa: E402

import fdpp  # noqa: E402
from fdpp import api, configs, dispatch, plan, tables  # noqa: E402
from fdpp.reference import assert_close, attention_reference  # noqa: E402

LOG2E = 1.4426950408889634


def _inputs(rng, b=2, hq=8, hkv=2, d=64, n=100, qscale=1.0, dt=np.float16):
    q = (rng.standard_normal((b, hq, d)) * qscale).astype(dt)
    k = rng.standard_normal((b, n, hkv, d)).astype(dt)
    v = rng.standard_normal((b, n, hkv, d)).astype(dt)
    return q, k, v


# ---- arguments ----------------------------------------------------------------------------------
BAD = [
    (dict(softmax_mode="fast"), ValueError, "softmax_mode must be one of"),
    (dict(softmax_mode=1), TypeError, "softmax_mode must be a str"),
    (dict(unified_max=3.0), ValueError, "softmax_mode is 'exact'"),
    (dict(softmax_mode="unified_max"), ValueError, "needs unified_max"),
    (dict(softmax_mode="unified_max", unified_max=True), TypeError, "unified_max must be a float"),
    (dict(softmax_mode="unified_max", unified_max="3"), TypeError, "unified_max must be a float"),
    (dict(softmax_mode="unified_max", unified_max=float("nan")), ValueError, "finite"),
    (dict(softmax_mode="unified_max", unified_max=float("inf")), ValueError, "finite"),
    (dict(softmax_mode="unified_max", unified_max=2e6), ValueError, "at most"),
]


@pytest.mark.parametrize("kw, exc, msg", BAD)
def test_bad_arguments_raise_naming_them(kw, exc, msg, rng):
    q, k, v = _inputs(rng)
    with pytest.raises(exc, match=msg):
        fdpp.decode_attention(q, k, v, **kw)
    table = np.arange(2 * 7, dtype=np.int32).reshape(2, 7)
    lens = np.array([100, 3], np.int32)
    with pytest.raises(exc, match=msg):
        pages = np.zeros((14, 16, 2, 64), np.float16)
        fdpp.paged_decode_attention(q, pages, pages, table, lens, **kw)
    with pytest.raises(exc, match=msg):
        fdpp.DecodePlan(2, 8, 2, 64, 100, **kw)


def test_numpy_path_is_the_exact_softmax(rng):
    """The emulator computes the exact softmax: with any phi it gives the exact mode's result, and
    both match the float64 reference."""
    q, k, v = _inputs(rng, b=3, hq=8, hkv=2, d=64, n=300, qscale=6.0)
    lens = np.array([300, 0, 17], np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        exact, lse = fdpp.decode_attention(q, k, v, cache_seqlens=lens, return_lse=True)
        for phi in (-50.0, 0.0, 5.0, 80.0):
            o, l2 = fdpp.decode_attention(q, k, v, cache_seqlens=lens, return_lse=True, softmax_mode="unified_max",
                                          unified_max=phi)
            np.testing.assert_array_equal(o, exact)
            np.testing.assert_array_equal(l2, lse)
            p = fdpp.DecodePlan(3, 8, 2, 64, 300, softmax_mode="unified_max", unified_max=phi)
            np.testing.assert_array_equal(p.run(q, k, v, cache_seqlens=lens), exact)
    ref, _ = attention_reference(q, k, v, lens)
    assert_close(exact.astype(np.float32), ref, "fp16")


# ---- calibrate_unified_max ----------------------------------------------------------------------
def _median_block_max(q, k, lens, scale):
    """Written from the docstring: every (request, q head, 16-token block), its largest score."""
    q, k = q.astype(np.float64), k.astype(np.float64)
    b, hq, d = q.shape
    hkv = k.shape[2]
    vals = []
    for r in range(b):
        for h in range(hq):
            s = [scale * float(q[r, h] @ k[r, t, h // (hq // hkv)]) for t in range(int(lens[r]))]
            vals += [max(s[i:i + 16]) for i in range(0, len(s), 16)]
    return float(np.median(vals))


def test_calibrate_matches_a_direct_computation(rng):
    q, k, _ = _inputs(rng, b=3, hq=6, hkv=2, d=32, n=70, qscale=3.0)
    lens = np.array([70, 5, 33], np.int32)
    want = _median_block_max(q, k, lens, 1 / math.sqrt(32))
    got = fdpp.calibrate_unified_max(q, k, cache_seqlens=lens)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert fdpp.calibrate_unified_max(q, k.transpose(0, 2, 1, 3), kv_layout="HND", cache_seqlens=lens) == \
        pytest.approx(want, rel=1e-12, abs=1e-12)
    assert fdpp.calibrate_unified_max(q, k, softmax_scale=0.5, cache_seqlens=lens) == pytest.approx(
        _median_block_max(q, k, lens, 0.5), rel=1e-12, abs=1e-12)
    # lengths matter: the full cache differs
    assert fdpp.calibrate_unified_max(q, k) != pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("args, msg", [
    (lambda q, k: (q[0], k), "q must be"),
    (lambda q, k: (q, k[:, :, :, :16]), "does not match"),
    (lambda q, k: (q[:, :5], k), "does not match"),
])
def test_calibrate_rejects_bad_shapes(args, msg, rng):
    q, k, _ = _inputs(rng)
    with pytest.raises(ValueError, match=msg):
        fdpp.calibrate_unified_max(*args(q, k))


def test_calibrate_rejects_bad_lengths_and_layout(rng):
    q, k, _ = _inputs(rng)
    with pytest.raises(ValueError, match="cache_seqlens"):
        fdpp.calibrate_unified_max(q, k, cache_seqlens=np.array([1, 101]))
    with pytest.raises(ValueError, match="at least one token"):
        fdpp.calibrate_unified_max(q, k, cache_seqlens=np.array([0, 0]))
    with pytest.raises(ValueError, match="kv_layout"):
        fdpp.calibrate_unified_max(q, k, kv_layout="NDH")


# ---- what the kernels are given -----------------------------------------------------------------
@pytest.fixture
def fake(monkeypatch):
    monkeypatch.delenv(tables.ENV_DIR, raising=False)
    fakegpu.install(monkeypatch)
    api.set_checks(False)
    yield fakegpu
    plan.clear()


@pytest.mark.parametrize("split, twin", [
    (configs.DecodeConfig("fp16", 128, 4, 4, 3, 1, mma=True), "decode_split_mma_umax"),
    (configs.DecodeConfig("fp16", 128, 4, 4, 3, 1, mma=True, cluster=8), "decode_split_mma_cluster_umax"),
    (configs.DecodeConfig("fp16", 256, 4, 4, 3, 1, mma=True), "decode_split_mma"),  # d256: exact
    (configs.DecodeConfig("fp16", 128, 4, 4, 2, 2), "decode_split"),  # CUDA cores: exact
])
def test_launch_record_runs_the_twin_with_phi(fake, split, twin):
    q, k, v = fake.llama_inputs("cupy")
    if split.head_dim != 128:
        q, k = fake.ndarray((1, 32, split.head_dim)), fake.ndarray((1, 1024, 8, split.head_dim))
        v = k
    lp = configs.LaunchPlan.split_kv(split, 8, fused=True)
    with dispatch.forced_plan(lp):
        fdpp.decode_attention(q, k, v)
        fdpp.decode_attention(q, k, v, softmax_mode="unified_max", unified_max=3.5)
        fdpp.decode_attention(q, k, v, softmax_mode="unified_max", unified_max=-2.0)
    recs = list(plan._records.values())
    assert len(recs) == 3  # phi is part of the signature: three records
    got = sorted((float(r.params["umax2"].item()), r.plan.split.function) for r in recs)
    assert got == [(pytest.approx(-2.0 * LOG2E, rel=1e-6), twin), (0.0, split.function),
                   (pytest.approx(3.5 * LOG2E, rel=1e-6), twin)]
    assert lp.unified_max().split.check(configs.SM90) is None


def test_umax_twins_are_checked():
    assert "tensor-core" in configs.DecodeConfig("fp16", 128, 4, 4, 2, 2, umax=True).check()
    assert "head_dim 64 or 128" in configs.DecodeConfig("fp16", 256, 4, 4, 3, 1, mma=True, umax=True).check()
    c = configs.DecodeConfig("bf16", 64, 8, 4, 3, 1, mma=True, page_size=16, umax=True)
    assert c.is_valid() and c.key.startswith("decode_split_mma_umax.") and "decode_split_mma_umax<" in c.name_expression()


def test_explain_says_what_the_mode_does():
    p = configs.DecodeProblem(1, 32, 8, 128, 4096, "fp16")
    mma = configs.LaunchPlan.split_kv(configs.DecodeConfig("fp16", 128, 4, 4, 3, 1, mma=True), 8)
    cuda = configs.LaunchPlan.split_kv(configs.DecodeConfig("fp16", 128, 4, 4, 2, 2), 8)
    with dispatch.forced_plan(mma):
        assert fdpp.explain(p, configs.SM90).splitlines()[-1].startswith("softmax: exact:")
        assert "decode_split_mma_umax (the unified-max twin of decode_split_mma) starts each chunk" in fdpp.explain(
            p, configs.SM90, softmax_mode="unified_max")
    with dispatch.forced_plan(cuda):
        assert "no effect on this plan" in fdpp.explain(p, configs.SM90, softmax_mode="unified_max")
    with pytest.raises(ValueError, match="softmax_mode"):
        fdpp.explain(p, configs.SM90, softmax_mode="unified")


# ---- the block rule, modelled -------------------------------------------------------------------
def _kernel_model(s2, v, phi2, low_rule=True, block=16, below=7.0, lazy=15.0, low=1.0):
    """One warp's softmax over scores s2 (log2 domain) of one head, as decode_split_mma's fp16 path:
    blocks of 16, reference m from phi2 - below (phi2 None: exact mode, m from -inf and lazy = 8),
    the lazy rule (move when a score passes m + lazy), the first-block low rule (all scores below
    m - low: restart from their max), p in float32 summed into l, rounded to fp16 for the P.V
    product. The defaults are the kernel's (UMAX_BELOW, LAZY, the 1.f of the first-block vote)."""
    m = -np.inf if phi2 is None else phi2 - below
    lazy = 8.0 if phi2 is None else lazy
    first = phi2 is not None
    o, lsum = np.zeros(v.shape[1]), 0.0
    for i in range(0, len(s2), block):
        x = s2[i:i + block].astype(np.float32)
        fire = bool((x > m + lazy).any()) or (low_rule and first and bool((x < m - low).all()))
        if fire:
            mx = float(x.max())
            mx = mx if first else max(m, mx)
            alpha = 0.0 if first else 2.0 ** (m - mx)
            m, lsum, o = mx, lsum * alpha, o * alpha
        first = False
        p = np.exp2(x - np.float32(m if np.isfinite(m) else 0.0)).astype(np.float32)
        assert p.max(initial=0.0) < 65504  # fp16 P
        lsum += float(p.sum(dtype=np.float32))
        o += p.astype(np.float16).astype(np.float64) @ v[i:i + block]
    return o / lsum


@pytest.mark.parametrize("shift", [-60.0, -9.0, 0.0, 7.0, 9.0, 60.0])
def test_block_rule_is_exact_for_any_phi(shift, rng):
    n, d = 200, 64
    s = rng.standard_normal(n) * 3.0
    v = rng.standard_normal((n, d))
    p = np.exp(s - s.max())
    want = p @ v / p.sum()
    s2 = s * LOG2E
    phi2 = float(np.max(s2[:16])) + shift
    np.testing.assert_allclose(_kernel_model(s2, v, phi2), want, rtol=0, atol=3e-3)
    np.testing.assert_allclose(_kernel_model(s2, v, None), want, rtol=0, atol=3e-3)


def test_without_the_low_rule_fp16_probabilities_underflow(rng):
    """phi 40 above every score: with the rule the model is exact; without it every fp16 P is 0
    (2^-57 < fp16's smallest subnormal) while l is not, and the output collapses to 0."""
    n, d = 200, 64
    s = rng.standard_normal(n)
    v = rng.standard_normal((n, d)) + 1.0
    p = np.exp(s - s.max())
    want = p @ v / p.sum()
    phi2 = float(np.max(s * LOG2E)) + 40 * LOG2E
    np.testing.assert_allclose(_kernel_model(s * LOG2E, v, phi2), want, rtol=0, atol=3e-3)
    bad = _kernel_model(s * LOG2E, v, phi2, low_rule=False)
    assert np.abs(bad - want).max() > 0.5


def test_a_reference_above_the_scores_keeps_fp16_precision(rng):
    """One peak and a long plateau 10-20 (log2 units) below it, phi at the top of the window (phi
    = peak + 8, the furthest above the scores the rule lets m0 sit): the kernel's rule (m0 = phi - 7,
    rescale past m + 15, restart below m0 - 1) is as accurate as exact mode. The first form of the
    rule (m0 = phi, rescale past m + 8, restart below m0 - 8) let m sit up to 8 above the scores,
    and its fp16 P lost 8 bits of range: the plateau's probabilities rounded to subnormals or 0
    while l (float32) kept them. (phi - 7 is then a whole power of two above the peak, so the
    peak's P is exact in fp16 as in exact mode; any other offset adds the fp16 rounding of the
    peak's P, ~2^-11 relative, which exact mode has for every token but its running max.)"""
    n, d = 4096, 64
    errs: dict[str, list[float]] = {}
    for lo, hi in ((12.0, 20.0), (10.0, 14.0), (14.0, 18.0)):
        s2 = -rng.uniform(lo, hi, n)
        s2[rng.integers(0, 16)] = 0.0  # the peak, in the first block
        v = rng.standard_normal((n, d)) + 0.5  # a mean: weight lost from P biases the output
        p = np.exp2(s2 - s2.max())
        want = p @ v / p.sum()
        for name, kw in (("exact", {"phi2": None}), ("kernel", {"phi2": 8.0}),
                         ("first form", {"phi2": 8.0, "below": 0.0, "lazy": 8.0, "low": 8.0})):
            errs.setdefault(name, []).append(float(np.abs(_kernel_model(s2, v, **kw) - want).max()))
    exact, kernel, old = (max(errs[k]) for k in ("exact", "kernel", "first form"))
    assert exact < 1e-5 and kernel < 1e-5, errs
    assert old > 1e-4 and old > 20 * kernel, errs  # the test tells the two rules apart
