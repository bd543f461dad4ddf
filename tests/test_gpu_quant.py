"""The quantized-KV kernels on the GPU, bitwise against NumPy (H200).

- ``fdpp.quantize_kv`` on CuPy arrays and torch tensors (fp16 / bf16, NHD / HND, with and without
  ``cache_seqlens``, strided inputs) equals ``quantize_kv`` on the same NumPy arrays bit for bit:
  codes, descales, int4 scales and zeros (kernels_cu/quantize_kv.cu against fdpp.quant's NumPy
  path and its FP8 bit mirror).
- ``fdpp.dequantize_kv`` on the device equals NumPy's dequantization bit for bit.
- ``PagedKVCache(kv_format=...)`` on cupy / torch: the scenario of tests/test_quant_cache.py
  (extend, append, fork, free) leaves the pools and scale pools bitwise equal to the NumPy
  backend's and to NumPy's quantization of the same tokens (paged_append_quant).
- quantize_kv inside a torch CUDA graph (no host synchronisation on the device path).
"""

import itertools

import ml_dtypes
import numpy as np
import pytest

import fdpp
from fdpp import quant

pytestmark = pytest.mark.gpu

FMTS = [("fp8_e4m3", "per_head", 64), ("fp8_e4m3", "per_tensor", 64), ("fp8_e5m2", "per_head", 64),
        ("int4", "per_head", 32), ("int4", "per_head", 64), ("int4", "per_head", 128)]
NP_DT = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def _to(backend, x):
    """A NumPy array on the device (``backend`` "cupy" or "torch"), same bits."""
    if backend == "cupy":
        import cupy

        return cupy.asarray(x)
    import torch

    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x)).cuda()


def _host(x):
    """Device array -> NumPy (raw bits kept: float8 -> uint8, bf16 -> ml_dtypes)."""
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy.asnumpy(x)
    import torch

    t = x.detach().cpu()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _backend(backend):
    if backend == "torch":
        pytest.importorskip("torch")


def _cache_data(rng, shape, dt, layout, lens, fmt):
    """K/V like an LLM's: Gaussian, outlier channels, a channel of tiny values (fp8 subnormals);
    past each length, garbage (huge; -inf for fp8 of fp16) that must not reach the fp8 scales.
    (No inf for int4: its NaN scale would be a NaN whose payload bits are not specified.)"""
    k = rng.standard_normal(shape).astype(np.float32)
    k[..., 3] *= 20
    k[..., 70 % shape[-1]] *= 1e-4
    v = rng.standard_normal(shape).astype(np.float32)
    if lens is not None:
        for b, n in enumerate(lens):
            sl = (b, slice(n, None)) if layout == "NHD" else (b, slice(None), slice(n, None))
            k[sl] = 3e4
            v[sl] = -np.inf if dt == "fp16" and fmt != "int4" else -3e4
    return k.astype(NP_DT[dt]), v.astype(NP_DT[dt])


def _assert_same(qd, qn):
    assert qd.fmt == qn.fmt and qd.kv_layout == qn.kv_layout and qd.group_size == qn.group_size
    names = ("k", "v", "k_descale", "v_descale") if qn.fmt != "int4" else ("k", "v", "k_scale", "k_zero", "v_scale",
                                                                          "v_zero")
    for name in names:
        d, n = _host(getattr(qd, name)), getattr(qn, name)
        assert d.shape == n.shape, name
        np.testing.assert_array_equal(_bits(d), _bits(n), err_msg=name)


@pytest.mark.parametrize("backend", ["cupy", "torch"])
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("fmt, scale, g", FMTS, ids=lambda x: str(x))
@pytest.mark.parametrize("varlen", [False, True])
def test_quantize_kv_matches_numpy(backend, dt, layout, fmt, scale, g, varlen, rng):
    _backend(backend)
    b, n, h, d = 3, 77, 4, 128
    shape = (b, n, h, d) if layout == "NHD" else (b, h, n, d)
    lens = [41, 0, n] if varlen else None
    k, v = _cache_data(rng, shape, dt, layout, lens, fmt)
    kd, vd = _to(backend, k), _to(backend, v)
    ls = None if lens is None else _to(backend, np.asarray(lens, np.int32))
    qd = fdpp.quantize_kv(kd, vd, fmt, scale=scale, group_size=g, kv_layout=layout, cache_seqlens=ls)
    qn = fdpp.quantize_kv(k, v, fmt, scale=scale, group_size=g, kv_layout=layout, cache_seqlens=lens)
    _assert_same(qd, qn)
    np.testing.assert_array_equal(_bits(_host(kd)), _bits(k))  # inputs untouched
    if fmt != "int4":
        want = "uint8" if backend == "cupy" else ("torch.float8_e4m3fn" if fmt == "fp8_e4m3" else "torch.float8_e5m2")
        assert str(qd.k.dtype) == want and str(qd.k_descale.dtype).endswith("float32")
    # dequantization on the device: the same bits as NumPy's
    dk, dv = fdpp.dequantize_kv(qd)
    nk, nv = fdpp.dequantize_kv(qn)
    for x, y in ((dk, nk), (dv, nv)):
        assert str(x.dtype).endswith("float32")
        np.testing.assert_array_equal(_bits(_host(x)), _bits(y))


