"""fdpp.merge_states / merge_state_ on the GPU (CuPy and torch) against the independent float64
reference (fdpp.reference.merge_states_reference) and against fdpp.decode_attention over the
whole cache (run on the H200).

Every output is poisoned (NaN) before the call, so an unwritten element fails. The references run
through NumPy / CuPy (never an fdpp kernel).
"""

import itertools

import numpy as np
import pytest

import fdpp
from fdpp.dtypes import DTYPES
from fdpp.reference import assert_close, attention_reference, merge_states_reference

pytestmark = pytest.mark.gpu

DTS = ["fp16", "bf16", "fp32"]


def _cp():
    import cupy

    return cupy


def _rand(shape, dt, rng, scale=1.0):
    x = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(DTYPES[dt].np_dtype)
    return _cp().asarray(x)


def _lses(shape, rng, spread=5.0, empty=0.1):
    """float32 lse values with about ``empty`` of them -inf (empty parts)."""
    lse = (rng.standard_normal(shape) * spread).astype(np.float32)
    lse[rng.random(shape) < empty] = -np.inf
    return _cp().asarray(lse)


def _poisoned(shape, dt):
    return _cp().full(shape, np.nan, dtype=np.float32).astype(DTYPES[dt].np_dtype)


def _poisoned_lse(shape):
    return _cp().full(shape, np.nan, dtype=np.float32)


def _check(out, lse, ref, ref_lse, dt, lse_rtol=1e-5, lse_atol=1e-5):
    cp = _cp()
    assert_close(cp.asnumpy(out.astype(cp.float32)), cp.asnumpy(ref), dt)
    lse, ref_lse = cp.asnumpy(lse), cp.asnumpy(ref_lse)
    assert lse.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=lse_rtol, atol=lse_atol)


def _merge(outs, lses, dt):
    """fdpp.merge_states into poisoned outputs; returns them."""
    shape = (outs.shape[1:] if not isinstance(outs, list) else outs[0].shape)
    out, lse_out = _poisoned(shape, dt), _poisoned_lse(shape[:2])
    res, lse = fdpp.merge_states(outs, lses, out=out, lse_out=lse_out)
    assert res is out and lse is lse_out
    return out, lse


# ---- CuPy against the float64 reference ----------------------------------------------------------
GRID = list(itertools.product(DTS, [64, 128, 256], [(1, 3), (37, 40)]))


@pytest.mark.parametrize("dt, d, bh", GRID, ids=lambda x: str(x))
def test_against_reference(dt, d, bh, rng):
    cp = _cp()
    b, h = bh
    for s in (1, 2, 5):
        outs, lses = _rand((s, b, h, d), dt, rng), _lses((s, b, h), rng)
        ref, ref_lse = merge_states_reference(outs, lses)
        for o_in, l_in in ((outs, lses), (list(outs), list(lses)), (outs, list(lses))):
            out, lse = _merge(o_in, l_in, dt)
            _check(out, lse, ref, ref_lse, dt)
        res, lse = fdpp.merge_states(outs, lses)  # allocated outputs
        assert isinstance(res, cp.ndarray) and res.dtype == outs.dtype and res.shape == (b, h, d)
        assert res.flags.c_contiguous and lse.dtype == cp.float32
        _check(res, lse, ref, ref_lse, dt)


@pytest.mark.parametrize("dt", DTS)
def test_many_rows_and_parts(dt, rng):
    b, h, d, s = 1031, 64, 128, 3  # 65,984 rows: many CTAs, the last one partly filled
    outs, lses = _rand((s, b, h, d), dt, rng), _lses((s, b, h), rng)
    ref, ref_lse = merge_states_reference(outs, lses)  # float64 on the GPU through CuPy
    out, lse = _merge(outs, lses, dt)
    _check(out, lse, ref, ref_lse, dt)
    outs, lses = _rand((64, 3, 8, 64), dt, rng), _lses((64, 3, 8), rng)  # many stacked parts
    out, lse = _merge(outs, lses, dt)
    _check(out, lse, *merge_states_reference(outs, lses), dt)


