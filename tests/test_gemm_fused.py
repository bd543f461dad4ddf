"""flat_gemm's decode-step fusions: the RMSNorm prologue (``rms_eps``) and the residual epilogue
(``residual``, in place when it is ``out``), with :func:`fdpp.fold_rmsnorm`.

The reference is float64 NumPy written here: ``rmsnorm(x, g) @ w.T + bias + residual`` with the
norm's weight ``g`` apart (the kernels get ``fold_rmsnorm(w, g)``). CPU: the NumPy path and the
argument checks. GPU (``-m gpu``): every kernel family (bulk-copy with 1-3 row groups, x in the
ring or not, FP8 weights; the cp.async flat kernel; GEMV), tiles a CTA owns alone and stream-K
tiles fixed up by the last CTA, the dispatcher's choice where the table says cuBLAS, torch
tensors, and an in-place residual replayed from a CUDA graph. Outputs are poisoned first; rows
have different scales so a wrong row's RMS shows.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import fdpp
from fdpp import gemm
from fdpp.dtypes import DTYPES
from fdpp.reference import assert_close

DTS = ("fp16", "bf16")
EPS = 1e-5


def _quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fn(*a, **kw)


def _inputs(rng, m, n, k, dt, bias=True):
    """x with rows of scales 0.1..10, w, the norm weight g ~ 1 +- 0.2, bias, residual."""
    npdt = DTYPES[dt].np_dtype
    scale = np.geomspace(0.1, 10.0, m)[:, None]
    x = (rng.standard_normal((m, k)) * scale).astype(npdt)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(npdt)
    g = (1 + 0.2 * rng.standard_normal(k)).astype(npdt)
    b = rng.standard_normal(n).astype(npdt) if bias else None
    r = rng.standard_normal((m, n)).astype(npdt)
    return x, w, g, b, r


def _ref(x, w, g=None, b=None, r=None, eps=EPS):
    x64 = x.astype(np.float64)
    if g is not None:
        x64 = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + eps) * g.astype(np.float64)
    y = x64 @ w.astype(np.float64).T
    if b is not None:
        y += b.astype(np.float64)
    if r is not None:
        y += r.astype(np.float64)
    return y


# ---- CPU: the NumPy path and the checks ------------------------------------------------------
@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("m, n, k", [(1, 77, 136), (3, 40, 64), (17, 130, 72)])
@pytest.mark.parametrize("norm, res", [(True, None), (False, "apart"), (True, "apart"), (True, "in-place")])
def test_numpy_fused_vs_float64(rng, dt, m, n, k, norm, res):
    x, w, g, b, r = _inputs(rng, m, n, k, dt, bias=m % 2 == 1)
    wf = fdpp.fold_rmsnorm(w, g) if norm else w
    want = _ref(x, w, g if norm else None, b, r if res else None)
    kw = {"rms_eps": EPS} if norm else {}
    if res == "in-place":
        out = r.copy()
        assert _quiet(fdpp.flat_gemm, x, wf, bias=b, residual=out, out=out, **kw) is out
        y = out
    else:
        y = _quiet(fdpp.flat_gemm, x, wf, bias=b, residual=r if res else None, **kw)
    assert y.dtype == x.dtype and y.shape == (m, n)
    assert_close(y, want, dt)


def test_fold_rmsnorm():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 16)).astype(np.float16)
    g = rng.standard_normal(16).astype(np.float16)
    f = fdpp.fold_rmsnorm(w, g)
    assert f.dtype == w.dtype and f.shape == w.shape and f is not w
    np.testing.assert_array_equal(f, (w.astype(np.float32) * g.astype(np.float32)).astype(np.float16))
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        fdpp.fold_rmsnorm(w, g[:8])
    with pytest.raises(ValueError, match=r"w must have shape \[N, K\]"):
        fdpp.fold_rmsnorm(w[0], g)
    with pytest.raises(TypeError, match="norm_weight must be a NumPy array"):
        fdpp.fold_rmsnorm(w, None)
    with pytest.raises(TypeError, match="w must be a NumPy array"):
        fdpp.fold_rmsnorm(w.tolist(), g)
    codes, _ = fdpp.quantize_weight(w)  # FP8 codes: fold before quantizing, never into codes
    with pytest.raises(TypeError, match="w dtype must be fp16, bf16 or fp32"):
        fdpp.fold_rmsnorm(codes, g)
    with pytest.raises(TypeError, match="w dtype must be fp16, bf16 or fp32"):
        fdpp.fold_rmsnorm(codes.view(np.uint8), g)


def test_zero_row_with_zero_eps_is_nan_not_a_crash(rng):
    """rms_eps = 0 and an all-zero row: 0 / 0, as an unfused norm gives (documented: eps > 0 in
    practice)."""
    x, w, _, _, _ = _inputs(rng, 2, 8, 16, "fp16", bias=False)
    x[1] = 0
    with np.errstate(all="ignore"):
        y = _quiet(fdpp.flat_gemm, x, w, rms_eps=0.0)
    assert np.isfinite(y[0]).all() and not np.isfinite(y[1]).any()


@pytest.mark.parametrize("kw, exc, words", [
    ({"rms_eps": -1e-6}, ValueError, "rms_eps must be finite and >= 0"),
    ({"rms_eps": float("nan")}, ValueError, "rms_eps must be finite"),
    ({"rms_eps": float("inf")}, ValueError, "rms_eps must be finite"),
    ({"rms_eps": 10**400}, ValueError, "rms_eps must be finite and >= 0, got an integer of 401 digits"),
    ({"rms_eps": "1e-5"}, TypeError, "rms_eps must be a real number"),
    ({"rms_eps": True}, TypeError, "rms_eps must be a real number"),
    ({"residual": lambda r: r[:2]}, ValueError, "residual must have shape"),
    ({"residual": lambda r: r.astype(np.float32)}, TypeError, "residual dtype"),
    ({"residual": lambda r: np.ascontiguousarray(r.T).T}, ValueError, "residual must be C-contiguous"),
    ({"residual": lambda r: r.tolist()}, TypeError, "residual must be the same array type"),
])
def test_bad_fused_arguments(rng, kw, exc, words):
    x, w, _, _, r = _inputs(rng, 3, 5, 16, "fp16")
    kw = {k: (v(r) if callable(v) else v) for k, v in kw.items()}
    with pytest.raises(exc, match=words):
        _quiet(fdpp.flat_gemm, x, w, **kw)


def test_residual_must_be_out_or_apart_from_it(rng):
    x, w, _, _, _ = _inputs(rng, 3, 8, 16, "fp16")
    buf = np.zeros((4, 8), np.float16)
    with pytest.raises(ValueError, match="residual must be out itself"):
        _quiet(fdpp.flat_gemm, x, w, residual=buf[1:], out=buf[:3])
    r = buf[:3].copy()
    y = _quiet(fdpp.flat_gemm, x, w, residual=r, out=buf[:3])  # apart: fine, r unchanged
    assert_close(y, _ref(x, w, r=r), "fp16")


def test_explain_says_a_fused_call_leaves_cublas(tmp_path, monkeypatch):
    from fdpp import tables
    from fdpp.configs import SM90

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(tables, "shipped_dir", lambda: shipped)
    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path / "user"))
    tables.clear_cache()
    try:
        gemm.write_table(tmp_path / "user" / gemm.table_filename(SM90.name), SM90,
                         [gemm.GemmEntry.of(gemm.GemmPlan("cublas"), "fp16", 28672, 4096, 1)])
        assert gemm.choose(1, 28672, 4096, SM90, "fp16").impl == "cublas"
        text = gemm.explain(1, 28672, 4096, device=SM90, fused=True)
        assert "cannot fuse" in text and "runs: flat_tma" in text
        assert "runs: cublas" in gemm.explain(1, 28672, 4096, device=SM90)
    finally:
        tables.clear_cache()


def test_inputs_left_unmodified(rng):
    x, w, g, b, r = _inputs(rng, 3, 9, 24, "fp16")
    copies = [a.copy() for a in (x, w, b, r)]
    _quiet(fdpp.flat_gemm, x, w, bias=b, residual=r, rms_eps=EPS)
    for a, c in zip((x, w, b, r), copies, strict=True):
        np.testing.assert_array_equal(a, c)


# ---- GPU ---------------------------------------------------------------------------------------
from test_gemm import _cp, _dev, _host, _poisoned  # noqa: E402 - the GEMM tests' device helpers


def _plans():
    """(plan, Ms): each kernel family, whole tiles and stream-K fix-ups."""
    F, G, P, R = gemm.FlatGemmConfig, gemm.GemvConfig, gemm.GemmPlan, gemm.FlatTmaConfig
    return [
        (P("tma", R("fp16", 4, 8, 1, 2)), (1, 9)),
        (P("tma", R("fp16", 4, 4, 1, 4), 7), (1, 16)),           # tiles split at odd places (fix-ups)
        (P("tma", R("fp16", 4, 4, 1, 2, 1)), (3, 33)),           # x in the ring, m_tiles 8
        (P("tma", R("fp16", 8, 4, 1, 2, 0, 2)), (2,)),           # two row groups
        (P("tma", R("fp16", 8, 4, 1, 2, 0, 3), 7), (5,)),        # three row groups, split
        (P("flat", F("fp16", 64, 128, 4, 4, 1), 7), (1, 17)),    # cp.async kernel, split
        (P("flat", F("fp16", 32, 256, 4, 4, 1)), (64,)),
        (P("gemv", G("fp16", 4, 2, 2, 1)), (1, 3)),
        (P("gemv", G("fp16", 8, 2, 2, 1), 5), (1,)),             # GEMV, split
    ]


def _gpu_case(rng, dt, m, n, k, plan=None, res="apart"):
    npdt = DTYPES[dt].np_dtype
    x, w, g, b, r = _inputs(rng, m, n, k, dt, bias=m % 2 == 1)
    wf = _dev(fdpp.fold_rmsnorm(w, g))
    xd, bd, rd = _dev(x), None if b is None else _dev(b), _dev(r)
    if res == "in-place":
        out = rd
        kw = {"residual": rd}
    else:
        out = _poisoned(m, n, npdt)
        kw = {"residual": rd} if res == "apart" else {}
    if plan is None:
        y = fdpp.flat_gemm(xd, wf, bias=bd, rms_eps=EPS, out=out, **kw)
    else:
        with gemm.forced_plan(plan):
            y = fdpp.flat_gemm(xd, wf, bias=bd, rms_eps=EPS, out=out, **kw)
    assert y is out
    assert_close(_host(y, npdt), _ref(x, w, g, b, r if res else None), dt)
    if res == "apart":
        np.testing.assert_array_equal(_host(rd, npdt).view(np.uint16), r.view(np.uint16))  # left as given


@pytest.mark.gpu
@pytest.mark.parametrize("plan_ms", _plans(), ids=lambda p: p[0].describe())
@pytest.mark.parametrize("dt", DTS)
def test_gpu_fused_forced_paths(rng, plan_ms, dt):
    plan, ms = plan_ms
    for n, k in ((77, 136), (4096 + 24, 4096)):
        for i, m in enumerate(ms):
            _gpu_case(rng, dt, m, n, k, plan, res=("apart", "in-place", None)[i % 3])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 8, 16])
def test_gpu_fused_where_the_table_says_cublas(rng, m):
    """llama3-8b's gate_up (N = 28672, K = 4096): the shipped H200 table gives these to cuBLAS;
    a fused call runs a kernel (cuBLAS cannot fuse) and is right."""
    _gpu_case(rng, "fp16", m, 28672, 4096, res="in-place")
    _gpu_case(rng, "fp16", m, 6144, 4096, res=None)


@pytest.mark.gpu
def test_gpu_forced_cublas_refuses_fusion(rng):
    x, w, _, _, _ = _inputs(rng, 2, 64, 64, "fp16")
    with gemm.forced_plan(gemm.GemmPlan("cublas")), pytest.raises(ValueError, match="cuBLAS cannot fuse"):
        fdpp.flat_gemm(_dev(x), _dev(w), rms_eps=EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5])
def test_gpu_fused_fp8_weights(rng, m):
    """FP8 weights (W8A16): y = (x . fp16(code)) * scale / rms + bias + residual."""
    from fdpp.quant import fp8_decode_bits

    n, k = 4096 + 24, 4096
    x, w, g, b, r = _inputs(rng, m, n, k, "fp16")
    codes, scale = fdpp.quantize_weight(fdpp.fold_rmsnorm(w, g))
    deq = fp8_decode_bits(codes.view(np.uint8), "fp8_e4m3").astype(np.float64) * scale[:, None].astype(np.float64)
    rd = _dev(r)
    y = fdpp.flat_gemm(_dev(x), _cp().asarray(codes.view(np.uint8)), w_scale=_cp().asarray(scale), bias=_dev(b),
                       residual=rd, rms_eps=EPS, out=rd)
    x64 = x.astype(np.float64)
    want = (x64 @ deq.T) / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + EPS) + b + r.astype(np.float64)
    assert_close(_host(y, np.float16), want, "fp16")


@pytest.mark.gpu
@pytest.mark.parametrize("dt", DTS)
def test_gpu_fused_torch_tensors(rng, dt):
    torch = pytest.importorskip("torch")
    x, w, g, b, r = _inputs(rng, 3, 300, 264, dt)
    tdt = torch.float16 if dt == "fp16" else torch.bfloat16

    def t(a):
        return torch.from_numpy(a.astype(np.float32)).to("cuda", tdt)

    rt = t(r)
    y = fdpp.flat_gemm(t(x), fdpp.fold_rmsnorm(t(w), t(g)), bias=t(b), residual=rt, rms_eps=EPS, out=rt)
    assert y is rt
    assert_close(y.double().cpu().numpy(), _ref(x, w, g, b, r), dt)


@pytest.mark.gpu
def test_gpu_in_place_residual_replays_from_a_graph(rng):
    """y += rmsnorm(x) @ w.T captured once, replayed twice: y holds y0 + 2 x w (each replay reads
    the y the replay before wrote)."""
    cp = _cp()
    m, n, k = 2, 4096, 4096
    x, w, g, _, r = _inputs(rng, m, n, k, "fp16", bias=False)
    xd, wf, yd = _dev(x), _dev(fdpp.fold_rmsnorm(w, g)), _dev(r)
    s = cp.cuda.Stream(non_blocking=True)
    s.wait_event(cp.cuda.get_current_stream().record())
    with s:
        fdpp.flat_gemm(xd, wf, residual=yd, rms_eps=EPS, out=yd)  # warm-up: compile, workspace (+1)
        s.begin_capture()
        fdpp.flat_gemm(xd, wf, residual=yd, rms_eps=EPS, out=yd)
        graph = s.end_capture()
        graph.launch(s)
        graph.launch(s)
        s.synchronize()
    step = _ref(x, w, g)
    got = _host(yd, np.float16).astype(np.float64)
    want = r.astype(np.float64) + 3 * step
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 5e-3, err
