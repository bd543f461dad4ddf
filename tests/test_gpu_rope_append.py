"""PagedKVCache.append_rope on the GPU (kernels_cu/paged_append.cu, paged_rope_append), bitwise:

- the scenario of tests/test_rope_append_cpu.py (prefill, decode steps, a fork, positions past the
  RoPE table) on cupy / torch caches of every format: q_out and every stored token equal RoPE in
  float32 written in the test (then the append's quantization, NumPy's), bit for bit;
- against the two unfused launches (the model's rope_qkv kernel, then append) at batch 17 with
  GQA 1 / 4 / 8, pages of 1 and 16, both layouts, q_out poisoned first;
- rows the kernel skips (a position outside the reserved pages, a block-table entry outside the
  pool): nothing written into the cache, q_out written all the same;
- captured in a CUDA graph and replayed after later reserve calls;
- the Llama step with and without the fusion (paged and contiguous caches, eager and captured):
  the same logits bit for bit.
"""

import numpy as np
import pytest
from test_gpu_quant import _to
from test_quant_cache import _bits, gather
from test_rope_append_cpu import FORMATS, HQ, check_scenario, make_cache, rope_f32, rope_scenario, rope_tables

import fdpp
from fdpp.models.llama import LlamaDecoder

pytestmark = pytest.mark.gpu


def _to_dev(cache):
    return lambda x: _to(cache.backend, x)


@pytest.mark.parametrize("backend", ["cupy", "torch"])
@pytest.mark.parametrize("fmt, g", FORMATS)
@pytest.mark.parametrize("layout, page_size", [("NHD", 16), ("HND", 1)])
def test_scenario_bitwise(backend, fmt, g, layout, page_size):
    cache = make_cache(backend, fmt, g, layout, page_size)
    exp, qs = rope_scenario(cache, seed=7, to_dev=_to_dev(cache), to_np=cache.to_numpy)
    check_scenario(cache, exp, qs)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_scenario_dtypes(dtype):
    cache = make_cache("torch", None, 64, "NHD", 16, dtype=dtype)
    exp, qs = rope_scenario(cache, seed=8, to_dev=_to_dev(cache), to_np=cache.to_numpy, steps=3)
    check_scenario(cache, exp, qs)


