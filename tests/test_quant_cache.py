"""PagedKVCache with a quantized kv_format (fp8_e4m3, fp8_e5m2, int4) on the NumPy backend: pools,
scale pools and descales, quantize-on-append with fdpp.quantize_kv's rounding, copy-on-write of
the scale pools, argument errors, and the quantized append kernel's compile check and struct
mirror. The GPU backends run the same scenario in tests/test_gpu_quant.py (bitwise against it).
"""

import ml_dtypes
import numpy as np
import pytest
from nvrtc_util import append_layout_check

import fdpp
from fdpp import quant
from fdpp.cache import (
    PAGED_APPEND_PARAMS,
    PAGED_APPEND_Q_PARAMS,
    PagedAppendQuantConfig,
    PagedKVCache,
    append_quant_compile_space,
)
from fdpp.dtypes import DTYPES
from fdpp.launch import ParamStruct

L, H, D = 2, 2, 64
FORMATS = [("fp8_e4m3", 64), ("fp8_e5m2", 64), ("int4", 32), ("int4", 64)]
DESCALES = (np.array([[0.1, 0.2], [0.5, 3.0]], np.float32), np.array([0.08, 0.25], np.float32))


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def make_cache(backend, fmt, g, layout, page_size, dtype="fp16"):
    num_pages = 16 + 160 // page_size
    kw = {}
    if fmt in quant.FP8:
        kw = dict(k_descale=DESCALES[0], v_descale=DESCALES[1])  # [L, Hkv] and [Hkv]
    return PagedKVCache(L, num_pages, page_size, H, D, dtype=dtype, kv_layout=layout, max_batch=8,
                        backend=backend, kv_format=fmt, group_size=g, **kw)


def _identity(x, i=0):
    return x


def quant_scenario(cache, seed, to_dev=_identity):
    """Prefill 3 sequences (extend, one in two chunks), 12 decode steps (append), a fork at step 4
    (copy-on-write of a partly filled page), a free at step 8. Returns {seq: [(k, v) per layer]}:
    the raw fp16/bf16 tokens every live sequence holds, in order."""
    g = np.random.default_rng(seed)
    dt = DTYPES[cache.dtype].np_dtype

    def rand(*shape):
        x = g.standard_normal(shape) * 0.5
        x[..., 3] *= 15  # an outlier channel: K of real models looks like this
        return x.astype(dt)

    exp = {}
    seqs = [cache.allocate() for _ in range(3)]
    for s, n in zip(seqs, (5, 19, 37), strict=True):
        exp[s] = [([], []) for _ in range(L)]
        for c in ([n] if n < 30 else [21, n - 21]):
            cache.extend_reserve(s, c)
            for layer in range(L):
                k, v = rand(c, H, D), rand(c, H, D)
                cache.extend(layer, s, to_dev(k), to_dev(v))
                exp[s][layer][0].append(k)
                exp[s][layer][1].append(v)
    batch = list(seqs)
    cache.set_batch(batch)
    for step in range(12):
        if step == 4:
            child = cache.fork(batch[1])
            exp[child] = [(list(k), list(v)) for k, v in exp[batch[1]]]
            batch.append(child)
            cache.set_batch(batch)
        if step == 8:
            gone = batch.pop(0)
            cache.set_batch(batch)
            cache.free(gone)
            del exp[gone]
        cache.reserve(1)
        for layer in range(L):
            k, v = rand(len(batch), H, D), rand(len(batch), H, D)
            cache.append(layer, to_dev(k), to_dev(v))
            for i, s in enumerate(batch):
                exp[s][layer][0].append(k[i:i + 1])
                exp[s][layer][1].append(v[i:i + 1])
    return {s: [(np.concatenate(k), np.concatenate(v)) for k, v in layers] for s, layers in exp.items()}


