"""fdpp.distributed on one GPU (run on the H200): shards of one cache on one device merged
(sharded_decode_attention, no NCCL) against fdpp.decode_attention over the whole cache and the
float64 reference (fdpp.reference.attention_reference through CuPy, never an fdpp kernel); the
NCCL paths through a 1-rank torch process group and a 1-rank CuPy NCCL communicator; paged shards;
CUDA-graph capture of a whole context_parallel_decode.

Every output given as ``out`` is poisoned (NaN) first, so an unwritten element fails.
"""

import itertools
import os

import numpy as np
import pytest

import fdpp
from fdpp.distributed import (
    ThreadedGroup,
    context_parallel_decode,
    shard_bounds,
    shard_cache,
    sharded_decode_attention,
)
from fdpp.dtypes import DTYPES
from fdpp.reference import assert_close, attention_reference

pytestmark = pytest.mark.gpu

DTS = ["fp16", "bf16", "fp32"]


def _cp():
    import cupy

    return cupy


def _torch():
    return pytest.importorskip("torch")


def _tdt(torch, dt):
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dt]


def _make(lib, dt, shape, rng, scale=1.0):
    x = (rng.standard_normal(shape, dtype=np.float32) * scale)
    if lib == "torch":
        torch = _torch()
        return torch.from_numpy(x).cuda().to(_tdt(torch, dt))
    return _cp().asarray(x.astype(DTYPES[dt].np_dtype))


def _lens(lib, values):
    a = np.asarray(values, dtype=np.int32)
    if lib == "torch":
        return _torch().from_numpy(a).cuda()
    return _cp().asarray(a)


def _f32(x):
    """A CuPy float32 copy of a CuPy array or torch CUDA tensor (for the references)."""
    cp = _cp()
    if type(x).__module__.split(".")[0] == "torch":
        return cp.from_dlpack(x.float().contiguous())
    return x.astype(cp.float32)


def _host(x):
    return _cp().asnumpy(_f32(x))


def _poison(lib, dt, shape):
    if lib == "torch":
        torch = _torch()
        return torch.full(shape, float("nan"), device="cuda", dtype=_tdt(torch, dt))
    return _cp().full(shape, np.nan, dtype=np.float32).astype(DTYPES[dt].np_dtype)


def _cache(lib, dt, b, hq, hkv, d, n, layout, rng):
    shape = (b, n, hkv, d) if layout == "NHD" else (b, hkv, n, d)
    return _make(lib, dt, (b, hq, d), rng), _make(lib, dt, shape, rng, 2.0), _make(lib, dt, shape, rng)


def _reference(q, k, v, lens, layout="NHD"):
    cp = _cp()
    lens_h = None if lens is None else cp.asarray(_host(lens).astype(np.int64))
    ref, ref_lse = attention_reference(_f32(q), _f32(k), _f32(v), lens_h, kv_layout=layout)
    return cp.asnumpy(ref), cp.asnumpy(ref_lse)


def _check(o, lse, ref, ref_lse, dt):
    assert_close(_host(o), ref, dt)
    lse_h = _host(lse)
    np.testing.assert_array_equal(np.isneginf(lse_h), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse_h[fin], ref_lse[fin], rtol=1e-4, atol=1e-3)  # as test_gpu_attention


def _equal(a, b):
    if type(a).__module__.split(".")[0] == "torch":
        return bool(_torch().equal(a, b))
    return bool(_cp().array_equal(a, b))


