"""FP8 weights in fdpp.flat_gemm (W8A16: E4M3 codes, a float32 scale per row of w, fp16 x):
fdpp.quantize_weight, the variants, the table keys, validation and the NumPy path (CPU), and the
bulk-copy kernel's w8 variants against a float64 reference of the dequantised weights (GPU,
``-m gpu``; outputs poisoned with NaN first).
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

import fdpp
from fdpp import gemm, registry
from fdpp.configs import SM80, SM90
from fdpp.quant import fp8_decode_bits
from fdpp.reference import assert_close

E4M3 = ml_dtypes.float8_e4m3fn


def _quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fn(*a, **kw)


def _dequant(codes, scale):
    """float64 weights of FP8 codes (any 1-byte dtype) and their row scales."""
    c = np.asarray(codes).view(np.uint8)
    return fp8_decode_bits(c, "fp8_e4m3").astype(np.float64) * np.asarray(scale, np.float64)[:, None]


def _ref64(x, wd, b=None):
    y = x.astype(np.float64) @ wd.T
    return y if b is None else y + b.astype(np.float64)


# ---- quantize_weight ---------------------------------------------------------------------------
@pytest.mark.parametrize("dt", [np.float16, np.float32, ml_dtypes.bfloat16])
def test_quantize_weight_rows(rng, dt):
    w = (rng.standard_normal((37, 96)) * rng.uniform(0.01, 10, (37, 1))).astype(dt)
    w[5] = 0  # an all-zero row: scale 1, codes 0
    codes, scale = fdpp.quantize_weight(w)
    assert codes.dtype == E4M3 and codes.shape == (37, 96) and scale.dtype == np.float32 and scale.shape == (37,)
    w32 = w.astype(np.float32)
    amax = np.abs(w32).max(axis=1)
    want = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
    assert np.array_equal(scale, want)
    # codes: round to nearest even of w / scale (ml_dtypes), the largest magnitude of a row at 448
    exp = np.clip(w32 / want[:, None], -448, 448).astype(E4M3)
    assert np.array_equal(codes.view(np.uint8), exp.view(np.uint8))
    assert np.all(np.abs(codes.astype(np.float32)).max(axis=1)[amax > 0] == 448)
    # relative error of a dequantised weight: at most half an E4M3 step (2^-4) of its row's scale
    err = np.abs(_dequant(codes, scale) - w32) / np.maximum(np.abs(w32), want[:, None] * 2.0 ** -6)
    assert err.max() <= 2.0 ** -4 + 1e-6


def test_quantize_weight_bad_arguments(rng):
    with pytest.raises(ValueError, match="fmt"):
        fdpp.quantize_weight(np.zeros((4, 16), np.float16), "int4")
    with pytest.raises(ValueError, match=r"shape \[N, K\]"):
        fdpp.quantize_weight(np.zeros(16, np.float16))
    with pytest.raises(ValueError, match=r"shape \[N, K\]"):
        fdpp.quantize_weight(np.zeros((0, 16), np.float16))
    with pytest.raises(ValueError, match="K \\(w's last axis\\) must be a multiple of 16"):
        fdpp.quantize_weight(np.zeros((4, 24), np.float16))  # a multiple of 8 that flat_gemm's w8 kernels refuse
    with pytest.raises(ValueError, match="^w holds non-finite .* in a row: no finite fp8 w_scale"):  # not quantize_kv's k
        fdpp.quantize_weight(np.full((2, 16), np.inf, np.float16))
    with pytest.raises(TypeError, match="^w dtype must be"):
        fdpp.quantize_weight(np.zeros((2, 16), np.float64))
    with pytest.raises(TypeError, match="^w must be a NumPy array"):
        fdpp.quantize_weight([[0.0] * 16] * 2)


# ---- variants and table --------------------------------------------------------------------------
def test_w8_variants_keys_and_layout():
    c = gemm.FlatTmaConfig("fp16", 8, 8, 1, 2, 0, 1, 1)
    assert c.name_expression() == "fdpp::flat_tma<fdpp::half_t,8,8,1,2,0,1,1>"
    assert c.key == "flat_tma.f16.w8.s8.m1.r2.x0.g1.e4m3"
    assert gemm.FlatTmaConfig("fp16", 8, 8, 1, 2).key == "flat_tma.f16.w8.s8.m1.r2.x0.g1"
    # 2 stages x 16 rows x (2048 + 32) B + 8 warps x 8 rows x 20 floats
    assert c.smem_bytes() == 2 * 16 * 2080 + 8 * 8 * 20 * 4
    cx = gemm.FlatTmaConfig("fp16", 4, 4, 1, 2, 1, 2, 1)  # x rows in the ring: 16-bit pitch
    assert cx.smem_bytes() == 2 * (32 * (512 + 32) + 8 * (1024 + 64)) + 4 * 8 * 36 * 4
    assert "fp16 activations" in gemm.FlatTmaConfig("bf16", 8, 8, 1, 2, 0, 1, 1).check(SM90)
    assert "sm_90" in c.check(SM80)
    space = gemm.tma_space("fp16", w8=1)
    assert space and all(s.w8 == 1 and s.is_valid(SM90) for s in space)
    assert gemm.tma_space("bf16", w8=1) == []
    assert set(space) <= set(gemm.compile_space("fp16"))
    assert {s.m_tiles for s in space} == {1, 2, 4, 8}


def test_w8_heuristic_and_arch_rule():
    for m in (1, 3, 8, 9, 16, 33, 64):
        p = gemm.choose(m, 6144, 4096, SM90, "fp16", table=gemm.GemmTable({}), wfmt="e4m3")
        assert p.impl == "tma" and p.config.w8 == 1 and p.config.fits(m) and p.source == "heuristic"
    with pytest.raises(ValueError, match="bulk-copy kernel only"):
        gemm.heuristic_plan(1, 4096, 4096, "fp16", SM80, wfmt="e4m3")


def test_w8_table_entries_are_their_own(tmp_path):
    w8 = gemm.GemmPlan("tma", gemm.FlatTmaConfig("fp16", 8, 4, 1, 3, 0, 2, 1), 132)
    f16 = gemm.GemmPlan("tma", gemm.FlatTmaConfig("fp16", 8, 4, 1, 2), 256)
    path = tmp_path / gemm.table_filename(SM90.name)
    gemm.write_table(path, SM90, [
        gemm.GemmEntry.of(w8, "fp16", 4096, 4096, 1, "e4m3", time_us=7.0),
        gemm.GemmEntry.of(f16, "fp16", 4096, 4096, 1, time_us=11.0),
        gemm.GemmEntry.of(f16, "fp16", 8192, 4096, 1, "e4m3"),  # 16-bit plan, FP8 bucket
    ])
    assert gemm.table_key("fp16", 4096, 4096, 3, "e4m3") == "fp16.e4m3.n4096.k4096.m4"
    with pytest.warns(RuntimeWarning, match="weight format"):
        t = gemm.read_table(path, SM90)
    assert len(t.entries) == 2
    p = gemm.choose(2, 4096, 4096, SM90, "fp16", table=t, wfmt="e4m3")
    assert p.source == "table" and p.config == gemm.FlatTmaConfig("fp16", 8, 4, 1, 3, 0, 2, 1) and p.grid == 132
    q = gemm.choose(2, 4096, 4096, SM90, "fp16", table=t)
    assert q.config.w8 == 0 and q.grid == 256
    # FP8 weights never borrow a bf16 entry or a 16-bit plan, and bf16 calls never take a w8 plan
    assert gemm.choose(1, 8192, 4096, SM90, "fp16", table=t, wfmt="e4m3").source == "heuristic"
    assert gemm.choose(1, 4096, 4096, SM90, "bf16", table=t).config.w8 == 0


def test_forced_plan_must_match_the_weight_format():
    w8 = gemm.GemmPlan("tma", gemm.FlatTmaConfig("fp16", 8, 8, 1, 2, 0, 1, 1))
    with gemm.forced_plan(w8):
        assert gemm.choose(3, 64, 64, SM90, "fp16", wfmt="e4m3").config.w8 == 1
        with pytest.raises(ValueError, match="weight format"):
            gemm.choose(3, 64, 64, SM90, "fp16")
    with gemm.forced_plan(gemm.GemmPlan("tma", gemm.FlatTmaConfig("fp16", 8, 8, 1, 2))):
        with pytest.raises(ValueError, match="weight format"):
            gemm.choose(3, 64, 64, SM90, "fp16", wfmt="e4m3")
    with gemm.forced_plan(gemm.GemmPlan("cublas")):
        with pytest.raises(ValueError, match="cublas"):
            gemm.choose(3, 64, 64, SM90, "fp16", wfmt="e4m3")


def test_w8_variants_compile_without_spills():
    pytest.importorskip("cuda.bindings.nvrtc")
    space = gemm.tma_space("fp16", w8=1)
    rep = registry.compile_offline(space[::3], "sm_90")
    assert set(rep) == {c.key for c in space[::3]}
    bad = {k: r for k, r in rep.items() if r.spill_stores or r.spill_loads or r.stack_bytes}
    assert not bad, bad


# ---- validation and the NumPy path -------------------------------------------------------------
def _arrays(rng, m=3, n=5, k=32):
    x = rng.standard_normal((m, k)).astype(np.float16)
    codes, scale = fdpp.quantize_weight((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16))
    return x, codes, scale, rng.standard_normal(n).astype(np.float16)


@pytest.mark.parametrize("mutate, exc, words", [
    (lambda x, c, s, b: (x, c, {}), TypeError, "pass their w_scale"),
    (lambda x, c, s, b: (x, c.view(np.uint8), {}), TypeError, "pass their w_scale"),
    (lambda x, c, s, b: (x, c, {"w_scale": s.astype(np.float16)}), TypeError, "w_scale must be float32"),
    (lambda x, c, s, b: (x, c, {"w_scale": s[:4]}), ValueError, r"w_scale must have shape \[N\]"),
    (lambda x, c, s, b: (x, c, {"w_scale": s[None]}), ValueError, r"w_scale must have shape \[N\]"),
    (lambda x, c, s, b: (x, c.astype(np.float16), {"w_scale": s}), TypeError, "FP8 E4M3 codes"),
    (lambda x, c, s, b: (x.astype(ml_dtypes.bfloat16), c, {"w_scale": s}), TypeError, "take fp16 x"),
    (lambda x, c, s, b: (x[:, :24], c[:, :24], {"w_scale": s}), ValueError, "multiple of 16"),
    (lambda x, c, s, b: (x, c, {"w_scale": s.tolist()}), TypeError, "w_scale must be the same array type"),
    (lambda x, c, s, b: (x, c, {"w_scale": s, "bias": b.astype(np.float32)}), TypeError, "bias dtype"),
    (lambda x, c, s, b: (x, c, {"w_scale": np.where(np.arange(len(s)) == 2, np.nan, s).astype(np.float32)}),
     ValueError, "w_scale must be finite"),
    (lambda x, c, s, b: (x, c, {"w_scale": np.full_like(s, np.inf)}), ValueError, "w_scale must be finite"),
])
def test_bad_fp8_arguments(rng, mutate, exc, words):
    x, w, kw = mutate(*_arrays(rng))
    with pytest.raises(exc, match=words):
        _quiet(gemm.flat_gemm, x, w, **kw)


@pytest.mark.parametrize("m, n, k", [(1, 77, 144), (3, 5, 16), (17, 130, 80), (64, 33, 272)])
@pytest.mark.parametrize("codes_as", ["float8", "uint8"])
def test_numpy_path_vs_float64(rng, m, n, k, codes_as):
    x, codes, scale, b = _arrays(rng, m, n, k)
    w = codes if codes_as == "float8" else codes.view(np.uint8)
    keep = (w.copy(), scale.copy(), x.copy())
    y = _quiet(gemm.flat_gemm, x, w, w_scale=scale, bias=b)
    assert isinstance(y, np.ndarray) and y.dtype == np.float16 and y.shape == (m, n)
    assert_close(y, _ref64(x, _dequant(codes, scale), b), "fp16")
    assert np.array_equal(w, keep[0]) and np.array_equal(scale, keep[1]) and np.array_equal(x, keep[2])


def test_exported():
    assert fdpp.quantize_weight is fdpp.quant.quantize_weight


# ---- GPU ------------------------------------------------------------------------------------------
def _cp():
    import cupy

    return cupy


def _run(rng, m, n, k, plan=None, with_bias=True, spread=False):
    """One flat_gemm on FP8 weights (CuPy, output poisoned) against the float64 reference."""
    cp = _cp()
    r = np.random.default_rng(n * 31 + k)
    w = (r.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16)
    if spread:  # rows of very different magnitudes: each row's scale matters
        w = (w * np.exp2(r.integers(-12, 8, (n, 1)))).astype(np.float16)
    codes, scale = fdpp.quantize_weight(cp.asarray(w))
    x = rng.standard_normal((m, k)).astype(np.float16)
    b = r.standard_normal(n).astype(np.float16) if with_bias else None
    out = cp.full((m, n), 0xFFFF, dtype=cp.uint16).view(cp.float16)
    bd = None if b is None else cp.asarray(b)
    if plan is None:
        y = gemm.flat_gemm(cp.asarray(x), codes, w_scale=scale, bias=bd, out=out)
    else:
        with gemm.forced_plan(plan):
            y = gemm.flat_gemm(cp.asarray(x), codes, w_scale=scale, bias=bd, out=out)
    assert y is out
    ref = _ref64(x, _dequant(cp.asnumpy(codes), cp.asnumpy(scale)), b)
    got = cp.asnumpy(y)
    assert_close(got, ref, "fp16")
    return got


def _w8_plans():
    R, P = gemm.FlatTmaConfig, gemm.GemmPlan
    return [
        (P("tma", R("fp16", 8, 8, 1, 2, 0, 1, 1)), (1, 9)),          # the heuristic's shape
        (P("tma", R("fp16", 4, 16, 1, 2, 0, 1, 1)), (2, 8)),          # 4 warps x 16 steps (m_tiles 1 only)
        (P("tma", R("fp16", 8, 4, 1, 4, 0, 1, 1), 7), (1, 17)),       # 1 KB copies, tiles split at odd places
        (P("tma", R("fp16", 8, 8, 1, 3, 0, 2, 1), 5), (3, 12)),       # two row groups, split tiles, m_tiles 2
        (P("tma", R("fp16", 8, 8, 1, 2, 1, 1, 1)), (1, 12)),          # x bulk-copied into the ring
        (P("tma", R("fp16", 8, 2, 1, 2, 1, 1, 1)), (33, 64)),         # ... 512-column tiles, m_tiles 8
        (P("tma", R("fp16", 8, 8, 1, 2, 0, 3, 1)), (1, 9)),           # three row groups (48-row tiles)
        (P("tma", R("fp16", 8, 4, 1, 3, 0, 3, 1), 11), (2,)),         # ... split at odd places
        (P("tma", R("fp16", 8, 8, 1, 2, 1, 2, 1), 1), (5,)),          # one CTA does everything
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("plan_ms", _w8_plans(), ids=lambda p: p[0].describe())
def test_gpu_w8_forced_paths(rng, plan_ms):
    plan, ms = plan_ms
    # N not a multiple of the tile, K not a multiple of the 2048-column block, one row, tiny K
    for n, k in ((77, 144), (4096 + 24, 4096 + 16), (1, 16), (300, 2048 * 3)):
        for m in ms:
            _run(rng, m, n, k, plan, with_bias=(m % 2 == 1))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 33, 64])
def test_gpu_w8_dispatch_llama_shapes(rng, m):
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336)):
        _run(rng, m, n, k, spread=(m == 1))


@pytest.mark.gpu
def test_gpu_w8_split_is_deterministic(rng):
    cp = _cp()
    plan = gemm.GemmPlan("tma", gemm.FlatTmaConfig("fp16", 8, 4, 1, 3, 0, 1, 1), 333)
    codes, scale = fdpp.quantize_weight(cp.asarray((np.random.default_rng(1).standard_normal((4120, 4096)) / 64)
                                                   .astype(np.float16)))
    x = cp.asarray(rng.standard_normal((5, 4096)).astype(np.float16))
    with gemm.forced_plan(plan):
        y1 = cp.asnumpy(gemm.flat_gemm(x, codes, w_scale=scale))
        y2 = cp.asnumpy(gemm.flat_gemm(x, codes, w_scale=scale))
    assert np.array_equal(y1.view(np.uint16), y2.view(np.uint16))


@pytest.mark.gpu
def test_gpu_w8_torch_and_graph(rng):
    torch = pytest.importorskip("torch")
    w = (torch.randn(300, 272, device="cuda") / 16).half()
    codes, scale = fdpp.quantize_weight(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (300,)
    x = torch.randn(5, 272, device="cuda").half()
    b = torch.randn(300, device="cuda").half()
    ref = x.double() @ (codes.double() * scale.double()[:, None]).T + b.double()
    y = gemm.flat_gemm(x, codes, w_scale=scale, bias=b)
    assert y.dtype == torch.float16 and y.shape == (5, 300)
    assert_close(y.double().cpu().numpy(), ref.cpu().numpy(), "fp16")
    from fdpp import torch_ops  # noqa: F401 - registers torch.ops.fdpp.*; flat_gemm takes w_scale too
    yo = torch.ops.fdpp.flat_gemm(x, codes, b, scale)
    assert torch.equal(yo, y)
    out = torch.full((5, 300), float("nan"), device="cuda", dtype=torch.float16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemm.flat_gemm(x, codes, w_scale=scale, bias=b, out=out)  # warm-up: compile, workspace
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            gemm.flat_gemm(x, codes, w_scale=scale, bias=b, out=out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert_close(out.double().cpu().numpy(), ref.cpu().numpy(), "fp16")


@pytest.mark.gpu
def test_gpu_w8_numpy_in_numpy_out_and_validation(rng):
    cp = _cp()
    x, codes, scale, b = _arrays(rng, 3, 70, 64)
    y = gemm.flat_gemm(x, codes, w_scale=scale, bias=b)
    assert isinstance(y, np.ndarray)
    assert_close(y, _ref64(x, _dequant(codes, scale), b), "fp16")
    cd, sd = cp.asarray(codes.view(np.uint8)), cp.asarray(scale)
    with pytest.raises(ValueError, match="16-byte aligned"):  # a row stride of 72 bytes
        gemm.flat_gemm(cp.zeros((2, 64), cp.float16), cp.zeros((70, 72), cp.uint8)[:, :64], w_scale=sd)
    with pytest.raises(ValueError, match="w_scale must be contiguous"):
        gemm.flat_gemm(cp.zeros((2, 64), cp.float16), cd, w_scale=cp.zeros(140, cp.float32)[::2])
    with pytest.raises(TypeError, match="same array type"):
        gemm.flat_gemm(cp.zeros((2, 64), cp.float16), cd, w_scale=scale)


def test_bench_summary_reports_fp8_rows():
    from fdpp import bench_gemm

    base = {"model": "llama3-8b", "layer": "o", "M": 1, "N": 4096, "K": 4096, "dtype": "fp16", "gpu": "x",
            "p10_us": 0, "p90_us": 0, "gbps": 0, "max_rel_err": 3e-4}
    rows = [{**base, "impl": "fdpp", "time_us": 11.0, "floor_us": 10.5, "pct_floor": 95.5, "speedup": 1.25,
             "plan": "flat_tma"},
            {**base, "impl": "cublas", "time_us": 13.75, "floor_us": 10.5, "pct_floor": 76.4, "speedup": 1.0,
             "plan": "torch.addmm"},
            {**base, "impl": "fdpp-fp8", "time_us": 7.5, "floor_us": 7.4, "pct_floor": 98.7, "speedup": 1.833,
             "plan": "flat_tma.e4m3"}]
    text = bench_gemm.summary(rows)
    line = next(ln for ln in text.splitlines() if ln.startswith("o") and "flat_tma.e4m3" in ln)
    assert line.split()[2:7] == ["7.50", "7.40", "98.7", "1.833", "1.467"]  # 11.0 / 7.5 over fdpp's 16-bit row
    assert "FP8 weights" in text


def test_bench_floor_and_rows_helpers(monkeypatch):
    """bench_gemm's shared pieces on stand-ins: the floor is measured once per key and scaled by
    bytes; each plan's row carries its own floor and error; a plan that raises is skipped."""
    import types

    from fdpp import bench_gemm, gemm_tune, timing

    calls = []
    monkeypatch.setattr(timing, "time_stream_read",
                        lambda nbytes, repeats: calls.append(nbytes) or types.SimpleNamespace(median_us=10.0))
    monkeypatch.setattr(bench_gemm, "_FLOORS", {})
    args = types.SimpleNamespace(no_floor=False, repeats=3, calls_per_replay=20)
    assert bench_gemm._floor_us((8, 8, "e4m3"), 1000, args) == 10.0
    assert bench_gemm._floor_us((8, 8, "e4m3"), 2000, args) == 20.0  # scaled, not measured again
    assert calls == [1000]
    assert bench_gemm._floor_us((8, 8, "fp16"), 500, args) == 10.0 and calls == [1000, 500]
    nf = types.SimpleNamespace(no_floor=True)
    assert bench_gemm._floor_us((1, 1, "x"), 4.49e6, nf) == pytest.approx(1.0)

    def run(plan, s):
        if plan == "bad":
            raise RuntimeError("cannot run")
        return np.array([1.0001, 2.0]) * s

    def timed(us):
        return types.SimpleNamespace(median_us=us, p10_us=us - 0.1, p90_us=us + 0.1)

    together = []

    def plan_impls(runs):  # stand-in implementations: the (plan, sets) pair itself
        return [((p, s), "cupy") for p, s in runs], [f"ran {p}" for p, _ in runs]

    def round_robin(impls, **kw):  # one interleaved timing of every plan that ran, whatever its group
        together.append([im[0] for im in impls])
        if any(p == "uncapturable" for (p, _), _ in impls):
            raise RuntimeError("capture failed")
        return [timed(5.0 * s[0]) for (_, s), _ in impls]

    monkeypatch.setattr(gemm_tune, "run_plan", run)
    monkeypatch.setattr(gemm_tune, "plan_impls", plan_impls)
    monkeypatch.setattr(timing, "time_round_robin", round_robin)
    base = {"layer": "o", "M": 1}
    g16 = bench_gemm._Group([("a", "good"), ("b", "bad")], [1.0], np.array([1.0, 2.0]), 5000, 4.0)
    g8 = bench_gemm._Group([("c", "fp8")], [2.0], np.array([2.0, 4.0]), 2000, 2.0)
    rows = bench_gemm._timed_rows([g16, g8], base, args)
    assert together == [[("good", [1.0]), ("fp8", [2.0])]]  # both groups in one round-robin timing
    assert [r["impl"] for r in rows] == ["a", "c"]
    r = rows[0]
    assert (r["floor_us"], r["time_us"], r["pct_floor"], r["gbps"], r["max_rel_err"], r["plan"]) == \
        (4.0, 5.0, 80.0, 1.0, pytest.approx(0.5e-4), "ran good")
    r = rows[1]  # its own group's floor, bytes and reference
    assert (r["floor_us"], r["time_us"], r["pct_floor"], r["gbps"], r["max_rel_err"]) == \
        (2.0, 10.0, 20.0, 0.2, pytest.approx(0.5e-4))
    g16.todo.append(("d", "uncapturable"))  # the joint timing fails: each plan alone, the culprit skipped
    together.clear()
    rows = bench_gemm._timed_rows([g16], base, args)
    assert [(r["impl"], r["plan"]) for r in rows] == [("a", "ran good [timed alone]")]
    assert together == [[("good", [1.0]), ("uncapturable", [1.0])], [("good", [1.0])], [("uncapturable", [1.0])]]