def gather(cache, seq, pool):
    """[n, Hkv, *] rows of ``pool`` (a layer's pool as NumPy) at the positions of ``seq``."""
    pages, n, ps = np.asarray(cache.pages(seq), dtype=np.int64), cache.length(seq), cache.page_size
    pos = np.arange(n)
    pg, slot = pages[pos // ps], pos % ps
    return pool[pg, slot] if cache.kv_layout == "NHD" else pool[pg, :, slot]


def check_against_numpy_quantization(cache, exp):
    """Every stored token of every live sequence equals NumPy's quantization of its raw K/V, bit
    for bit (codes, and int4 scales / zeros); returns the dequantized K/V of each sequence."""
    out = {}
    for s, layers in exp.items():
        out[s] = []
        for layer, (k, v) in enumerate(layers):
            deq = []
            for name, x in (("k", k), ("v", v)):
                codes = gather(cache, s, cache.to_numpy(getattr(cache, f"{name}_pages")(layer)))
                if cache.kv_format == "int4":
                    packed, sc, zp = quant.int4_quantize(x, cache.group_size)
                    got_s = gather(cache, s, cache.to_numpy(getattr(cache, f"{name}_scale_pages")(layer)))
                    got_z = gather(cache, s, cache.to_numpy(getattr(cache, f"{name}_zero_pages")(layer)))
                    np.testing.assert_array_equal(codes, packed, err_msg=f"seq {s} layer {layer} {name} codes")
                    np.testing.assert_array_equal(_bits(got_s), _bits(sc), err_msg=f"seq {s} {name} scale")
                    np.testing.assert_array_equal(_bits(got_z), _bits(zp), err_msg=f"seq {s} {name} zero")
                    deq.append(quant.dequant_int4(codes, got_s, got_z, cache.group_size))
                else:
                    ds = cache.to_numpy(getattr(cache, f"{name}_descale")(layer))
                    want = quant.fp8_quantize(x, cache.kv_format, ds[:, None])
                    np.testing.assert_array_equal(_bits(codes), _bits(want), err_msg=f"seq {s} layer {layer} {name}")
                    deq.append(quant.dequant_fp8(_bits(codes), cache.kv_format, ds[:, None]))
            out[s].append(deq)
    return out


@pytest.mark.parametrize("fmt, g", FORMATS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_quantized_scenario_numpy(fmt, g, layout, page_size, rng):
    cache = make_cache("numpy", fmt, g, layout, page_size)
    pool = cache.k_pages(0)
    row = D if fmt != "int4" else D // 2
    page = (page_size, H, row) if layout == "NHD" else (H, page_size, row)
    assert pool.shape == (cache.num_pages, *page)
    assert pool.dtype == (quant.FP8[fmt].np_dtype if fmt != "int4" else np.uint8)
    if fmt == "int4":
        sp = cache.k_scale_pages(1)
        assert sp.shape == (cache.num_pages, *page[:2], D // g) and sp.dtype == np.float16
        assert cache.v_zero_pages(0).shape == sp.shape and cache.group_size == g
    else:
        assert cache.k_descale(1).tolist() == DESCALES[0][1].tolist() and cache.k_descale(1).dtype == np.float32
        assert cache.v_descale(0).tolist() == cache.v_descale(1).tolist() == DESCALES[1].tolist()
    exp = quant_scenario(cache, int(rng.integers(1 << 31)))
    deq = check_against_numpy_quantization(cache, exp)
    for s, layers in exp.items():  # and the dequantized cache is close to the raw one
        for layer, ((k, v), (dk, dv)) in enumerate(zip(layers, deq[s], strict=True)):
            for name, x, y in (("k", k, dk), ("v", v, dv)):
                x32 = x.astype(np.float32)
                if fmt == "int4":
                    span = x32.reshape(*x32.shape[:-1], D // g, g)
                    tol = np.repeat((span.max(-1) - span.min(-1)) / 15 * 0.52 + 1e-2, g, -1)
                else:
                    t = quant.FP8[fmt]
                    ds = getattr(cache, f"{name}_descale")(layer)[:, None]
                    assert np.all(np.abs(x32) / ds < t.max)  # no saturation in this data
                    tol = (np.abs(x32) * 2.0 ** -(t.mant + 1) + ds * 2.0 ** (-t.bias - t.mant)) * (1 + 1e-6)
                assert np.all(np.abs(x32 - y) <= tol)


def test_fork_copies_int4_scale_pages():
    cache = make_cache("numpy", "int4", 32, "NHD", 16)
    s = cache.allocate()
    cache.extend_reserve(s, 5)
    x = np.arange(5 * H * D, dtype=np.float32).reshape(5, H, D).astype(np.float16)
    cache.extend(0, s, x, x)
    c = cache.fork(s)
    cache.set_batch([c])
    cache.reserve(1)  # the child's partly filled last page is copied, scale pools included
    p_old, p_new = cache.pages(s)[0], cache.pages(c)[0]
    assert p_old != p_new
    for pool in (cache.k_pages(0), cache.k_scale_pages(0), cache.v_zero_pages(0)):
        np.testing.assert_array_equal(pool[p_new, :5], pool[p_old, :5])
    assert np.any(cache.k_scale_pages(0)[p_old, :5] != 0)


def test_set_descale():
    cache = make_cache("numpy", "fp8_e4m3", 64, "NHD", 16)
    cache.set_descale(1, 0.5, np.array([1.0, 2.0]))
    assert cache.k_descale(1).tolist() == [0.5, 0.5] and cache.v_descale(1).tolist() == [1.0, 2.0]
    assert cache.k_descale(0).tolist() == DESCALES[0][0].tolist()  # other layers unchanged
    s = cache.allocate()
    cache.extend_reserve(s, 2)
    x = np.full((2, H, D), 1.0, np.float16)
    cache.extend(1, s, x, x)
    assert np.all(cache.k_pages(1)[cache.pages(s)[0], :2].astype(np.float32) == 2.0)  # 1.0 / 0.5
    with pytest.raises(ValueError, match="layer 1 already stores tokens"):
        cache.set_descale(1, 1.0, 1.0)
    cache.set_descale(0, 1.0, 1.0)  # layer 0 holds nothing yet
    cache.free(s)
    cache.set_descale(1, 1.0, 1.0)  # no live tokens left


@pytest.mark.parametrize("kw, exc, match", [
    (dict(kv_format="fp4"), ValueError, "kv_format must be None or one of"),
    (dict(kv_format="int4", group_size=128, head_dim=64), ValueError, "group_size 128 does not divide head_dim 64"),
    (dict(kv_format="int4", group_size=16), ValueError, "group_size must be one of"),
    (dict(kv_format="fp8_e4m3", head_dim=60), ValueError, "head_dim must be a multiple of 8"),
    (dict(kv_format="int4", k_descale=1.0), ValueError, "k_descale is for fp8 caches"),
    (dict(v_descale=1.0), ValueError, "v_descale is for fp8 caches"),
    (dict(kv_format="fp8_e4m3", k_descale=np.ones(3)), ValueError, r"k_descale must have shape"),
    (dict(kv_format="fp8_e4m3", v_descale=[1.0, np.nan]), ValueError, "v_descale must be finite and > 0"),
    (dict(kv_format="fp8_e4m3", v_descale=[1.0, 0.0]), ValueError, "v_descale must be finite and > 0"),
    (dict(kv_format="fp8_e5m2", k_descale="x"), TypeError, "k_descale must be a float"),
    (dict(kv_format="fp8_e4m3", k_descale="2.5"), TypeError, "k_descale must be a float"),
    (dict(kv_format="fp8_e4m3", k_descale=True), TypeError, "k_descale must be a float"),
    (dict(kv_format="fp8_e4m3", v_descale=np.ones(H, bool)), TypeError, "v_descale must be a float"),
])
def test_constructor_errors(kw, exc, match):
    args = dict(num_layers=L, num_pages=8, page_size=16, num_kv_heads=H, head_dim=D, backend="numpy")
    args.update(kw)
    with pytest.raises(exc, match=match):
        PagedKVCache(**args)


def test_accessor_and_write_errors():
    plain = PagedKVCache(L, 8, 16, H, D, backend="numpy")
    with pytest.raises(ValueError, match="k_descale is defined for kv_format in"):
        plain.k_descale(0)
    with pytest.raises(ValueError, match="k_scale_pages is defined for kv_format in"):
        plain.k_scale_pages(0)
    fp8 = make_cache("numpy", "fp8_e4m3", 64, "NHD", 16)
    with pytest.raises(ValueError, match="v_zero_pages is defined"):
        fp8.v_zero_pages(0)
    with pytest.raises(ValueError, match="set_descale is defined"):
        make_cache("numpy", "int4", 32, "NHD", 16).set_descale(0, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"k_descale must have shape \[\] or \[num_kv_heads\]"):
        fp8.set_descale(0, np.ones((L, H)), 1.0)
    s = fp8.allocate()
    fp8.extend_reserve(s, 1)
    with pytest.raises(TypeError, match="k dtype must be fp16"):  # input dtype: the cache's dtype
        fp8.extend(0, s, np.zeros((1, H, D), np.float32), np.zeros((1, H, D), np.float16))
    bf = make_cache("numpy", "int4", 64, "HND", 1, dtype="bf16")
    s = bf.allocate()
    bf.extend_reserve(s, 3)
    x = np.ones((3, H, D), ml_dtypes.bfloat16)
    bf.extend(0, s, x, x)
    assert np.all(bf.k_zero_pages(0)[bf.pages(s)[:3], :, 0] == 1.0)


def test_plain_cache_is_unchanged():
    c = PagedKVCache(L, 8, 16, H, D, dtype="bf16", backend="numpy")
    assert c.kv_format is None and c.group_size is None and c.k_pages(0).dtype == DTYPES["bf16"].np_dtype
    assert c._cfg.key == "paged_append.bf16.d64.p16.nhd"


# ---- the kernel: compiles offline, the Python mirror agrees with the source ------------------
def test_quant_append_config_names():
    c = PagedAppendQuantConfig("bf16", "int4", 64, 128, 16, True)
    assert c.key == "paged_append_q.bf16.int4.g64.d128.p16.hnd" and c.source == "paged_append.cu"
    assert c.name_expression() == "fdpp::paged_append_quant<fdpp::bfloat16_t,3,64,128,16,true>"
    f = PagedAppendQuantConfig("fp16", "fp8_e5m2", 0, 64, 1)
    assert f.name_expression() == "fdpp::paged_append_quant<fdpp::half_t,2,0,64,1,false>"
    assert f.key == "paged_append_q.f16.fp8_e5m2.d64.p1.nhd" and f.threads == 128 and f.vec_bytes == 16
    assert PAGED_APPEND_Q_PARAMS.fields[:len(PAGED_APPEND_PARAMS.fields)] == PAGED_APPEND_PARAMS.fields
    assert PAGED_APPEND_Q_PARAMS.dtype.itemsize == 216


def test_quant_append_params_match_compiler():
    ok, log = append_layout_check(PAGED_APPEND_Q_PARAMS)
    assert ok, log
    f = list(PAGED_APPEND_Q_PARAMS.fields)
    f[-1], f[-2] = f[-2], f[-1]
    ok, log = append_layout_check(ParamStruct("PagedAppendQParams", f))
    assert not ok and "PagedAppendQParams.sc_s1" in log


def test_quant_append_space_is_complete():
    space = append_quant_compile_space()
    assert len({c.key for c in space}) == len(space) == 66
    assert {c.dtype for c in space} == set(DTYPES) and {c.kv_format for c in space} == set(quant.FORMATS)
    assert {c.group_size for c in space if c.kv_format == "int4"} == set(quant.GROUP_SIZES)
    assert {c.page_size for c in space} == {1, 16, 256} and {c.head_dim for c in space} == {64, 128, 256}


def test_exports():
    assert fdpp.quantize_kv is quant.quantize_kv and fdpp.dequantize_kv is quant.dequantize_kv


@pytest.mark.parametrize("fmt, g, layout", [("fp8_e5m2", 0, "NHD"), ("int4", 32, "HND")])
def test_quant_launch_params(monkeypatch, fmt, g, layout):
    """The device path's argument struct, built on the NumPy backend's arrays (no kernel runs)."""
    import fdpp.launch

    cache = make_cache("numpy", fmt, g or 64, layout, 16)
    got = []
    monkeypatch.setattr(fdpp.launch, "launch", lambda cfg, grid, args, dev, stream: got.append((cfg, grid, args[0])))
    monkeypatch.setattr(cache._be, "stream", lambda: None, raising=False)
    k = np.zeros((3, H, D), np.float16)
    info = cache._be.info(k)
    cache._launch(1, info, info, rows=3, block_table=111, bt_row_stride=7, seqlens=222, max_pages=7, pos0=0)
    ((cfg, grid, p),) = got
    assert cfg.key == cache._cfg.key and isinstance(cfg, PagedAppendQuantConfig)
    assert grid == (-(-3 * H * (D // 8) // 128), 2, 1)
    p = np.frombuffer(p.tobytes(), dtype=PAGED_APPEND_Q_PARAMS.dtype)[0]
    row = D if fmt != "int4" else D // 2
    page = 16 * H * row
    assert p["k_pool"] == cache._be.info(cache._k).ptr + cache.num_pages * page  # layer 1, in bytes
    assert p["k_pool"] == cache._be.info(cache.k_pages(1)).ptr and p["v_pool"] == cache._be.info(cache.v_pages(1)).ptr
    assert (p["k_page"], p["k_s1"], p["k_s2"]) == ((page, H * row, row) if layout == "NHD" else (page, 16 * row, row))
    assert (p["block_table"], p["seqlens"], p["bt_row_stride"], p["rows"], p["num_heads"]) == (111, 222, 7, 3, H)
    if fmt == "int4":
        srow = D // g
        assert p["k_sc"] == cache._be.info(cache.k_scale_pages(1)).ptr and p["v_zp"] == cache._be.info(cache.v_zero_pages(1)).ptr
        assert p["k_zp"] == cache._be.info(cache.k_zero_pages(1)).ptr and p["v_sc"] == cache._be.info(cache.v_scale_pages(1)).ptr
        assert (p["sc_page"], p["sc_s1"], p["sc_s2"]) == (16 * H * srow, 16 * srow, srow)
    else:
        assert p["k_sc"] == cache._be.info(cache.k_descale(1)).ptr and p["v_sc"] == cache._be.info(cache.v_descale(1)).ptr
        assert p["k_zp"] == p["sc_page"] == 0