@pytest.mark.parametrize("backend", ["cupy", "torch"])
@pytest.mark.parametrize("fmt, scale, g", [FMTS[0], FMTS[1], FMTS[4]], ids=lambda x: str(x))
def test_quantize_kv_strided_and_fp32_inputs(backend, fmt, scale, g, rng):
    _backend(backend)
    full = rng.standard_normal((2, 50, 3, 64)).astype(np.float16)
    kn, vn = full[:, 5:45], full[:, 2:42]  # slices of N (aligned, strided)
    kd = _to(backend, full)[:, 5:45]
    vd = _to(backend, full)[:, 2:42]
    qd = fdpp.quantize_kv(kd, vd, fmt, scale=scale, group_size=g)
    _assert_same(qd, fdpp.quantize_kv(kn, vn, fmt, scale=scale, group_size=g))
    # a misaligned view (copied first) and fp32 input
    pad = rng.standard_normal((1, 8, 2, 64 + 1)).astype(np.float32)
    kn = pad[..., 1:]
    dev = _to(backend, pad)[..., 1:]
    _assert_same(fdpp.quantize_kv(dev, dev, fmt, scale=scale, group_size=g),
                 fdpp.quantize_kv(kn, kn, fmt, scale=scale, group_size=g))


@pytest.mark.parametrize("backend", ["cupy", "torch"])
@pytest.mark.parametrize("fmt, scale", [("fp8_e4m3", "per_head"), ("fp8_e4m3", "per_tensor"), ("fp8_e5m2", "per_head")])
def test_tiny_float32_amax_gives_the_descale_floor_on_device(backend, fmt, scale):
    """amax / FP8_MAX rounds to 0 in float32 below FP8_MAX * 2^-149: the device quantizer
    (quantize_kv.cu's descale_of) then gave a zero descale and NaN codes, as NumPy's did. Both now
    floor the descale at 2^-149 (the smallest float32 subnormal) and agree bit for bit; so does
    quantize_weight, which runs the same kernel."""
    _backend(backend)
    k = np.zeros((2, 8, 2, 64), np.float32)
    k[0, 0, 0, 0] = 1e-44  # head 0 of request 0: a tiny amax; head 1 all zero (descale 1); request 1 ordinary
    k[1] = np.linspace(-3, 3, 8 * 2 * 64, dtype=np.float32).reshape(8, 2, 64)
    v = np.ones_like(k)
    qd = fdpp.quantize_kv(_to(backend, k), _to(backend, v), fmt, scale=scale)
    qn = fdpp.quantize_kv(k, v, fmt, scale=scale)
    _assert_same(qd, qn)
    if scale == "per_head":
        assert _host(qd.k_descale)[0, 0] == np.finfo(np.float32).smallest_subnormal
        assert _host(qd.k_descale)[0, 1] == 1.0
    assert np.isfinite(fdpp.dequantize_kv(qn)[0]).all()
    w = np.ones((3, 64), np.float32)
    w[1] = 0
    w[1, 5] = 1e-44
    cd, sd = fdpp.quantize_weight(_to(backend, w))
    cn, sn = fdpp.quantize_weight(w)
    np.testing.assert_array_equal(_bits(_host(cd)), _bits(cn))
    np.testing.assert_array_equal(_bits(_host(sd)), _bits(sn))
    assert sn[1] == np.finfo(np.float32).smallest_subnormal


def test_quantize_kv_checks_on_device(rng):
    import cupy

    k = cupy.asarray(rng.standard_normal((1, 8, 2, 64)).astype(np.float16))
    bad = k.copy()
    bad[0, 3, 1, 5] = np.inf
    q = fdpp.quantize_kv(k, bad, "fp8_e4m3")  # checks off: no synchronisation, a non-finite descale
    assert not np.isfinite(cupy.asnumpy(q.v_descale)[0, 1])
    fdpp.set_checks(True)
    try:
        with pytest.raises(ValueError, match="^v holds non-finite"):
            fdpp.quantize_kv(k, bad, "fp8_e4m3")
        with pytest.raises(ValueError, match="cache_seqlens values must be in"):
            fdpp.quantize_kv(k, k, "fp8_e4m3", cache_seqlens=cupy.asarray([9], dtype=cupy.int32))
    finally:
        fdpp.set_checks(False)


