"""PagedKVCache.append_rope (a decode step's fused QKV rows split, rotated by RoPE and written in one
launch) on the NumPy backend, against RoPE written here: float32 with every product and sum rounded
(the documented arithmetic, bitwise) and float64 (to tolerance); the stored K/V as append would
write the rotated rows (plain pools bitwise, quantized pools through NumPy's quantization); the
kernel's compile check and struct mirror; the launch arguments; argument errors; the Llama step
with and without the fusion. The GPU backends run the same scenario in tests/test_gpu_rope_append.py.
"""

import numpy as np
import pytest
from nvrtc_util import append_layout_check
from test_quant_cache import _bits, check_against_numpy_quantization, gather

from fdpp import quant, registry
from fdpp.cache import (
    PAGED_APPEND_Q_PARAMS,
    ROPE_APPEND_PARAMS,
    PagedKVCache,
    PagedRopeAppendConfig,
    rope_append_compile_space,
)
from fdpp.dtypes import DTYPES
from fdpp.launch import ParamStruct
from fdpp.models.llama import LlamaDecoder

L, H, D, HQ = 2, 2, 64, 6  # GQA 3
N_POS = 40  # the RoPE tables' rows: the scenario's last positions lie past them (clamped)
FORMATS = [(None, 64), ("fp8_e4m3", 64), ("fp8_e5m2", 64), ("int4", 32), ("int4", 64)]
DESCALES = (np.array([[0.1, 0.2], [0.5, 3.0]], np.float32), np.array([0.08, 0.25], np.float32))
ULP = {"fp16": 2.0**-10, "bf16": 2.0**-7, "fp32": 2.0**-23}


def make_cache(backend, fmt, g, layout, page_size, dtype="fp16", head_dim=D):
    kw = dict(k_descale=DESCALES[0], v_descale=DESCALES[1]) if fmt in quant.FP8 else {}
    return PagedKVCache(L, 16 + 160 // page_size, page_size, H, head_dim, dtype=dtype, kv_layout=layout,
                        max_batch=8, backend=backend, kv_format=fmt, group_size=g, **kw)


