"""GPU tests of fdpp.models: the fdpp decode step (torch and CuPy front ends, paged and contiguous
caches, split and no-split attention, CUDA-graph replay) against the PyTorch reference."""


import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fdpp.models.llama import LlamaDecoder  # noqa: E402
from fdpp.models.torch_ref import TorchReference, compare_logits  # noqa: E402

pytestmark = pytest.mark.gpu

# (preset, overrides): tiny, llama3-8b's shapes with 2 layers, one GPU of llama3-70b at TP 8
# (1 layer), qwen2.5-7b's (GQA 7, q/k/v bias; 1 layer)
SHAPES = {
    "tiny": ("tiny", {}),
    "llama3-8b-2l": ("llama3-8b", {"num_layers": 2}),
    "llama3-70b-tp8-1l": ("llama3-70b", {"num_layers": 1, "tp": 8}),
    "qwen2.5-7b-1l": ("qwen2.5-7b", {"num_layers": 1, "vocab": 32000}),
}
FP16_TOL = 1e-2  # max |fdpp - reference| / max(1, max |reference|) per step


@pytest.fixture(autouse=True)
def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")


def _model(name, batch=2, max_seqlen=1024, **kw):
    preset, over = SHAPES[name]
    return LlamaDecoder(preset, batch, max_seqlen, **{**over, **kw})


def _assert_close_steps(rows, tol=FP16_TOL):
    for r in rows:
        rel = r["max_abs"] / max(1.0, r["scale"])
        assert rel < tol, f"step {int(r['step'])}: max error {r['max_abs']:.4g} (scale {r['scale']:.3g})"
        if r["margin"] > 4 * r["max_abs"]:  # no near-tie: the greedy token must agree
            assert r["argmax_agree"] == 1.0, r


@pytest.mark.parametrize("name", list(SHAPES))
def test_fdpp_step_matches_torch_reference(name):
    m = _model(name)
    m.prefill_random([300, 77])
    ref = TorchReference(m)
    ref.prefill_random([300, 77])
    rows = compare_logits(m, ref, 16)
    _assert_close_steps(rows)
    assert rows[-1]["scale"] > 0.5
    np.testing.assert_array_equal(m.lengths, [316, 93])


def test_fused_and_unfused_programs_match_torch_reference():
    """The default fused program (norms in the GEMM prologues, residual adds in the o / down
    epilogues) and fuse_norms=False (norm and residual kernels), each against the reference (the
    CuPy front end's fused program: test_cupy_front_end_equals_torch_front_end)."""
    for fuse in (True, False):
        m = _model("llama3-8b-2l", fuse_norms=fuse)
        per_layer = (8 if fuse else 10) - (1 if m.fuse_rope_append else 0)  # rope + append: one op
        assert m.fuse_rope_append
        assert len(m.program) == 1 + 2 * per_layer + (1 if fuse else 2)
        m.prefill_random([300, 77])
        ref = TorchReference(m)
        ref.prefill_random([300, 77])
        _assert_close_steps(compare_logits(m, ref, 8))


@pytest.mark.parametrize("backend", ["torch", "cupy"])
def test_graph_replay_equals_eager(backend):
    # cupy failed in runs F1 and G1 (logits 1-10 % apart): the non-blocking capture stream read the
    # prefill still being written on the null stream; fixed in 4ee8786 (capture waits for the work
    # queued before it). No wrong-value failure since in the suite logs under results/ (run X1's
    # was out of memory).
    eager = _model("llama3-8b-2l", backend=backend)
    graph = _model("llama3-8b-2l", backend=backend)
    for m in (eager, graph):
        m.prefill_random([500, 123])
    step = graph.capture([5, 6])  # runs one eager step of these tokens first
    eager.step([5, 6])
    rng = np.random.default_rng(0)
    for _ in range(12):
        ids = rng.integers(0, eager.dims["vocab"], 2)
        want = eager.ops.to_numpy(eager.step(ids)).astype(np.float32)
        got = graph.ops.to_numpy(step(ids)).astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(graph.lengths, eager.lengths)


