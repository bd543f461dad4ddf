"""INT4 K/V caches without a GPU: the NumPy path (the split-KV emulator over the dequantised
cache) against an independent float64 reference (tests/int4_util.py: its own dequantiser, plain
attention), argument errors, table keys and the config rules."""

import numpy as np
import pytest
from int4_util import dequant, random_int4, reference
from paged_util import fill_sequences

import fdpp
from fdpp import api, configs, tables
from fdpp.dtypes import INT4_FORMATS, kv_row_bytes

pytestmark = pytest.mark.filterwarnings("ignore:fdpp. no GPU found")
needs_no_gpu = pytest.mark.skipif(api.gpu_available(), reason="the NumPy emulator runs only without a GPU")


def _case(rng, b=2, hq=8, hkv=2, d=64, n=300, g=32, layout="NHD", outliers=False):
    q = rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16)
    shape = (b, n, hkv, d) if layout == "NHD" else (b, hkv, n, d)
    k = random_int4(shape, g, rng, outliers)
    v = random_int4(shape, g, rng)
    return q, k, v


@needs_no_gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("d, g", [(64, 32), (64, 64), (128, 32), (128, 128)])
def test_numpy_emulator_matches_reference_of_dequantised_cache(layout, d, g, rng):
    q, (kc, ks, kz), (vc, vs, vz) = _case(rng, d=d, g=g, layout=layout, outliers=True)
    lens = np.array([300, 77], np.int32)
    args = (kc, vc, ks, vs, kz, vz)
    before = [a.copy() for a in args]
    out, lse = fdpp.decode_attention(q, kc, vc, cache_seqlens=lens, kv_layout=layout, kv_dtype="int4",
                                     k_descale=ks, v_descale=vs, k_zero=kz, v_zero=vz, return_lse=True)
    ref, ref_lse = reference(q, dequant(kc, ks, kz), dequant(vc, vs, vz), lens, layout=layout)
    np.testing.assert_allclose(out.astype(np.float32), ref, rtol=4e-3, atol=4e-3)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-4)
    for a, a0 in zip(args, before, strict=True):  # nothing the caller passed is modified
        np.testing.assert_array_equal(a, a0)


@needs_no_gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_numpy_paged_matches_reference(layout, rng):
    b, hq, hkv, d, g, page = 3, 4, 1, 128, 64, 16
    lens = np.array([50, 1, 0], np.int32)
    width = 4
    num_pages = 13
    table = rng.permutation(num_pages)[: b * width].reshape(b, width).astype(np.int32)
    shape = (num_pages, page, hkv, d) if layout == "NHD" else (num_pages, hkv, page, d)
    (kc, ks, kz), (vc, vs, vz) = random_int4(shape, g, rng), random_int4(shape, g, rng)
    q = rng.standard_normal((b, hq, d)).astype(np.float16)
    out = fdpp.paged_decode_attention(q, kc, vc, table, lens, kv_layout=layout, kv_dtype="int4", k_descale=ks,
                                      v_descale=vs, k_zero=kz, v_zero=vz)

    def contig(pool):  # [B, N, Hkv, X] (NHD view of the pages, gathered by hand)
        p = pool if layout == "NHD" else pool.transpose(0, 2, 1, 3)
        return np.stack([np.concatenate([p[table[i, j]] for j in range(width)]) for i in range(b)])

    k = dequant(contig(kc), contig(ks), contig(kz))
    v = dequant(contig(vc), contig(vs), contig(vz))
    ref, _ = reference(q, k, v, lens)
    np.testing.assert_allclose(out.astype(np.float32), ref, rtol=4e-3, atol=4e-3)


