"""PagedKVCache.append_rope on the GPU (kernels_cu/paged_append.cu, paged_rope_append), bitwise:

- the scenario of tests/test_rope_append_cpu.py (prefill, decode steps, a fork, positions past the
  RoPE table) on cupy / torch caches of every format: q_out and every stored token equal RoPE in
  float32 written in the test (then the append's quantization, NumPy's), bit for bit;
- against the two unfused launches (the model's rope_qkv kernel, then append) at batch 17 with
  GQA 1 / 4 / 8, pages of 1 and 16, both layouts, q_out poisoned first;
- captured in a CUDA graph and replayed after later reserve calls;
- the Llama step with and without the fusion (paged and contiguous caches, eager and captured):
  the same logits bit for bit.
"""

import numpy as np
import pytest
from test_gpu_quant import _to
from test_rope_append_cpu import FORMATS, check_scenario, make_cache, rope_scenario, rope_tables

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
    append_rope, one through the model's rope_qkv kernel and append; every pool equal bit for bit."""
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
        seqs = [c.allocate() for _ in range(b)]
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
    torch.cuda.synchronize()
    pools = ["k_pages", "v_pages"] + (["k_scale_pages", "k_zero_pages", "v_scale_pages", "v_zero_pages"]
                                      if fmt == "int4" else [])
    for layer in range(2):
        for name in pools:
            a, bb = (caches[i].to_numpy(getattr(caches[i], name)(layer)) for i in range(2))
            np.testing.assert_array_equal(a.view(f"u{a.dtype.itemsize}"), bb.view(f"u{bb.dtype.itemsize}"),
                                          err_msg=f"layer {layer} {name}")


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