def test_torch_reference_graph_equals_eager():
    m = _model("tiny")
    ref_e, ref_g = TorchReference(m), TorchReference(m)
    for r in (ref_e, ref_g):
        r.prefill_random([40, 9])
    g = ref_g.capture([3, 4])
    ref_e.step([3, 4])
    for ids in ([1, 2], [7, 8], [9, 10]):
        np.testing.assert_allclose(g(ids).float().cpu().numpy(), ref_e.step(ids).float().cpu().numpy(),
                                   rtol=2e-3, atol=2e-3)


def test_captured_fdpp_matches_captured_reference():
    m = _model("llama3-8b-2l", batch=1)
    m.prefill_random(700)
    ref = TorchReference(m)
    ref.prefill_random(700)
    ds, rs = m.capture([11]), ref.capture([11])
    _assert_close_steps(compare_logits(m, ref, 16, decoder_step=ds, reference_step=rs))


@pytest.mark.parametrize("cache", ["contiguous-split", "contiguous-nosplit"])
def test_contiguous_and_nosplit_equal_paged_split(cache):
    paged = _model("llama3-8b-2l")
    other = _model("llama3-8b-2l", cache="contiguous", nosplit=cache.endswith("nosplit"), weights=paged.weights)
    for m in (paged, other):
        m.prefill_random([900, 31])
    for ids in ([1, 2], [3, 4], [5, 6], [7, 8]):
        a = paged.step(ids).float()
        b = other.step(ids).float()
        assert float((a - b).abs().max()) / max(1.0, float(a.abs().max())) < 5e-3


def test_cupy_front_end_equals_torch_front_end():
    tm = _model("llama3-8b-2l", backend="torch")
    cm = _model("llama3-8b-2l", backend="cupy")
    for k in ("embed", "layers.1.wqkv", "lm_head"):  # one generator: the same bits on both
        np.testing.assert_array_equal(tm.ops.to_numpy(tm.weights[k]), cm.ops.to_numpy(cm.weights[k]))
    for m in (tm, cm):
        m.prefill_random([256, 1000])
    for ids in ([1, 2], [3, 4], [5, 6]):
        a = tm.ops.to_numpy(tm.step(ids)).astype(np.float32)
        b = cm.ops.to_numpy(cm.step(ids)).astype(np.float32)
        assert np.abs(a - b).max() / max(1.0, np.abs(a).max()) < 5e-3


def test_bf16_step_matches_reference():
    m = _model("tiny", dtype="bf16")
    m.prefill_random(200)
    ref = TorchReference(m)
    ref.prefill_random(200)
    _assert_close_steps(compare_logits(m, ref, 8), tol=6e-2)


@pytest.mark.parametrize("kv_format,tol", [("fp8_e4m3", 0.1), ("fp8_e5m2", 0.15), ("int4", 0.3)])
def test_quantized_kv_formats(kv_format, tol):
    m = _model("tiny", kv_format=kv_format)
    base = _model("tiny", weights=m.weights)
    for x in (m, base):
        x.prefill_random(300)
    for ids in ([1, 2], [3, 4]):
        a, b = base.step(ids).float(), m.step(ids).float()
        assert float((a - b).abs().max()) / max(1.0, float(a.abs().max())) < tol


# one rounding of the output dtype (the reduction order of RMSNorm differs from NumPy's)
_OP_TOL = {"fp16": 2.0 ** -10, "bf16": 2.0 ** -7, "fp32": 1e-5}