def test_quantize_kv_in_a_torch_graph(rng):
    torch = pytest.importorskip("torch")
    shape = (2, 64, 8, 128)
    k0, v0 = (rng.standard_normal(shape).astype(np.float16) for _ in range(2))
    kd, vd = _to("torch", k0), _to("torch", v0)
    lens = _to("torch", np.array([30, 64], np.int32))
    for fmt, g in (("fp8_e4m3", 64), ("int4", 64)):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compiles the variants
            fdpp.quantize_kv(kd, vd, fmt, group_size=g, cache_seqlens=lens)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            q = fdpp.quantize_kv(kd, vd, fmt, group_size=g, cache_seqlens=lens)
        k1, v1 = (rng.standard_normal(shape).astype(np.float16) * 3 for _ in range(2))
        kd.copy_(_to("torch", k1))
        vd.copy_(_to("torch", v1))
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(q, fdpp.quantize_kv(k1, v1, fmt, group_size=g, cache_seqlens=[30, 64]))


# ---- PagedKVCache(kv_format=...) --------------------------------------------------------------
CACHE_GRID = list(itertools.product(["cupy", "torch"], [("fp8_e4m3", 64), ("fp8_e5m2", 64), ("int4", 32),
                                                       ("int4", 64)], ["NHD", "HND"], [1, 16], ["fp16", "bf16"]))


@pytest.mark.parametrize("backend, fmt_g, layout, page_size, dt", CACHE_GRID, ids=lambda x: str(x))
def test_paged_quant_append_matches_numpy(backend, fmt_g, layout, page_size, dt, rng):
    _backend(backend)
    from test_paged_cache import _variant  # contiguous, strided (aligned) and misaligned rows
    from test_quant_cache import check_against_numpy_quantization, make_cache, quant_scenario

    fmt, g = fmt_g
    seed = int(rng.integers(1 << 31))
    dev = make_cache(backend, fmt, g, layout, page_size, dtype=dt)
    ref = make_cache("numpy", fmt, g, layout, page_size, dtype=dt)
    count = itertools.count()
    exp = quant_scenario(dev, seed, lambda x: _variant(x, next(count), lambda a: _to(backend, a)))
    assert quant_scenario(ref, seed).keys() == exp.keys()
    check_against_numpy_quantization(dev, exp)
    pools = ["k_pages", "v_pages"] + (["k_scale_pages", "k_zero_pages", "v_scale_pages", "v_zero_pages"]
                                      if fmt == "int4" else ["k_descale", "v_descale"])
    for layer in range(dev.num_layers):
        for name in pools:
            a, b = _host(getattr(dev, name)(layer)), getattr(ref, name)(layer)
            np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{name}({layer})")
    if fmt != "int4" and backend == "torch":
        import torch

        assert dev.k_pages(0).dtype == (torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2)
    np.testing.assert_array_equal(_host(dev.block_table), ref.block_table)


@pytest.mark.parametrize("backend", ["cupy", "torch"])
def test_paged_quant_set_descale_on_device(backend, rng):
    from test_quant_cache import make_cache

    _backend(backend)
    c = make_cache(backend, "fp8_e4m3", 64, "NHD", 16)
    c.set_descale(0, 0.25, [0.5, 1.0])  # the [Hkv] descale reaches the backend as a read-only broadcast
    s = c.allocate()
    c.extend_reserve(s, 3)
    x = rng.standard_normal((3, 2, 64)).astype(np.float16)
    c.extend(0, s, _to(backend, x), _to(backend, x))
    np.testing.assert_array_equal(_host(c.k_descale(0)), np.full(2, 0.25, np.float32))
    np.testing.assert_array_equal(_host(c.v_descale(0)), np.array([0.5, 1.0], np.float32))
    got = _host(c.k_pages(0))[c.pages(s)[0], :3]
    np.testing.assert_array_equal(got, _bits(quant.fp8_quantize(x, "fp8_e4m3", np.float32(0.25))))
    gv = _host(c.v_pages(0))[c.pages(s)[0], :3]
    np.testing.assert_array_equal(gv, _bits(quant.fp8_quantize(x, "fp8_e4m3", np.array([0.5, 1.0], np.float32)[:, None])))