@pytest.mark.parametrize("hq, hkv", [(8, 8), (16, 4), (32, 4)])
@pytest.mark.parametrize("fmt, layout, page_size", [(None, "NHD", 1), ("fp8_e4m3", "HND", 16), ("int4", "NHD", 16)])
def test_fused_equals_rope_then_append(hq, hkv, fmt, layout, page_size):
    """Batch 17, lengths 1..300 (not multiples of the page), two caches fed the same rows: one through
    append_rope, one through the model's rope_qkv kernel and append; every pool equal bit for bit. Not
    vacuously: q_out (poisoned) written without NaN, each step's slot of every sequence holds a row
    in the (zeroed) K / V pools, and no other row does."""
    import torch

    from fdpp.models._backends import make_ops

    d, b = 128, 17
    ops = make_ops("torch", "fp16")
    caches = [fdpp.PagedKVCache(2, b * (320 // page_size + 1), page_size, hkv, d, backend="torch", kv_layout=layout,
                                max_batch=b, kv_format=fmt, group_size=64) for _ in range(2)]
    rng = np.random.default_rng(hq + hkv)
    lens = rng.integers(1, 300, b)
    lens[0] = 1
    cos, sin = (torch.from_numpy(t).cuda() for t in rope_tables(290, d))  # some positions past the table
    for c in caches:
        seqs = [c.allocate() for _ in range(b)]  # the same ids in both caches
        for s, n in zip(seqs, lens, strict=True):
            c.extend_reserve(s, int(n))
        c.set_batch(seqs)
    for _ in range(3):
        for c in caches:
            c.reserve(1)
        for layer in range(2):
            x = (torch.randn(b, (hq + 2 * hkv) * d, device="cuda") * 4).half()
            qa = torch.full((b, hq, d), float("nan"), device="cuda", dtype=torch.float16)
            caches[0].append_rope(layer, x, cos, sin, qa)
            qb = torch.full((b, hq, d), float("nan"), device="cuda", dtype=torch.float16)
            kb, vb = (torch.empty(b, hkv, d, device="cuda", dtype=torch.float16) for _ in range(2))
            ops.rope_qkv(x, cos, sin, caches[1].seqlens, qb, kb, vb)
            caches[1].append(layer, kb, vb)
            assert torch.equal(qa.view(torch.int16), qb.view(torch.int16))
            assert not torch.isnan(qa).any() and bool(qa.any())
    torch.cuda.synchronize()
    pools = ["k_pages", "v_pages"] + (["k_scale_pages", "k_zero_pages", "v_scale_pages", "v_zero_pages"]
                                      if fmt == "int4" else [])
    for layer in range(2):
        for name in pools:
            a, bb = (caches[i].to_numpy(getattr(caches[i], name)(layer)) for i in range(2))
            np.testing.assert_array_equal(a.view(f"u{a.dtype.itemsize}"), bb.view(f"u{bb.dtype.itemsize}"),
                                          err_msg=f"layer {layer} {name}")
        for name in ("k_pages", "v_pages"):  # extend_reserve wrote nothing: only the 3 steps' rows are set
            pool = caches[0].to_numpy(getattr(caches[0], name)(layer))
            u = pool.view(f"u{pool.dtype.itemsize}")
            for s in seqs:
                assert (gather(caches[0], s, u)[-3:].reshape(3, hkv, -1) != 0).any(axis=-1).all(), (layer, name, s)
            assert int((u.reshape(-1, u.shape[-1]) != 0).any(axis=1).sum()) == 3 * b * hkv, (layer, name)


@pytest.mark.parametrize("backend", ["cupy", "torch"])
@pytest.mark.parametrize("fmt, g", [(None, 64), ("int4", 32)])
def test_kernel_skips_bad_rows_writes_q(backend, fmt, g):
    """The device-side safety of kernels_cu/paged_append.cu (the rules paged_rope_append's K / V share
    with paged_append): a row whose position seqlens[r] - 1 is outside [0, max_pages * PAGE_SIZE), or
    whose block-table entry is outside [0, num_pages), writes nothing into the cache; its q_out row
    is written all the same (grid.y 2), rotated at clamp(seqlens[r] - 1, 0, n_pos - 1). The bad
    tables are set on the device after reserve, as tests/test_paged_cache.py's
    test_kernel_skips_bad_rows does for append."""
    d, n_pos = 64, 8
    cache = fdpp.PagedKVCache(1, 32, 16, 2, d, max_batch=8, max_pages_per_seq=4, backend=backend,
                              kv_format=fmt, group_size=g)
    h = cache.num_kv_heads
    seqs = [cache.allocate() for _ in range(5)]
    cache.set_batch(seqs)
    cache.reserve(3)  # every row at position 2 of its first page
    lens = np.array([0, 4 * 16 + 1, 3, 3, 3], np.int32)  # row 0: position -1; row 1: 64, past the table row
    cache._len_dev[:5] = _to(backend, lens)
    cache._bt_dev[2, 0] = -1  # rows 2 and 3: entries outside [0, num_pages); row 4 alone is valid
    cache._bt_dev[3, 0] = 32
    rng = np.random.default_rng(11)
    x = rng.standard_normal((5, HQ + 2 * h, d)).astype(np.float16)
    cos, sin = rope_tables(n_pos, d)
    q = _to(backend, np.full((5, HQ, d), np.nan, np.float16))  # poisoned
    pools = ["k_pages", "v_pages"] + (["k_scale_pages", "k_zero_pages", "v_scale_pages", "v_zero_pages"]
                                      if fmt == "int4" else [])
    before = {n: _bits(cache.to_numpy(getattr(cache, n)(0))).copy() for n in pools}
    cache.append_rope(0, _to(backend, x.reshape(5, -1)), _to(backend, cos), _to(backend, sin), q)
    tpos = np.clip(lens.astype(np.int64) - 1, 0, n_pos - 1)  # [0, 7, 2, 2, 2]
    rot = rope_f32(x[:, :HQ + h], cos[tpos], sin[tpos]).astype(np.float16)
    np.testing.assert_array_equal(_bits(cache.to_numpy(q)), _bits(rot[:, :HQ]))  # every row, skipped or not
    page4 = cache.pages(seqs[4])[0]
    for name in pools:
        after = _bits(cache.to_numpy(getattr(cache, name)(0)))
        changed = np.argwhere((after != before[name]).reshape(after.shape[0], after.shape[1], -1).any(axis=-1))
        assert changed.tolist() == [[page4, 2]], name  # (page, slot) pairs (NHD): row 4's slot alone
    if fmt is None:
        k, v = (_bits(cache.to_numpy(getattr(cache, n)(0)))[page4, 2] for n in ("k_pages", "v_pages"))
        np.testing.assert_array_equal(k, _bits(rot[4, HQ:]))
        np.testing.assert_array_equal(v, _bits(x[4, HQ + h:]))


def test_graph_replay_after_reserve():
    """append_rope captured once, replayed after each reserve: writes the new positions."""
    import torch

    d, hq, hkv = 64, 4, 2
    live, ref = (fdpp.PagedKVCache(1, 40, 16, hkv, d, backend=be, max_batch=2) for be in ("torch", "numpy"))
    cos, sin = rope_tables(64, d)
    tc, ts = torch.from_numpy(cos).cuda(), torch.from_numpy(sin).cuda()
    for c in (live, ref):
        seqs = [c.allocate() for _ in range(2)]
        c.extend_reserve(seqs[0], 15)
        c.extend_reserve(seqs[1], 3)
        c.set_batch(seqs)
        c.reserve(1)
    x = torch.zeros(2, (hq + 2 * hkv) * d, device="cuda", dtype=torch.float16)
    q = torch.zeros(2, hq, d, device="cuda", dtype=torch.float16)
    live.append_rope(0, x, tc, ts, q)  # warm-up (compiles) before the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        live.append_rope(0, x, tc, ts, q)
    qh = np.empty((2, hq, d), np.float16)
    rng = np.random.default_rng(1)
    for step in range(4):
        if step:
            live.reserve(1)
            ref.reserve(1)
        xh = rng.standard_normal((2, (hq + 2 * hkv) * d)).astype(np.float16)
        x.copy_(torch.from_numpy(xh))
        g.replay()
        ref.append_rope(0, xh, cos, sin, qh)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(q.cpu().numpy(), qh)
    np.testing.assert_array_equal(live.to_numpy(live.k_pages(0)), ref.k_pages(0))
    np.testing.assert_array_equal(live.to_numpy(live.v_pages(0)), ref.v_pages(0))


@pytest.mark.parametrize("backend", ["torch", "cupy"])
@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_llama_step_with_and_without_the_fusion(backend, cache):
    a, b = (LlamaDecoder("llama3-8b", 2, 600, num_layers=2, vocab=4096, backend=backend, cache=cache, seed=3,
                         fuse_rope_append=f) for f in (True, False))
    assert [n for n, _ in a.program].count("rope_append") == 2
    for m in (a, b):
        m.prefill_random([300, 77])
    sa, sb = a.capture([5, 6]), b.capture([5, 6])
    for ids in ([1, 2], [3, 4], [4000, 0]):
        np.testing.assert_array_equal(a.ops.to_numpy(sa(ids)), b.ops.to_numpy(sb(ids)))
    np.testing.assert_array_equal(a.ops.to_numpy(a.step([7, 8])), b.ops.to_numpy(b.step([7, 8])))