@pytest.mark.parametrize("backend,dtype", [("torch", "fp16"), ("torch", "bf16"), ("torch", "fp32"), ("cupy", "fp16")])
def test_model_op_kernels_match_the_numpy_ops(backend, dtype):
    """kernels_cu/model_ops.cu (every elementwise op of the step) against the NumPy front end on
    the same inputs, outputs poisoned first; odd sizes (rows 3, hidden 1000, 7 heads)."""
    from fdpp.models._backends import make_ops, rope_tables

    ops, ref = make_ops(backend, dtype), make_ops("numpy", dtype)
    rng = np.random.default_rng(7)
    dt = ref.dtype

    def dev(a):
        if backend == "torch" and a.dtype == dt:  # through float32: torch.from_numpy takes no bfloat16
            return torch.from_numpy(a.astype(np.float32)).to(ops.tdev).to(ops.dtype)
        return ops.from_numpy(np.ascontiguousarray(a))

    def pair(a):
        a = np.ascontiguousarray(a)
        return dev(a), a

    def poisoned(shape):
        a = np.full(shape, np.nan, dtype=dt)
        return dev(a), a.copy()

    def check(got, want, exact=False):
        g, w = ops.to_numpy(got).astype(np.float64), np.asarray(want).astype(np.float64)
        assert not np.isnan(g).any()
        if exact:
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=_OP_TOL[dtype], atol=_OP_TOL[dtype])

    b, hidden, hq, hkv, d, inter, n_max = 3, 1000, 7, 1, 64, 777, 40
    x, xh = pair((rng.standard_normal((b, hidden)) * 3).astype(dt))
    w, wh = pair(rng.standard_normal(hidden).astype(dt))
    out, outh = poisoned((b, hidden))
    ops.rmsnorm(x, w, 1e-5, out)
    ref.rmsnorm(xh, wh, 1e-5, outh)
    check(out, outh)
    xl, xlh = pair(rng.standard_normal((2, 9000)).astype(dt))  # past the elements rmsnorm keeps in registers
    wl, wlh = pair(rng.standard_normal(9000).astype(dt))
    outl, outlh = poisoned((2, 9000))
    ops.rmsnorm(xl, wl, 1e-5, outl)
    ref.rmsnorm(xlh, wlh, 1e-5, outlh)
    check(outl, outlh)

    cos, sin = rope_tables(64, d, 10000.0)
    qkv, qkvh = pair(rng.standard_normal((b, (hq + 2 * hkv) * d)).astype(dt))
    lens, lensh = pair(np.array([1, 17, 99], np.int32))  # 99 > 64 positions: clamped
    cs = [dev(t) for t in (cos, sin)]
    q, qh = poisoned((b, hq, d))
    k, kh = poisoned((b, hkv, d))
    v, vh = poisoned((b, hkv, d))
    ops.rope_qkv(qkv, *cs, lens, q, k, v)
    ref.rope_qkv(qkvh, cos, sin, lensh, qh, kh, vh)
    check(q, qh, exact=True)  # float32, each product and sum rounded on its own (kernels_cu/rope.cuh)
    check(k, kh, exact=True)
    check(v, vh, exact=True)

    gu, guh = pair(rng.standard_normal((b, 2 * inter)).astype(dt))
    act, acth = poisoned((b, inter))
    ops.silu_mul(gu, act)
    ref.silu_mul(guh, acth)
    check(act, acth)

    y, yh = pair(rng.standard_normal((b, hidden)).astype(dt))
    ops.add_(x, y)
    ref.add_(xh, yh)
    check(x, xh)

    # the residual add fused with the RMSNorm after it: against NumPy, and bit for bit against the
    # two kernels it replaces (add_inplace, then rmsnorm), in registers and past them (n = 9000)
    for rows, n in ((b, hidden), (2, 9000)):
        x0 = (rng.standard_normal((rows, n)) * 3).astype(dt)
        r0 = rng.standard_normal((rows, n)).astype(dt)
        wn, wnh = pair(rng.standard_normal(n).astype(dt))
        (xf, xfh), (rf, rfh), (xs, _) = pair(x0), pair(r0), pair(x0)
        of, ofh = poisoned((rows, n))
        os_, _ = poisoned((rows, n))
        ops.add_rmsnorm(xf, rf, wn, 1e-5, of)
        ref.add_rmsnorm(xfh, rfh, wnh, 1e-5, ofh)
        check(xf, xfh, exact=True)
        check(of, ofh)
        check(rf, r0, exact=True)  # the residual input is read only
        ops.add_(xs, rf)
        ops.rmsnorm(xs, wn, 1e-5, os_)
        check(xf, ops.to_numpy(xs), exact=True)
        check(of, ops.to_numpy(os_), exact=True)

    table, tableh = pair(rng.standard_normal((50, hidden)).astype(dt))
    ids, idsh = pair(np.array([49, 0, 7], np.int32))
    emb, embh = poisoned((b, hidden))
    ops.embed(table, ids, emb)
    ref.embed(tableh, idsh, embh)
    check(emb, embh, exact=True)

    kc, kch = pair(np.zeros((b, n_max, hkv, d), dt))
    vc, vch = pair(np.zeros((b, n_max, hkv, d), dt))
    lens2, lens2h = pair(np.array([1, 40, 41], np.int32))  # 41: past the cache, nothing written
    ops.contiguous_append(kc, vc, k, v, lens2)
    kch2, vch2 = kch.copy(), vch.copy()
    ref.contiguous_append(kch2[:2], vch2[:2], kh[:2], vh[:2], lens2h[:2])
    check(kc, kch2)
    check(vc, vch2, exact=True)

    # RoPE with the contiguous append fused in: rope_qkv, then contiguous_append, bit for bit
    kc3, kc3h = pair(np.zeros((b, n_max, hkv, d), dt))
    vc3, vc3h = pair(np.zeros((b, n_max, hkv, d), dt))
    q3, q3h = poisoned((b, hq, d))
    ops.rope_qkv_append(qkv, *cs, lens2, q3, kc3, vc3)
    k3h, v3h = np.empty((b, hkv, d), dt), np.empty((b, hkv, d), dt)
    ref.rope_qkv(qkvh, cos, sin, lens2h, q3h, k3h, v3h)
    ref.contiguous_append(kc3h[:2], vc3h[:2], k3h[:2], v3h[:2], lens2h[:2])  # row 2: past the cache
    check(q3, q3h, exact=True)
    check(kc3, kc3h, exact=True)
    check(vc3, vc3h, exact=True)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("backend", ["torch", "cupy"])