@needs_no_gpu
def test_int4_paged_cache_feeds_paged_decode_attention(rng):
    hkv, d, page = 2, 64, 16
    cache = fdpp.PagedKVCache(1, 16, page, hkv, d, dtype="fp16", kv_format="int4", group_size=32, backend="numpy",
                              max_batch=2)
    fill_sequences(cache, (40, 7), rng)
    q = rng.standard_normal((2, 8, d)).astype(np.float16)
    kw = cache.attention_kwargs(0)
    assert kw["kv_dtype"] == "int4" and kw["k_descale"].shape == (*cache.k_pages(0).shape[:-1], d // 32)
    out = fdpp.paged_decode_attention(q, cache.k_pages(0), cache.v_pages(0), cache.block_table, cache.seqlens, **kw)
    from fdpp.reference import gather_pages

    t, lens = cache.block_table, cache.seqlens
    k = dequant(gather_pages(cache.k_pages(0), t, lens), gather_pages(kw["k_descale"], t, lens),
                gather_pages(kw["k_zero"], t, lens))
    v = dequant(gather_pages(cache.v_pages(0), t, lens), gather_pages(kw["v_descale"], t, lens),
                gather_pages(kw["v_zero"], t, lens))
    ref, _ = reference(q, k, v, lens)
    np.testing.assert_allclose(out.astype(np.float32), ref, rtol=4e-3, atol=4e-3)


def _kw(ks, vs, kz, vz):
    return dict(kv_dtype="int4", k_descale=ks, v_descale=vs, k_zero=kz, v_zero=vz)


def test_argument_errors(rng):
    q, (kc, ks, kz), (vc, vs, vz) = _case(rng, n=16)
    ok = _kw(ks, vs, kz, vz)

    def call(k=kc, v=vc, qq=q, **over):
        return fdpp.decode_attention(qq, k, v, **{**ok, **over})

    with pytest.raises(TypeError, match="k_cache must hold uint8 INT4"):
        call(k=kc.astype(np.float16))
    with pytest.raises(ValueError, match=r"k_cache last axis 64 must be head_dim // 2 = 32"):
        call(k=np.zeros((*kc.shape[:-1], 64), np.uint8), v=np.zeros((*kc.shape[:-1], 64), np.uint8))
    with pytest.raises(TypeError, match="k_zero is required"):
        call(k_zero=None)
    with pytest.raises(TypeError, match="v_descale is required"):
        call(v_descale=None)
    with pytest.raises(TypeError, match="k_descale must be an fp16 array"):
        call(k_descale=0.5)
    with pytest.raises(TypeError, match="k_descale must be float16"):
        call(k_descale=ks.astype(np.float32))
    with pytest.raises(TypeError, match="v_zero must be float16"):
        call(v_zero=vz.astype(np.float32))
    with pytest.raises(ValueError, match="k_descale must have shape"):
        call(k_descale=ks[:, :-1])
    with pytest.raises(ValueError, match="groups are 32, 64 or 128"):  # D=64, 4 groups: 16
        call(k_descale=np.ones((*ks.shape[:-1], 4), np.float16))
    with pytest.raises(ValueError, match="v_zero must have the shape of k_descale"):
        call(v_zero=np.ones((*ks.shape[:-1], 1), np.float16))
    with pytest.raises(ValueError, match="k_descale must be finite"):
        bad = ks.copy()
        bad[0, 0, 0, 0] = np.nan
        call(k_descale=bad)
    with pytest.raises(TypeError, match="INT4 K/V take fp16 or bf16 q"):
        call(qq=q.astype(np.float32))
    # mixed formats between K and V
    with pytest.raises(TypeError, match="v_cache must hold uint8 INT4"):
        call(v=vc.view(np.int8))
    # zero points for other caches
    f16 = np.zeros((2, 16, 2, 64), np.float16)
    with pytest.raises(ValueError, match="k_zero applies to INT4 caches only"):
        fdpp.decode_attention(q, f16, f16, k_zero=kz)
    e4 = np.zeros((2, 16, 2, 64), np.uint8)
    with pytest.raises(ValueError, match="v_zero applies to INT4 caches only"):
        fdpp.decode_attention(q, e4, e4, kv_dtype="fp8_e4m3", v_zero=vz)
    with pytest.raises(ValueError, match="kv_dtype must be None or one of .*'int4'"):
        fdpp.decode_attention(q, e4, e4, kv_dtype="int3")
    # head dims
    q96 = np.zeros((2, 8, 96), np.float16)
    c96 = np.zeros((2, 16, 2, 48), np.uint8)
    s96 = np.ones((2, 16, 2, 3), np.float16)
    with pytest.raises(ValueError, match=r"INT4 K/V take head_dim in \(64, 128\)"):
        fdpp.decode_attention(q96, c96, c96, **_kw(s96, s96, s96, s96))


@needs_no_gpu
def test_non_finite_params_past_the_lengths_are_not_read(rng):
    """NumPy path: scales / zeros must be finite where a request reads them, nowhere else (a cache's
    free slots and unused pages may hold anything), as the kernels read only those."""
    q, (kc, ks, kz), (vc, vs, vz) = _case(rng, n=16)
    lens = np.array([6, 16], np.int32)
    bad = ks.copy()
    bad[0, 6:] = np.nan  # past request 0's length
    good = fdpp.decode_attention(q, kc, vc, cache_seqlens=lens, **_kw(ks, vs, kz, vz))
    got = fdpp.decode_attention(q, kc, vc, cache_seqlens=lens, **_kw(bad, vs, kz, vz))
    assert np.array_equal(got, good)
    bad[0, 5, 0, 0] = np.inf  # the last token request 0 reads
    with pytest.raises(ValueError, match="k_descale must be finite at the tokens a request reads"):
        fdpp.decode_attention(q, kc, vc, cache_seqlens=lens, **_kw(bad, vs, kz, vz))
    # paged: a page no request reads (page 3), and the slots past a length in a page one does
    kp = np.zeros((4, 16, 1, 32), np.uint8)
    s = np.ones((4, 16, 1, 2), np.float16)
    table, plens = np.array([[1, 0]], np.int32), np.array([20], np.int32)
    qp = np.zeros((1, 4, 64), np.float16)
    sb = s.copy()
    sb[3] = np.nan
    sb[0, 4:] = np.nan  # request 0 reads page 1 whole and slots 0..3 of page 0
    fdpp.paged_decode_attention(qp, kp, kp, table, plens, **_kw(s, s, sb, s))
    sb[0, 3, 0, 1] = np.nan
    with pytest.raises(ValueError, match="k_zero must be finite"):
        fdpp.paged_decode_attention(qp, kp, kp, table, plens, **_kw(s, s, sb, s))


def test_paged_argument_errors(rng):
    q = np.zeros((1, 4, 128), np.float16)
    kc = np.zeros((4, 16, 1, 64), np.uint8)
    s = np.ones((4, 16, 1, 2), np.float16)
    table, lens = np.zeros((1, 2), np.int32), np.array([5], np.int32)
    fdpp.paged_decode_attention(q, kc, kc, table, lens, **_kw(s, s, s, s))  # valid
    with pytest.raises(ValueError, match="k_descale must have shape"):
        fdpp.paged_decode_attention(q, kc, kc, table, lens, **_kw(s[:, :8], s, s, s))


def test_decode_plan_takes_int4():
    p = fdpp.DecodePlan(1, 32, 8, 128, 4096, kv_dtype="int4", group_size=32, page_size=16)
    assert p.problem.kv_dtype == "int4_g32" and p.kv_dtype == "int4"
    with pytest.raises(ValueError, match="group_size must be one of"):
        fdpp.DecodePlan(1, 32, 8, 128, 4096, kv_dtype="int4", group_size=16)
    with pytest.raises(ValueError, match="does not divide"):
        fdpp.DecodePlan(1, 32, 8, 64, 4096, kv_dtype="int4", group_size=128)


@needs_no_gpu
def test_decode_plan_runs_int4_on_numpy(rng):
    q, (kc, ks, kz), (vc, vs, vz) = _case(rng, b=1, hq=4, hkv=1, d=128, n=100, g=64)
    p = fdpp.DecodePlan(1, 4, 1, 128, 100, kv_dtype="int4", group_size=64)
    out = p.run(q, kc, vc, k_descale=ks, v_descale=vs, k_zero=kz, v_zero=vz)
    ref, _ = reference(q, dequant(kc, ks, kz), dequant(vc, vs, vz), [100])
    np.testing.assert_allclose(out.astype(np.float32), ref, rtol=4e-3, atol=4e-3)


def test_keys_and_rules():
    prob = configs.DecodeProblem(1, 32, 8, 128, 65536, "fp16", "int4_g64", page_size=16)
    assert prob.quantized
    assert tables.Bucket.of(prob).key == "q32.kv8.d128.fp16.kvi4g64.p16.n65536.b1"
    cfg = configs.default_kernel(prob)
    assert cfg.mma and cfg.kv_dtype == "int4_g64" and cfg.is_valid(configs.SM90) and cfg.is_valid(configs.SM80)
    assert cfg.key.startswith("decode_split_mma.f16.kvi4g64.p16.d128.")
    assert "fdpp::int4_t<64>" in cfg.name_expression()
    # the floor: packed codes plus fp16 scales and zeros
    assert kv_row_bytes("int4_g64", 128) == 64 + 8
    assert prob.kv_bytes() == 2 * 65536 * 8 * 72
    for g, f in INT4_FORMATS.items():
        assert f.name == g and f.tag == f"i4g{f.group_size}"
    # tensor cores only; group within the row; no baseline; D 64/128
    assert "tensor-core path" in configs.DecodeConfig("fp16", 128, 4, kv_dtype="int4_g64").check()
    assert "group 128 > head_dim 64" in configs.DecodeConfig("fp16", 64, 4, 4, 3, 1, mma=True,
                                                             kv_dtype="int4_g128").check()
    assert "head_dim" in configs.DecodeConfig("fp16", 256, 4, 4, 3, 1, mma=True, kv_dtype="int4_g64").check()
    assert not configs.DecodeConfig("fp16", 128, 1, kernel="decode_nosplit", kv_dtype="int4_g64").is_valid()
    combos = configs.kv_combos(64)
    assert ("fp16", "int4_g32") in combos and ("fp16", "int4_g128") not in combos
    assert ("bf16", "int4_g128") in configs.kv_combos(128) and ("fp32", "int4_g64") not in configs.KV_COMBOS
    # shared memory: codes, padded V rows, 4 parameter rows per token
    c = configs.DecodeConfig("fp16", 128, 4, 4, 3, 1, mma=True, kv_dtype="int4_g32")
    assert c.smem_bytes() == 3 * 64 * (2 * 64 + 16 + 32)
    c = configs.DecodeConfig("fp16", 128, 4, 4, 3, 1, mma=True, kv_dtype="int4_g128")  # a lone group: 2 words
    assert c.smem_bytes() == 3 * 64 * (2 * 64 + 16 + 32)


def test_bucket_keys_name_int4():
    prob = configs.DecodeProblem(1, 32, 8, 128, 65536, "fp16", "int4_g32")
    parts = configs.cache_parts(prob.dtype, prob.kv_dtype, prob.page_size)
    assert parts == ["kvi4g32"]
    assert tables.Bucket.of(prob).key == "q32.kv8.d128.fp16.kvi4g32.n65536.b1"
    # an entry of an INT4 bucket round-trips through JSON with its kernel element type
    cfg = configs.default_kernel(prob)
    e = tables.Entry(tables.Bucket.of(prob), cfg, 16, 4)
    back = tables.Entry.from_json(e.to_json(), "t")
    assert back.split == cfg and back.bucket.problem() == configs.DecodeProblem(1, 32, 8, 128, 65536, "fp16", "int4_g32")


def test_bench_int4_parser_and_dequantiser(rng):
    from fdpp import bench, bench_int4

    top, _ = bench.build_parser()
    args = top.parse_args(["attn", "--kv-dtype", "int4", "--int4-group", "32", "--seqlens", "4k,64k", "--batch", "1"])
    assert args.kv_dtype == "int4" and args.int4_group == 32 and args.seqlens == [4096, 65536]
    codes, s, z = random_int4((2, 5, 3, 64), 32, rng)
    np.testing.assert_array_equal(bench_int4._dequant(np, codes, s, z), dequant(codes, s, z))