def _uneven(n, w):
    """W ranges over [0, n): uneven; shard 1 empty (N_local = 0) when W >= 3."""
    edges = {1: [0, n], 2: [0, n // 3, n], 3: [0, n // 7, n // 7, n], 4: [0, n // 7, n // 7, n // 2, n]}[w]
    return list(itertools.pairwise(edges))


# ---- shards on one GPU, no NCCL ----------------------------------------------------------------------
GRID = list(itertools.product(["cupy", "torch"], DTS, ["NHD", "HND"]))


@pytest.mark.parametrize("lib, dt, layout", GRID, ids=lambda x: str(x))
def test_sharded_matches_full_and_reference(lib, dt, layout, rng):
    b, hq, hkv, d, n = 3, 32, 8, 128, 5003
    q, k, v = _cache(lib, dt, b, hq, hkv, d, n, layout, rng)
    lens = _lens(lib, [n, 0, 1234])  # full, empty on every shard, ends inside a middle shard
    for w in (1, 2, 4):
        shards = shard_cache(k, v, lens, _uneven(n, w), kv_layout=layout)
        out = _poison(lib, dt, (b, hq, d))
        o, lse = sharded_decode_attention(q, [s[0] for s in shards], [s[1] for s in shards],
                                          [s[2] for s in shards], kv_layout=layout, out=out, return_lse=True)
        assert o is out
        ref, ref_lse = _reference(q, k, v, lens, layout)
        _check(o, lse, ref, ref_lse, dt)
        full, full_lse = fdpp.decode_attention(q, k, v, cache_seqlens=lens, kv_layout=layout, return_lse=True)
        tol = DTYPES[dt]
        np.testing.assert_allclose(_host(o), _host(full), rtol=2 * tol.rtol, atol=2 * tol.atol)
        np.testing.assert_allclose(_host(lse)[[0, 2]], _host(full_lse)[[0, 2]], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_llama70b_heads_b1_balanced(lib, rng):
    """llama3-70b heads (64 q / 8 KV, D 128), B = 1, 64k tokens, 8 balanced shards, no lengths."""
    q, k, v = _cache(lib, "bf16", 1, 64, 8, 128, 65536, "NHD", rng)
    shards = shard_cache(k, v, None, shard_bounds(65536, 8))
    o, lse = sharded_decode_attention(q, [s[0] for s in shards], [s[1] for s in shards], return_lse=True)
    ref, ref_lse = _reference(q, k, v, None)
    _check(o, lse, ref, ref_lse, "bf16")


@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_threaded_ranks_on_one_gpu(lib, rng):
    """The threaded exchange with device arrays (stacked on the device)."""
    q, k, v = _cache(lib, "fp16", 2, 16, 4, 128, 3000, "NHD", rng)
    lens = _lens(lib, [3000, 17])
    shards = shard_cache(k, v, lens, shard_bounds(3000, 3))
    one = sharded_decode_attention(q, [s[0] for s in shards], [s[1] for s in shards], [s[2] for s in shards],
                                   return_lse=True)  # first: kernels compiled before the threads start
    res = ThreadedGroup(3, timeout=60).run(
        lambda ex: context_parallel_decode(q, *shards[ex.rank], group=ex, return_lse=True))
    for o, lse in res:
        assert _equal(o, one[0]) and _equal(lse, one[1])


# ---- paged shards ---------------------------------------------------------------------------------
def _paged(lib, k, page, rng):
    """Page pools (shuffled pages, garbage elsewhere) holding the NHD shard k [B, n, Hkv, D]."""
    b, n, hkv, d = k.shape
    per = max(1, -(-n // page))
    num_pages = b * per + 5
    order = rng.permutation(num_pages)[: b * per].reshape(b, per).astype(np.int32)
    if lib == "torch":
        torch = _torch()
        pool = torch.full((num_pages, page, hkv, d), 1e4, device="cuda", dtype=k.dtype)
        pad = torch.zeros((b, per * page, hkv, d), device="cuda", dtype=k.dtype)
        pad[:, :n] = k
        pool[torch.from_numpy(order).cuda().long()] = pad.reshape(b, per, page, hkv, d)
        return pool, torch.from_numpy(order).cuda()
    cp = _cp()
    pool = cp.full((num_pages, page, hkv, d), 1e4, dtype=np.float32).astype(k.dtype)
    pad = cp.zeros((b, per * page, hkv, d), dtype=k.dtype)
    pad[:, :n] = k
    pool[cp.asarray(order)] = pad.reshape(b, per, page, hkv, d)
    return pool, cp.asarray(order)


@pytest.mark.parametrize("lib, page", list(itertools.product(["cupy", "torch"], [16, 64])))
def test_paged_shards(lib, page, rng):
    b, hq, hkv, d, n = 3, 32, 8, 128, 4099
    q, k, v = _cache(lib, "fp16", b, hq, hkv, d, n, "NHD", rng)
    lens = _lens(lib, [n, 0, 2000])
    shards = shard_cache(k, v, lens, _uneven(n, 3))
    kps, vps, tables, lss = [], [], [], []
    for ks, vs, ls in shards:
        kp, table = _paged(lib, ks, page, np.random.default_rng(len(kps)))
        vp, _ = _paged(lib, vs, page, np.random.default_rng(len(kps)))  # same seed: same pages
        kps.append(kp)
        vps.append(vp)
        tables.append(table)
        lss.append(ls)
    o, lse = sharded_decode_attention(q, kps, vps, lss, block_tables=tables, return_lse=True)
    ref, ref_lse = _reference(q, k, v, lens)
    _check(o, lse, ref, ref_lse, "fp16")
    contiguous = sharded_decode_attention(q, [s[0] for s in shards], [s[1] for s in shards], lss)
    tol = DTYPES["fp16"]
    np.testing.assert_allclose(_host(o), _host(contiguous), rtol=2 * tol.rtol, atol=2 * tol.atol)


# ---- NCCL: a 1-rank torch process group -----------------------------------------------------------
@pytest.fixture(scope="module")
def torch_group(tmp_path_factory):
    torch = _torch()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available()):
        pytest.skip("torch.distributed without NCCL")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(0)
    path = tmp_path_factory.mktemp("rdzv") / "file"
    dist.init_process_group("nccl", init_method=f"file://{path}", world_size=1, rank=0)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_torch_nccl_one_rank(torch_group, rng):
    torch = _torch()
    q, k, v = _cache("torch", "bf16", 3, 32, 8, 128, 4096, "NHD", rng)
    lens = _lens("torch", [4096, 0, 77])
    out = _poison("torch", "bf16", (3, 32, 128))
    o, lse = context_parallel_decode(q, k, v, lens, group=torch_group, out=out, return_lse=True)
    assert o is out
    ref, ref_lse = _reference(q, k, v, lens)
    _check(o, lse, ref, ref_lse, "bf16")
    one = sharded_decode_attention(q, [k], [v], [lens], return_lse=True)
    assert torch.equal(o, one[0]) and torch.equal(lse, one[1])  # the same kernels, with or without NCCL
    full = fdpp.decode_attention(q, k, v, cache_seqlens=lens)
    np.testing.assert_allclose(_host(o), _host(full), rtol=2 * DTYPES["bf16"].rtol, atol=2 * DTYPES["bf16"].atol)
    empty = context_parallel_decode(q, k[:, :0], v[:, :0], group=torch_group, return_lse=True)  # N_local = 0
    assert empty[0].float().abs().max().item() == 0 and torch.isneginf(empty[1]).all()


def test_torch_nccl_paged(torch_group, rng):
    q, k, v = _cache("torch", "fp16", 2, 64, 8, 128, 3000, "NHD", rng)
    lens = _lens("torch", [3000, 1500])
    kp, table = _paged("torch", k, 16, np.random.default_rng(5))
    vp, _ = _paged("torch", v, 16, np.random.default_rng(5))
    o, lse = context_parallel_decode(q, kp, vp, lens, block_table=table, group=torch_group, return_lse=True)
    ref, ref_lse = _reference(q, k, v, lens)
    _check(o, lse, ref, ref_lse, "fp16")


@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_torch_nccl_graph_capture(torch_group, mode, rng):
    """The whole step (local decode, NCCL all-gather, merge) captured with torch.cuda.graph, in
    torch's default capture mode ("global": other threads, such as ProcessGroupNCCL's watchdog,
    may make no unsafe CUDA call meanwhile) and in "thread_local"."""
    torch = _torch()
    q, k, v = _cache("torch", "fp16", 1, 64, 8, 128, 32768, "NHD", rng)
    lens = _lens("torch", [30000])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on the capture stream: kernels compiled, communicator made
        context_parallel_decode(q, k, v, lens, group=torch_group)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode=mode):
        out, lse = context_parallel_decode(q, k, v, lens, group=torch_group, return_lse=True)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    want, want_lse = context_parallel_decode(q, k, v, lens, group=torch_group, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    q.copy_(torch.randn_like(q))  # new query and length, same graph
    lens.fill_(1000)
    g.replay()
    torch.cuda.synchronize()
    want = context_parallel_decode(q, k, v, lens, group=torch_group)
    assert torch.equal(out, want)
    ref, _ = _reference(q, k, v, lens)
    assert_close(_host(out), ref, "fp16")


def test_torch_group_validation(torch_group, rng):
    import torch.distributed as dist

    q, k, v = _cache("torch", "fp16", 1, 8, 8, 64, 64, "NHD", rng)
    cq = _cp().asarray(np.zeros((1, 8, 64), np.float16))
    with pytest.raises(TypeError, match="NcclCommunicator for CuPy arrays"):
        context_parallel_decode(cq, cq, cq, group=torch_group)
    with pytest.raises(TypeError, match="ProcessGroup"):
        context_parallel_decode(q, k, v, group=object())
    with pytest.raises(TypeError, match="local_k must be the same array type"):
        context_parallel_decode(q, _cp().asarray(np.zeros((1, 64, 8, 64), np.float16)), v, group=torch_group)
    gloo = dist.new_group(backend="gloo")
    try:
        with pytest.raises(ValueError, match="NCCL backend"):
            context_parallel_decode(q, k, v, group=gloo)
    finally:
        dist.destroy_process_group(gloo)
    with pytest.raises(ValueError, match="out must not overlap local_v"):
        context_parallel_decode(q, k, v, group=torch_group, out=v.reshape(-1)[: q.numel()].view(q.shape))


# ---- NCCL: a 1-rank CuPy communicator --------------------------------------------------------------
@pytest.fixture(scope="module")
def cupy_comm():
    cp = _cp()
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        pytest.skip(f"cupy.cuda.nccl does not import: {e}")
    if not getattr(nccl, "available", True):
        pytest.skip("CuPy finds no NCCL library (cupy.cuda.nccl.available is False)")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with cp.cuda.Device(0):
        comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    yield comm
    comm.destroy()


def test_cupy_nccl_one_rank(cupy_comm, rng):
    cp = _cp()
    q, k, v = _cache("cupy", "fp16", 3, 32, 4, 128, 4096, "HND", rng)
    lens = _lens("cupy", [4096, 0, 300])
    out = _poison("cupy", "fp16", (3, 32, 128))
    o, lse = context_parallel_decode(q, k, v, lens, group=cupy_comm, kv_layout="HND", out=out, return_lse=True)
    assert o is out
    ref, ref_lse = _reference(q, k, v, lens, "HND")
    _check(o, lse, ref, ref_lse, "fp16")
    one = sharded_decode_attention(q, [k], [v], [lens], kv_layout="HND", return_lse=True)
    assert cp.array_equal(o, one[0]) and cp.array_equal(lse, one[1])
    kp, table = _paged("cupy", cp.ascontiguousarray(k.transpose(0, 2, 1, 3)), 32, np.random.default_rng(1))
    vp, _ = _paged("cupy", cp.ascontiguousarray(v.transpose(0, 2, 1, 3)), 32, np.random.default_rng(1))
    po = context_parallel_decode(q, kp, vp, lens, block_table=table, group=cupy_comm)
    assert_close(_host(po), ref, "fp16")


def test_cupy_nccl_graph_capture(cupy_comm, rng):
    cp = _cp()
    q, k, v = _cache("cupy", "bf16", 1, 64, 8, 128, 32768, "NHD", rng)
    eager = context_parallel_decode(q, k, v, group=cupy_comm)  # compiles, sizes the workspaces
    out = _poison("cupy", "bf16", (1, 64, 128))
    s = cp.cuda.Stream(non_blocking=True)
    s.wait_event(cp.cuda.get_current_stream().record())  # the work queued before (inputs) first
    with s:
        s.begin_capture()
        context_parallel_decode(q, k, v, group=cupy_comm, out=out)
        g = s.end_capture()
        g.launch()
    s.synchronize()
    bits = cp.uint16  # bf16 compared bit for bit
    assert cp.array_equal(out.view(bits), eager.view(bits))
    q[...] = _make("cupy", "bf16", q.shape, rng)
    with s:
        g.launch()
    s.synchronize()
    assert cp.array_equal(out.view(bits), context_parallel_decode(q, k, v, group=cupy_comm).view(bits))


def test_cupy_comm_validation(cupy_comm, rng):
    torch = _torch()
    q = torch.zeros((1, 8, 64), device="cuda", dtype=torch.float16)
    with pytest.raises(TypeError, match="ProcessGroup"):
        context_parallel_decode(q, q[:, None].expand(1, 4, 8, 64), q[:, None].expand(1, 4, 8, 64), group=cupy_comm)