def test_fp8_weights_match_the_reference_of_the_dequantised_weights(backend, fuse):
    """weight_format="fp8_e4m3": the step (eager and captured) against the PyTorch reference whose
    projections are the FP8 weights dequantised to fp16 (code * scale), so the tolerance measures the
    kernels, not the quantisation. Fused, the codes hold the norm-folded weights: the reference gets
    unit norms in front of them (and the folded LM head)."""
    m8 = _model("llama3-8b-2l", backend=backend, weight_format="fp8_e4m3", fuse_norms=fuse)
    deq = {}
    for name, w in m8.weights.items():
        if name in m8.fp8_weights:
            codes, scale = (torch.as_tensor(a, device="cuda") for a in m8.fp8_weights[name])
            w = (codes.view(torch.uint8).view(torch.float8_e4m3fn).float() * scale[:, None]).half()
        elif fuse and name.endswith("norm"):
            w = torch.ones(tuple(w.shape), dtype=torch.float16)
        elif fuse and name == "lm_head":
            w = m8.gemm_weights[name]
        deq[name] = torch.as_tensor(w, device="cuda")
    md = _model("llama3-8b-2l", weights=deq)  # torch front end, fp16 weights = the dequantised ones
    for x in (m8, md):
        x.prefill_random([300, 77])
    ref = TorchReference(md)
    ref.prefill_random([300, 77])
    step = m8.capture([2, 3])
    ref.step([2, 3])
    rows = compare_logits(m8, ref, 8, decoder_step=lambda ids: torch.as_tensor(step(ids), device="cuda"))
    _assert_close_steps(rows)
    assert rows[-1]["scale"] > 0.5