@pytest.mark.parametrize("dt, d", [("fp16", 64), ("bf16", 128), ("fp32", 256), ("fp16", 96), ("fp32", 8)])
def test_noncontiguous_stacked_views(dt, d, rng):
    """Stacked inputs that are views of bigger buffers: strided in S, B and H (16-byte aligned),
    lse strided (any stride), a strided output."""
    cp = _cp()
    pad = 16 // DTYPES[dt].itemsize
    big = _rand((7, 5, 9, d + pad), dt, rng)
    outs = big[1::2, ::2, 1::2, :d]  # [3, 3, 4, d]
    lbig = _lses((3, 6, 4, 2), rng)
    lses = lbig[:, ::2, :, 1]  # [3, 3, 4]
    assert not outs.flags.c_contiguous and not lses.flags.c_contiguous
    ref, ref_lse = merge_states_reference(cp.ascontiguousarray(outs), cp.ascontiguousarray(lses))
    out, lse = _merge(outs, lses, dt)
    _check(out, lse, ref, ref_lse, dt)
    obig, lbuf = _poisoned((3, 2, 4, d + pad), dt), _poisoned_lse((4, 3))
    res, lse = fdpp.merge_states(outs, lses, out=obig[:, 1, :, :d], lse_out=lbuf.T)
    _check(res, lse, ref, ref_lse, dt)
    assert cp.isnan(obig[:, 0].astype(cp.float32)).all() and cp.isnan(obig[..., d:].astype(cp.float32)).all()


def test_inputs_not_modified(rng):
    cp = _cp()
    outs, lses = _rand((3, 4, 8, 128), "bf16", rng), _lses((3, 4, 8), rng)
    lses[0, 0, 0] = np.nan
    o0, l0 = outs.copy(), lses.copy()
    fdpp.merge_states(list(outs), lses)
    cp.cuda.get_current_stream().synchronize()
    assert cp.array_equal(outs.view(cp.uint16), o0.view(cp.uint16))
    assert cp.array_equal(lses.view(cp.uint32), l0.view(cp.uint32))


# ---- against decode_attention on the whole cache ---------------------------------------------------
@pytest.mark.parametrize("dt, d", list(itertools.product(DTS, [64, 128, 256])))
def test_split_cache_merge_equals_decode_attention(dt, d, rng):
    cp = _cp()
    b, hq, hkv, n = 6, 16, 4, 3000
    q, k, v = _rand((b, hq, d), dt, rng), _rand((b, n, hkv, d), dt, rng), _rand((b, n, hkv, d), dt, rng)
    lens = np.array([3000, 0, 1, 777, 1024, 2999])
    bounds = [(0, 1024), (1024, 1025), (1025, 2048), (2048, 3000)]
    outs, lses = [], []
    for lo, hi in bounds:
        plen = cp.asarray(np.clip(lens - lo, 0, hi - lo), dtype=cp.int32)
        o, lse = fdpp.decode_attention(q, k[:, lo:hi], v[:, lo:hi], cache_seqlens=plen, return_lse=True)
        outs.append(o)
        lses.append(lse)
    lens_d = cp.asarray(lens, dtype=cp.int32)
    out, lse = _merge(outs, lses, dt)
    ref, ref_lse = attention_reference(q, k, v, lens_d)
    _check(out, lse, ref, ref_lse, dt, lse_rtol=1e-4, lse_atol=1e-3)
    assert (out[1].astype(cp.float32) == 0).all() and bool((lse[1] == -cp.inf).all())
    whole, whole_lse = fdpp.decode_attention(q, k, v, cache_seqlens=lens_d, return_lse=True)
    _check(out, lse, whole.astype(cp.float64), whole_lse.astype(cp.float64), dt, lse_rtol=1e-4, lse_atol=1e-3)
    # the same cascade with the stacked form and with the in-place variant
    out2, lse2 = _merge(cp.stack(outs), cp.stack(lses), dt)
    assert cp.array_equal(out2, out) and cp.array_equal(lse2, lse)
    acc_o, acc_l = outs[0].copy(), lses[0].copy()
    for o, lp in zip(outs[1:], lses[1:], strict=True):
        fdpp.merge_state_(acc_o, acc_l, o, lp)
    _check(acc_o, acc_l, ref, ref_lse, dt, lse_rtol=1e-4, lse_atol=1e-3)