def rope_tables(n_pos, d, theta=10000.0):
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(n_pos, dtype=np.float64)[:, None] * inv
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope_f32(x, c, s):
    """x [B, heads, D] (any float dtype) rotated in float32 at per-row tables c, s [B, D/2]: the
    products and sums each rounded to float32 (NumPy does not fuse them)."""
    x = x.astype(np.float32)
    h = x.shape[-1] // 2
    x1, x2, c, s = x[..., :h], x[..., h:], c[:, None, :], s[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rope_f64(x, pos, d, theta=10000.0):
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.asarray(pos, dtype=np.float64)[:, None, None] * inv
    x = x.astype(np.float64)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


def _identity(x):
    return x


def rope_scenario(cache, seed, to_dev=_identity, to_np=np.asarray, steps=6):
    """Prefill 3 sequences (5, 19, 37 tokens; extend), then ``steps`` decode steps of
    reserve + append_rope per layer, with a fork at step 2. Returns ({seq: [(k, v) per layer]}: the
    raw rows every live sequence holds, k rotated by :func:`rope_f32` at its position (the last
    table row past the table), and [(q_out, want_q, want_q64, dtype)] per call."""
    g = np.random.default_rng(seed)
    dt = DTYPES[cache.dtype].np_dtype
    d = cache.head_dim
    cos, sin = rope_tables(N_POS, d)

    def rand(*shape):
        x = g.standard_normal(shape) * 0.5
        x[..., 3] *= 15  # an outlier channel
        return x.astype(dt)

    exp, qs = {}, []
    batch = [cache.allocate() for _ in range(3)]
    for s, n in zip(batch, (5, 19, 37), strict=True):
        cache.extend_reserve(s, n)
        exp[s] = []
        for layer in range(L):
            k, v = rand(n, H, d), rand(n, H, d)
            cache.extend(layer, s, to_dev(k), to_dev(v))
            exp[s].append(([k], [v]))
    cache.set_batch(batch)
    for step in range(steps):
        if step == 2:
            child = cache.fork(batch[1])
            exp[child] = [(list(k), list(v)) for k, v in exp[batch[1]]]
            batch.append(child)
            cache.set_batch(batch)
        cache.reserve(1)
        b = len(batch)
        pos = np.array([cache.length(s) - 1 for s in batch])
        tpos = np.minimum(pos, N_POS - 1)
        for layer in range(L):
            x = rand(b, HQ + 2 * H, d)
            q_out = to_dev(np.full((b, HQ, d), np.nan, dtype=dt))  # poisoned
            cache.append_rope(layer, to_dev(x.reshape(b, -1)), to_dev(cos), to_dev(sin), q_out)
            rot = rope_f32(x[:, :HQ + H], cos[tpos], sin[tpos]).astype(dt)
            qs.append((to_np(q_out), rot[:, :HQ], rope_f64(x[:, :HQ], tpos, d), cache.dtype))
            for i, s in enumerate(batch):
                exp[s][layer][0].append(rot[i:i + 1, HQ:])
                exp[s][layer][1].append(x[i:i + 1, HQ + H:])
    return {s: [(np.concatenate(k), np.concatenate(v)) for k, v in layers] for s, layers in exp.items()}, qs


def check_scenario(cache, exp, qs):
    """q_out and the stored K/V against the scenario's expectations."""
    for got, want, want64, dtype in qs:
        np.testing.assert_array_equal(_bits(got), _bits(want))
        err = np.abs(got.astype(np.float64) - want64) / np.maximum(1.0, np.abs(want64))
        assert float(err.max()) <= 2 * ULP[dtype], float(err.max())  # float32 math, then one rounding
    if cache.kv_format is not None:
        check_against_numpy_quantization(cache, exp)
        return
    for s, layers in exp.items():
        for layer, (k, v) in enumerate(layers):
            np.testing.assert_array_equal(_bits(gather(cache, s, cache.to_numpy(cache.k_pages(layer)))), _bits(k))
            np.testing.assert_array_equal(_bits(gather(cache, s, cache.to_numpy(cache.v_pages(layer)))), _bits(v))


@pytest.mark.parametrize("fmt, g", FORMATS)
@pytest.mark.parametrize("layout, page_size", [("NHD", 16), ("HND", 1)])
def test_append_rope_numpy(fmt, g, layout, page_size):
    cache = make_cache("numpy", fmt, g, layout, page_size)
    exp, qs = rope_scenario(cache, seed=7)
    assert len(qs) == 6 * L and max(cache.length(s) for s in exp) > N_POS  # positions past the table
    check_scenario(cache, exp, qs)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_append_rope_numpy_dtypes(dtype):
    cache = make_cache("numpy", None, 64, "NHD", 16, dtype=dtype)
    exp, qs = rope_scenario(cache, seed=8, steps=3)
    check_scenario(cache, exp, qs)


def test_append_rope_is_rope_then_append():
    """The same rows through the two unfused writes (the model's rope_qkv, then append) give the same bits;
    and both wrote: q_out (poisoned first) holds the rotated q, the reserved slot (position 9: page 0,
    slot 9) holds a row in every pool, nothing else of the zeroed pools changed."""
    from fdpp.models._backends import NumpyOps

    a, b = (make_cache("numpy", "int4", 32, "NHD", 16) for _ in range(2))
    cos, sin = rope_tables(N_POS, D)
    g = np.random.default_rng(3)
    for c in (a, b):
        s = c.allocate()
        c.extend_reserve(s, 9)
        c.set_batch([s])
        c.reserve(1)
    x = (g.standard_normal((1, (HQ + 2 * H) * D)) * 3).astype(np.float16)
    qa = np.full((1, HQ, D), np.nan, np.float16)  # poisoned
    a.append_rope(1, x, cos, sin, qa)
    qb = np.full((1, HQ, D), np.nan, np.float16)
    kb, vb = (np.empty((1, H, D), np.float16) for _ in range(2))
    NumpyOps("fp16").rope_qkv(x, cos, sin, np.array([10]), qb, kb, vb)
    b.append(1, kb, vb)
    assert not np.isnan(qa).any() and qa.any()
    np.testing.assert_array_equal(_bits(qa), _bits(rope_f32(x.reshape(1, -1, D)[:, :HQ], cos[[9]], sin[[9]])
                                                   .astype(np.float16)))
    np.testing.assert_array_equal(qa, qb)
    page = a.pages(s)[0]
    for name in ("k_pages", "v_pages", "k_scale_pages", "k_zero_pages", "v_scale_pages", "v_zero_pages"):
        pa = getattr(a, name)(1)
        np.testing.assert_array_equal(pa, getattr(b, name)(1), err_msg=name)
        assert pa[page, 9].reshape(H, -1).any(axis=1).all(), name  # each head's row written
        rest = np.ones(pa.shape[:2], bool)
        rest[page, 9] = False
        assert not pa[rest].any(), name  # and nothing else


# ---- argument errors --------------------------------------------------------------------------
def _ready(cache):
    s = cache.allocate()
    cache.set_batch([s])
    cache.reserve(1)
    return cache


def test_byte_range_any_stride_sign():
    """_byte_range (append_rope's overlap check): the bytes from the lowest element's address to one
    past the highest, for views with negative and zero strides too."""
    from fdpp.cache import _byte_range, _NumpyBackend

    buf = np.zeros((4, 6, 8), np.float16)
    views = [buf, buf[::-1], buf[:, ::-2], buf[::2, :, ::-1], buf[1:3].transpose(2, 0, 1)[::-1],
             np.broadcast_to(buf[0, 0], (3, 8)), buf[:0], buf[::-1, 1:2, 7:]]
    for v in views:
        info = _NumpyBackend().info(v)
        if v.size == 0:
            assert _byte_range(info, 2) == (info.ptr, info.ptr)
            continue
        addrs = [info.ptr + 2 * sum(i * st for i, st in zip(idx, info.strides, strict=True))
                 for idx in np.ndindex(*v.shape)]
        assert _byte_range(info, 2) == (min(addrs), max(addrs) + 2), (v.shape, v.strides)


def _batch3():
    c = make_cache("numpy", None, 64, "NHD", 16)
    c.set_batch([c.allocate() for _ in range(3)])
    c.reserve(1)
    return c


def test_append_rope_q_out_overlap():
    """q_out sharing bytes with qkv, cos or sin: the device path's ValueError (one check, made before
    the backends part) on numpy too, before anything is written; negative strides included (a span
    running down from the pointer: cases a check from the pointer up would miss)."""
    c = _batch3()
    w, qn = (HQ + 2 * H) * D, 3 * HQ * D
    cos, sin = rope_tables(8, D)
    buf = np.zeros(5 * w, np.float16)
    raw = np.zeros(cos.nbytes + 2 * qn, np.uint8)  # a table's bytes, then room for q_out
    tab = raw[:cos.nbytes].view(np.float32).reshape(cos.shape)
    tab[...] = cos
    q = np.zeros((3, HQ, D), np.float16)
    base = dict(layer=0, qkv=buf[:3 * w].reshape(3, w), cos=cos, sin=sin, q_out=q)
    cases = [
        (dict(q_out=buf[:qn].reshape(3, HQ, D)), "qkv"),  # q_out is qkv's first bytes
        (dict(qkv=buf[w:4 * w].reshape(3, w)[::-1], q_out=buf[:qn].reshape(3, HQ, D)), "qkv"),  # qkv's rows reversed
        (dict(qkv=buf[2 * HQ * D:2 * HQ * D + 3 * w].reshape(3, w), q_out=buf[:qn].reshape(3, HQ, D)[::-1]),
         "qkv"),  # q_out reversed: its row 0 (the highest in memory) is qkv's first bytes
        (dict(cos=tab, q_out=raw[cos.nbytes - 64:cos.nbytes - 64 + 2 * qn].view(np.float16).reshape(3, HQ, D)),
         "cos"),  # q_out's first 64 bytes are cos's last
        (dict(sin=tab, q_out=raw[cos.nbytes - 2:cos.nbytes - 2 + 2 * qn].view(np.float16).reshape(3, HQ, D)[::-1]),
         "sin"),  # q_out reversed: its lowest element (row 2's first) is half of sin's last
    ]
    for kw, name in cases:
        with pytest.raises(ValueError, match=f"q_out must not overlap {name} \\(the kernel reads {name}'s rows "
                                             "while it writes q_out\\)"):
            c.append_rope(**{**base, **kw})
    assert not c.k_pages(0).any() and not c.v_pages(0).any() and not buf.any()  # refused before any write
    qr = raw[cos.nbytes:].view(np.float16).reshape(3, HQ, D)[::-1]  # right after sin's bytes, reversed: apart
    c.append_rope(**{**base, "qkv": buf[:3 * w].reshape(3, w) + 1, "sin": tab, "q_out": qr})
    assert qr.any() and c.k_pages(0).any()


def test_append_rope_negative_strides():
    """Reversed rows (x[::-1]) that overlap nothing: accepted, the same bits as contiguous copies on
    numpy; on the device path passed through as negative strides (no copy), the checks of
    test_append_rope_q_out_overlap catching overlaps."""
    a, b = _batch3(), _batch3()
    w = (HQ + 2 * H) * D
    cos, sin = rope_tables(8, D)
    x = np.random.default_rng(5).standard_normal((3, w)).astype(np.float16)
    xr = x[::-1].copy()[::-1]  # x's values, rows running down in memory
    qa, qb = np.zeros((3, HQ, D), np.float16), np.zeros((3, HQ, D), np.float16)[::-1]
    a.append_rope(0, x, cos, sin, qa)
    b.append_rope(0, xr, cos[::-1].copy()[::-1], sin, qb)
    assert qa.any()
    np.testing.assert_array_equal(_bits(qa), _bits(qb))
    np.testing.assert_array_equal(_bits(a.k_pages(0)), _bits(b.k_pages(0)))
    np.testing.assert_array_equal(_bits(a.v_pages(0)), _bits(b.v_pages(0)))


def test_append_rope_errors():
    c = _ready(make_cache("numpy", None, 64, "NHD", 16))
    cos, sin = rope_tables(8, D)
    x = np.zeros((1, (HQ + 2 * H) * D), np.float16)
    q = np.zeros((1, HQ, D), np.float16)
    c.append_rope(0, x, cos, sin, q)  # the good call
    cases = [
        (dict(layer=2), ValueError, "layer"),
        (dict(qkv=x[:, :-D]), ValueError, "qkv must have shape"),
        (dict(qkv=x.astype(np.float32)), TypeError, "qkv dtype"),
        (dict(qkv=x.reshape(1, HQ + 2 * H, D)), ValueError, "qkv must have 2 dimensions"),
        (dict(q_out=q[:, :, :32]), ValueError, "q_out must have shape"),
        (dict(q_out=np.zeros((2, HQ, D), np.float16)), ValueError, "q_out must have shape"),
        (dict(q_out=q.astype(np.float32)), TypeError, "q_out dtype"),
        (dict(cos=cos.astype(np.float64)), TypeError, "cos dtype must be fp32"),
        (dict(sin=sin[:, :16]), ValueError, "sin must have shape"),
        (dict(sin=sin[:4]), ValueError, "sin must have shape"),
        (dict(cos=cos[:0], sin=sin[:0]), ValueError, "cos must have shape"),
        (dict(qkv=list(x)), TypeError, "qkv must be a numpy.ndarray"),
    ]
    base = dict(layer=0, qkv=x, cos=cos, sin=sin, q_out=q)
    for kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            c.append_rope(**{**base, **kw})
    d24 = _ready(PagedKVCache(1, 4, 16, H, 24, backend="numpy"))
    c24, s24 = rope_tables(8, 24)
    with pytest.raises(ValueError, match="multiple of 16"):
        d24.append_rope(0, np.zeros((1, (HQ + 2 * H) * 24), np.float16), c24, s24, np.zeros((1, HQ, 24), np.float16))
    fresh = make_cache("numpy", None, 64, "NHD", 16)
    fresh.set_batch([fresh.allocate()])
    with pytest.raises(ValueError, match="reserve"):
        fresh.append_rope(0, x, cos, sin, q)


# ---- the device path's arguments (no kernel runs) ---------------------------------------------
@pytest.mark.parametrize("fmt, g, layout", [(None, 64, "NHD"), ("int4", 32, "HND")])
def test_rope_launch_params(monkeypatch, fmt, g, layout):
    import fdpp.launch

    cache = _ready(make_cache("numpy", fmt, g, layout, 16))
    got = []
    monkeypatch.setattr(fdpp.launch, "launch", lambda cfg, grid, args, dev, stream: got.append((cfg, grid, args)))
    monkeypatch.setattr(cache._be, "stream", lambda: None, raising=False)
    be = cache._be
    buf = np.zeros(4 * (HQ + 2 * H) * D + 64, np.float16)
    off = (-buf.ctypes.data // 2) % 8  # a 16-byte aligned start
    x = buf[off:off + 3 * (HQ + 2 * H) * D].reshape(3, -1)
    qbuf = np.zeros(3 * HQ * D + 8, np.float16)
    qo = (-qbuf.ctypes.data // 2) % 8
    q = qbuf[qo:qo + 3 * HQ * D].reshape(3, HQ, D)
    cos, sin = rope_tables(11, D)
    args = (x, be.info(x), be.info(cos), be.info(sin), be.info(q), cos, sin)
    cache._launch_rope(1, *args)
    ((cfg, grid, (p, r)),) = got
    assert isinstance(cfg, PagedRopeAppendConfig) and cfg.kv_format == fmt and cfg.hnd == (layout == "HND")
    assert cfg.group_size == (g if fmt == "int4" else 0) and cfg.head_dim == D and cfg.page_size == 16
    assert grid == (-(-3 * HQ * (D // 8) // 128), 3, 1)
    p = np.frombuffer(p.tobytes(), dtype=PAGED_APPEND_Q_PARAMS.dtype)[0]
    r = np.frombuffer(r.tobytes(), dtype=ROPE_APPEND_PARAMS.dtype)[0]
    w = (HQ + 2 * H) * D
    assert (p["k_src"], p["v_src"]) == (x.ctypes.data + HQ * D * 2, x.ctypes.data + (HQ + H) * D * 2)
    assert (p["k_src_row"], p["k_src_head"], p["v_src_row"], p["v_src_head"]) == (w, D, w, D)
    assert p["k_pool"] == be.info(cache.k_pages(1)).ptr and p["v_pool"] == be.info(cache.v_pages(1)).ptr
    assert (p["rows"], p["num_heads"], p["pos0"]) == (3, H, 0)
    assert (r["q_src"], r["q_out"], r["cos_t"], r["sin_t"]) == (x.ctypes.data, q.ctypes.data, cos.ctypes.data,
                                                                 sin.ctypes.data)
    assert (r["q_src_row"], r["q_src_head"], r["q_out_row"], r["q_out_head"]) == (w, D, HQ * D, D)
    assert (r["num_q_heads"], r["n_pos"]) == (HQ, 11)
    if fmt is None:
        assert (p["k_page"], p["k_s1"], p["k_s2"]) == (16 * H * D, H * D, D)  # elements of the pool
    else:
        assert p["k_sc"] == be.info(cache.k_scale_pages(1)).ptr and p["sc_page"] == 16 * H * (D // g)
    # rows running down (x[::-1]): aligned, so passed as they are (negative strides; no copy)
    xr, qr = x[::-1], q[::-1]
    cache._launch_rope(1, xr, be.info(xr), be.info(cos), be.info(sin), be.info(qr), cos, sin)
    p = np.frombuffer(got[-1][2][0].tobytes(), dtype=PAGED_APPEND_Q_PARAMS.dtype)[0]
    r = np.frombuffer(got[-1][2][1].tobytes(), dtype=ROPE_APPEND_PARAMS.dtype)[0]
    assert (r["q_src"], r["q_out"], r["q_src_row"], r["q_out_row"]) == (xr.ctypes.data, qr.ctypes.data, -w, -HQ * D)
    assert (p["k_src"], p["k_src_row"], p["v_src_row"]) == (xr.ctypes.data + HQ * D * 2, -w, -w)
    with pytest.raises(ValueError, match="16-byte aligned"):
        qm = qbuf[qo + 1:qo + 1 + 3 * HQ * D].reshape(3, HQ, D)
        cache._launch_rope(1, x, be.info(x), be.info(cos), be.info(sin), be.info(qm), cos, sin)


# ---- the kernel: compiles offline, the Python mirror agrees with the source ------------------
def test_rope_append_config_names():
    c = PagedRopeAppendConfig("bf16", "int4", 64, 128, 16, True)
    assert c.key == "paged_rope_append.bf16.int4.g64.d128.p16.hnd" and c.source == "paged_append.cu"
    assert c.name_expression() == "fdpp::paged_rope_append<fdpp::bfloat16_t,3,64,128,16,true>"
    f = PagedRopeAppendConfig("fp16", None, 0, 64, 1)
    assert f.key == "paged_rope_append.f16.kv.d64.p1.nhd" and f.threads == 128
    assert f.name_expression() == "fdpp::paged_rope_append<fdpp::half_t,0,0,64,1,false>"
    assert ROPE_APPEND_PARAMS.dtype.itemsize == 72


def test_rope_append_params_match_compiler():
    ok, log = append_layout_check(ROPE_APPEND_PARAMS)
    assert ok, log
    f = list(ROPE_APPEND_PARAMS.fields)
    f[-1], f[-2] = f[-2], f[-1]
    ok, log = append_layout_check(ParamStruct("RopeAppendParams", f))
    assert not ok and "RopeAppendParams.n_pos" in log


def test_rope_append_variants_compile_without_spills():
    space = rope_append_compile_space()
    assert len({c.key for c in space}) == len(space) == 46
    assert {c.kv_format for c in space} == {None, *quant.FORMATS} and {c.dtype for c in space} == set(DTYPES)
    for arch in ("sm_80", "sm_90"):
        reports = registry.compile_offline(space, arch)
        assert set(reports) == {c.key for c in space}
        bad = [r for r in reports.values() if r.spill_stores or r.spill_loads or r.stack_bytes or r.static_smem]
        assert bad == [], bad


def test_bad_rope_append_variant_fails_to_compile():
    with pytest.raises(registry.KernelCompileError, match="multiple of 16"):
        registry.compile_offline([PagedRopeAppendConfig("fp16", None, 0, 24, 16)], "sm_90")


# ---- the Llama step -------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:fdpp. no GPU found:RuntimeWarning")
@pytest.mark.parametrize("cache, layout", [("paged", "NHD"), ("paged", "HND"), ("contiguous", "NHD")])
def test_llama_step_with_and_without_the_fusion(cache, layout):
    a = LlamaDecoder("tiny", 3, 48, backend="numpy", cache=cache, kv_layout=layout, seed=4)
    b = LlamaDecoder("tiny", 3, 48, backend="numpy", cache=cache, kv_layout=layout, seed=4, fuse_rope_append=False)
    assert a.fuse_rope_append and not b.fuse_rope_append
    names_a, names_b = [n for n, _ in a.program], [n for n, _ in b.program]
    assert names_a.count("rope_append") == 2 and "rope" not in names_a and "kv_append" not in names_a
    assert names_b.count("rope") == 2 and names_b.count("kv_append") == 2 and "rope_append" not in names_b
    for m in (a, b):
        m.prefill_random([4, 17, 30])
    for ids in ([1, 2, 3], [9, 9, 0], [5, 6, 7]):
        np.testing.assert_array_equal(a.step(ids), b.step(ids))
    for layer in range(2):
        for (ka, va), (kb, vb) in zip(a.kv_numpy(layer), b.kv_numpy(layer), strict=True):
            np.testing.assert_array_equal(ka, kb)
            np.testing.assert_array_equal(va, vb)