# ---- semantics on the device -----------------------------------------------------------------------
@pytest.mark.parametrize("dt", DTS)
def test_empty_nan_and_inf_rows(dt, rng):
    cp = _cp()
    s, b, h, d = 3, 4, 5, 128
    ho_in = rng.standard_normal((s, b, h, d)).astype(DTYPES[dt].np_dtype)  # edited on the host
    hl_in = (rng.standard_normal((s, b, h)) * 5).astype(np.float32)
    clean_o, clean_l = _merge(cp.asarray(ho_in), cp.asarray(hl_in), dt)
    hl_in[1, 0, 0] = -np.inf  # an empty part with garbage output: not read
    ho_in[1, 0, 0] = np.nan
    hl_in[:, 1, 1] = -np.inf  # every part empty
    ho_in[:, 1, 1] = np.nan
    hl_in[2, 2, 2] = np.nan  # invalid lse
    hl_in[0, 3, 4] = np.inf
    out, lse = _merge(cp.asarray(ho_in), cp.asarray(hl_in), dt)
    ho, hl = cp.asnumpy(out.astype(cp.float32)), cp.asnumpy(lse)
    assert np.isfinite(ho[0, 0]).all() and np.isfinite(hl[0, 0])
    assert (ho[1, 1] == 0).all() and np.isneginf(hl[1, 1])
    assert np.isnan(ho[2, 2]).all() and np.isnan(hl[2, 2]) and np.isnan(ho[3, 4]).all() and np.isnan(hl[3, 4])
    mask = np.ones((b, h), bool)
    mask[0, 0] = mask[1, 1] = mask[2, 2] = mask[3, 4] = False
    np.testing.assert_array_equal(ho[mask], cp.asnumpy(clean_o.astype(cp.float32))[mask])
    np.testing.assert_array_equal(hl[mask], cp.asnumpy(clean_l)[mask])
    ref, ref_lse = merge_states_reference(ho_in, hl_in)  # host float64
    keep = mask.copy()
    keep[0, 0] = True
    _check(ho[keep], hl[keep], ref[keep], ref_lse[keep], dt)
    # the NumPy path agrees on where the -inf and NaN rows are
    _, np_l = fdpp.merge_states(ho_in, hl_in)
    np.testing.assert_array_equal(np.isnan(np_l), np.isnan(hl))
    np.testing.assert_array_equal(np.isneginf(np_l), np.isneginf(hl))


def test_large_lse_gaps(rng):
    cp = _cp()
    outs = _rand((3, 2, 8, 128), "fp32", rng)
    lses = cp.asarray(np.array([80.0, -80.0, 79.0], np.float32)[:, None, None] * np.ones((3, 2, 8), np.float32))
    lses[:, 1] = cp.asarray(np.array([-80.0, 80.0, -np.inf], np.float32))[:, None]
    out, lse = _merge(outs, lses, "fp32")
    _check(out, lse, *merge_states_reference(outs, lses), "fp32")
    np.testing.assert_allclose(cp.asnumpy(out[1]), cp.asnumpy(outs[1, 1]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dt", DTS)
def test_single_part_is_identity(dt, rng):
    cp = _cp()
    outs, lses = _rand((1, 5, 8, 256), dt, rng), _lses((1, 5, 8), rng, empty=0.0)
    out, lse = _merge(outs, lses, dt)
    assert cp.array_equal(out, outs[0])
    np.testing.assert_allclose(cp.asnumpy(lse), cp.asnumpy(lses[0]), rtol=1e-7, atol=0)


@pytest.mark.parametrize("dt", DTS)
def test_merge_state_in_place_cupy(dt, rng):
    cp = _cp()
    outs, lses = _rand((2, 9, 32, 128), dt, rng), _lses((2, 9, 32), rng)
    want_o, want_l = _merge(outs, lses, dt)
    out, lse = outs[0].copy(), lses[0].copy()
    other, other_l = outs[1].copy(), lses[1].copy()
    res = fdpp.merge_state_(out, lse, other, other_l)
    assert res[0] is out and res[1] is lse
    assert cp.array_equal(out, want_o) and cp.array_equal(lse, want_l, equal_nan=True)
    assert cp.array_equal(other, outs[1]) and cp.array_equal(other_l, lses[1], equal_nan=True)


def test_device_validation(rng):
    cp = _cp()
    outs, lses = _rand((2, 2, 3, 128), "fp16", rng), _lses((2, 2, 3), rng)
    mis = cp.zeros((2, 2, 3, 129), cp.float16)[..., 1:]  # pointer off by 2 bytes
    with pytest.raises(ValueError, match="outs.*16-byte"):
        fdpp.merge_states(mis, lses)
    with pytest.raises(ValueError, match=r"outs\[1\].*16-byte"):
        fdpp.merge_states([outs[0], mis[1]], lses)
    with pytest.raises(ValueError, match="outs.*last stride 1"):
        fdpp.merge_states(cp.zeros((2, 2, 3, 256), cp.float16)[..., ::2], lses)
    with pytest.raises(ValueError, match="out.*16-byte"):
        fdpp.merge_states(outs, lses, out=cp.zeros((2, 3, 129), cp.float16)[..., 1:])
    with pytest.raises(TypeError, match="lses"):
        fdpp.merge_states(outs, cp.asnumpy(lses))
    with pytest.raises(TypeError, match=r"outs\[1\]"):
        fdpp.merge_states([outs[0], cp.asnumpy(outs[1])], list(lses))
    with pytest.raises(ValueError, match="at most 16"):
        fdpp.merge_states([outs[0]] * 17, [lses[0]] * 17)
    with pytest.raises(ValueError, match="out must not overlap"):
        fdpp.merge_states(outs, lses, out=outs[0])
    with pytest.raises(ValueError, match="out must not overlap out_other"):
        fdpp.merge_state_(outs[0], lses[0].copy(), outs[0], lses[1])
    if cp.cuda.runtime.getDeviceCount() > 1:
        with cp.cuda.Device(1):
            other = cp.zeros((2, 3), cp.float32)
        with pytest.raises(ValueError, match="one device"):
            fdpp.merge_states(outs, lses, lse_out=other)


def test_cupy_graph_capture(rng):
    cp = _cp()
    outs, lses = _rand((3, 4, 32, 128), "fp16", rng), _lses((3, 4, 32), rng)
    eager_o, eager_l = fdpp.merge_states(outs, lses)  # compiles the kernel
    out, lse = _poisoned((4, 32, 128), "fp16"), _poisoned_lse((4, 32))
    s = cp.cuda.Stream(non_blocking=True)
    s.wait_event(cp.cuda.get_current_stream().record())  # the work queued before (inputs) first
    with s:
        s.begin_capture()
        fdpp.merge_states(outs, lses, out=out, lse_out=lse)
        g = s.end_capture()
        g.launch()
    s.synchronize()
    assert cp.array_equal(out, eager_o) and cp.array_equal(lse, eager_l)
    outs[:] = _rand((3, 4, 32, 128), "fp16", rng)  # new values, same graph
    with s:
        g.launch()
    s.synchronize()
    want_o, want_l = fdpp.merge_states(outs, lses)
    assert cp.array_equal(out, want_o) and cp.array_equal(lse, want_l)


# ---- torch ----------------------------------------------------------------------------------------
def _torch_rand(torch, shape, dt, rng):
    x = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).cuda()
    return x.to({"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dt])


def _torch_lses(torch, shape, rng, empty=0.1):
    lse = (rng.standard_normal(shape) * 5).astype(np.float32)
    lse[rng.random(shape) < empty] = -np.inf
    return torch.from_numpy(lse).cuda()


def _np(t):
    return t.float().cpu().numpy()


@pytest.mark.parametrize("dt, d", list(itertools.product(DTS, [64, 128, 256])))
def test_torch_against_reference(dt, d, rng):
    torch = pytest.importorskip("torch")
    s, b, h = 3, 17, 8
    base = _torch_rand(torch, (b, s, h, d), dt, rng)
    outs = base.permute(1, 0, 2, 3)  # a non-contiguous stacked view [S, B, H, D]
    lses = _torch_lses(torch, (b, h, s), rng).permute(2, 0, 1)
    ref, ref_lse = merge_states_reference(_np(outs), _np(lses))
    out = torch.full((b, h, d), float("nan"), device="cuda", dtype=outs.dtype)
    lse_out = torch.full((b, h), float("nan"), device="cuda")
    res, lse = fdpp.merge_states(outs, lses, out=out, lse_out=lse_out)
    assert res is out and lse is lse_out
    torch.cuda.synchronize()
    assert_close(_np(out), ref, dt)
    fin = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isneginf(_np(lse)), np.isneginf(ref_lse))
    np.testing.assert_allclose(_np(lse)[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)
    res, lse2 = fdpp.merge_states(list(outs), list(lses))  # allocated: torch tensors on the device
    assert isinstance(res, torch.Tensor) and res.is_cuda and res.dtype == outs.dtype and lse2.dtype == torch.float32
    assert torch.equal(res, out) and torch.equal(lse2, lse)


def test_torch_split_cache_and_side_stream(rng):
    torch = pytest.importorskip("torch")
    q = _torch_rand(torch, (3, 32, 128), "bf16", rng)
    k, v = _torch_rand(torch, (3, 2000, 8, 128), "bf16", rng), _torch_rand(torch, (3, 2000, 8, 128), "bf16", rng)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        o1, l1 = fdpp.decode_attention(q, k[:, :700], v[:, :700], return_lse=True)
        o2, l2 = fdpp.decode_attention(q, k[:, 700:], v[:, 700:], return_lse=True)
        fdpp.merge_state_(o1, l1, o2, l2)
    s.synchronize()
    import cupy as cp

    ref, ref_lse = attention_reference(cp.from_dlpack(q), cp.from_dlpack(k), cp.from_dlpack(v))
    assert_close(_np(o1), cp.asnumpy(ref), "bf16")
    np.testing.assert_allclose(_np(l1), cp.asnumpy(ref_lse), rtol=1e-4, atol=1e-3)


def test_torch_graph_capture(rng):
    torch = pytest.importorskip("torch")
    outs = _torch_rand(torch, (2, 4, 32, 128), "fp16", rng)
    lses = _torch_lses(torch, (2, 4, 32), rng)
    eager = fdpp.merge_states(outs, lses)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fdpp.merge_states(outs, lses)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out, lse = fdpp.merge_states(outs, lses)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
    outs.copy_(_torch_rand(torch, (2, 4, 32, 128), "fp16", rng))  # new values, same graph
    g.replay()
    torch.cuda.synchronize()
    want = fdpp.merge_states(outs, lses)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_torch_ops_and_compile(rng):
    torch = pytest.importorskip("torch")
    import fdpp.torch_ops  # noqa: F401 - registers torch.ops.fdpp.*

    outs = _torch_rand(torch, (3, 4, 16, 128), "bf16", rng)
    lses = _torch_lses(torch, (3, 4, 16), rng)
    o, lse = torch.ops.fdpp.merge_states(outs, lses)
    want = fdpp.merge_states(outs, lses)
    assert torch.equal(o, want[0]) and torch.equal(lse, want[1])
    acc_o, acc_l = outs[0].clone(), lses[0].clone()
    torch.ops.fdpp.merge_state_(acc_o, acc_l, outs[1], lses[1])
    want2 = fdpp.merge_states(outs[:2], lses[:2])
    assert torch.equal(acc_o, want2[0]) and torch.equal(acc_l, want2[1])

    def step(outs, lses):
        o, lse = torch.ops.fdpp.merge_states(outs, lses)
        return o * 2, lse + 1

    full = torch.compile(step, fullgraph=True)(outs, lses)  # raises on a graph break
    assert torch.equal(full[0], want[0] * 2) and torch.equal(full[1], want[1] + 1)
    ro = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        got = ro(outs, lses)
    assert torch.equal(got[0], want[0] * 2) and torch.equal(got[1], want[1] + 1)


def test_torch_cpu_tensor_named(rng):
    torch = pytest.importorskip("torch")
    outs = _torch_rand(torch, (2, 2, 3, 64), "fp16", rng)
    with pytest.raises(TypeError, match="lses"):
        fdpp.merge_states(outs, torch.zeros(2, 2, 3))
