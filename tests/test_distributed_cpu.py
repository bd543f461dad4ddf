"""fdpp.distributed on the CPU (no torch, no GPU needed): W ranks simulated as threads of one process
(fdpp.distributed.ThreadedGroup), NumPy shards (fdpp's split-KV emulator), merged results against
the float64 attention over the whole cache (fdpp.reference.attention_reference: plain NumPy, never
an fdpp kernel).

The caches are adversarial: lengths no multiple of W, uneven shards, a shard with no tokens at all,
a request of length 0 on every rank, requests whose tokens end before the last shards begin,
interleaved (round-robin) shards, paged shards with shuffled pages, ranks mixing paged and
contiguous shards. Every output is poisoned (NaN) first where the API takes ``out``.
"""

import itertools
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest

import fdpp
from fdpp import distributed as dist_mod
from fdpp import exchange
from fdpp.distributed import (
    ThreadedGroup,
    context_parallel_decode,
    shard_bounds,
    shard_cache,
    sharded_decode_attention,
)
from fdpp.dtypes import DTYPES
from fdpp.reference import assert_close, attention_reference

pytestmark = pytest.mark.filterwarnings("ignore:fdpp. no GPU found:RuntimeWarning")

B, N_MAX = 3, 37


def _cache(rng, dt, b, hq, hkv, d, n, layout="NHD"):
    npd = DTYPES[dt].np_dtype
    q = rng.standard_normal((b, hq, d)).astype(npd)
    shape = (b, n, hkv, d) if layout == "NHD" else (b, hkv, n, d)
    k = (rng.standard_normal(shape) * 2).astype(npd)  # * 2: peaked softmax, lse spread across shards
    v = rng.standard_normal(shape).astype(npd)
    return q, k, v


def _uneven_bounds(rng, n, w):
    """W increasing ranges covering [0, n): random cut points, one shard empty when W >= 3."""
    cuts = sorted(rng.integers(0, n + 1, size=w - 1).tolist())
    if w >= 3:
        cuts[1] = cuts[0]  # shard 1 holds no positions at all (N_local = 0)
    edges = [0, *cuts, n]
    return list(itertools.pairwise(edges))


def _check_ranks(results, ref, ref_lse, dt):
    """Every rank's (out, lse) equals the reference, and all ranks agree bitwise."""
    o0, l0 = results[0]
    for o, lse in results:
        assert o.dtype == DTYPES[dt].np_dtype and lse.dtype == np.float32
        np.testing.assert_array_equal(o.view(np.uint8), o0.view(np.uint8))
        np.testing.assert_array_equal(lse, l0)
    assert_close(o0.astype(np.float64), ref, dt)
    np.testing.assert_array_equal(np.isneginf(l0), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(l0[fin], ref_lse[fin], rtol=1e-5, atol=1e-4)


def _run(shards, q, w, **kw):
    g = ThreadedGroup(w, timeout=30)
    return g.run(lambda ex: context_parallel_decode(q, *shards[ex.rank], group=ex, return_lse=True, **kw))


# ---- against the float64 reference -----------------------------------------------------------------
CASES = list(itertools.product(["fp32", "fp16", "bf16"], [2, 3, 5], [1, 4, 8], ["NHD", "HND"]))


@pytest.mark.parametrize("dt, w, gqa, layout", CASES, ids=lambda x: str(x))
def test_threaded_matches_reference(dt, w, gqa, layout, rng):
    hkv = 2 if gqa < 8 else 1
    q, k, v = _cache(rng, dt, B, hkv * gqa, hkv, 64, N_MAX, layout)
    lens = np.array([N_MAX, 0, 11], dtype=np.int32)  # full, empty everywhere, ends in an early shard
    shards = shard_cache(k, v, lens, _uneven_bounds(rng, N_MAX, w), kv_layout=layout)
    results = _run(shards, q, w, kv_layout=layout)
    ref, ref_lse = attention_reference(q, k, v, lens, kv_layout=layout)
    _check_ranks(results, ref, ref_lse, dt)
    assert not results[0][0][1].any() and np.isneginf(results[0][1][1]).all()  # length 0: zeros, -inf
    one = sharded_decode_attention(q, [s[0] for s in shards], [s[1] for s in shards], [s[2] for s in shards],
                                   kv_layout=layout, return_lse=True)
    np.testing.assert_array_equal(one[0].view(np.uint8), results[0][0].view(np.uint8))
    np.testing.assert_array_equal(one[1], results[0][1])


@pytest.mark.parametrize("w", [1, 4])
def test_balanced_shards_no_lengths(w, rng):
    """shard_bounds' balanced shards, cache_seqlens None (every request N_max), D 128, scale given."""
    q, k, v = _cache(rng, "fp16", 2, 8, 8, 128, 50)
    shards = shard_cache(k, v, None, shard_bounds(50, w))
    assert all(s[2] is None for s in shards)
    results = _run(shards, q, w, softmax_scale=0.3)
    ref, ref_lse = attention_reference(q, k, v, softmax_scale=0.3)
    _check_ranks(results, ref, ref_lse, "fp16")


def test_more_ranks_than_tokens(rng):
    """W = 6 over 4 positions: two ranks hold an empty [B, 0, Hkv, D] shard."""
    q, k, v = _cache(rng, "fp32", 2, 4, 1, 64, 4)
    bounds = shard_bounds(4, 6)
    assert [b - a for a, b in bounds] == [1, 1, 1, 1, 0, 0]
    shards = shard_cache(k, v, np.array([4, 2], np.int32), bounds)
    assert shards[5][0].shape == (2, 0, 1, 64)
    results = _run(shards, q, 6)
    ref, ref_lse = attention_reference(q, k, v, np.array([4, 2]))
    _check_ranks(results, ref, ref_lse, "fp32")


def test_round_robin_shards(rng):
    """Rank r holds tokens r, r + W, r + 2W, ... (strided views): the key order does not matter."""
    w = 3
    q, k, v = _cache(rng, "fp16", B, 8, 2, 64, N_MAX)
    lens = np.array([N_MAX, 1, 20], dtype=np.int32)
    shards = [(k[:, r::w], v[:, r::w], np.maximum(0, -(-(lens - r) // w)).astype(np.int32)) for r in range(w)]
    results = _run(shards, q, w)
    ref, ref_lse = attention_reference(q, k, v, lens)
    _check_ranks(results, ref, ref_lse, "fp16")


# ---- paged shards ----------------------------------------------------------------------------------
def _paged(rng, k, v, lens, page):
    """A contiguous NHD shard [B, n, Hkv, D] as page pools with shuffled pages and garbage in the
    unused slots and pages: (k_pages, v_pages, block_table, lens)."""
    b, n, hkv, d = k.shape
    per = max(1, -(-n // page))
    num_pages = b * per + 3
    pools = []
    order = rng.permutation(num_pages)[: b * per].reshape(b, per).astype(np.int32)
    for x in (k, v):
        pool = np.full((num_pages, page, hkv, d), 1e4, dtype=x.dtype)  # read by mistake: a wrong result
        pad = np.zeros((b, per * page, hkv, d), dtype=x.dtype)
        pad[:, :n] = x
        pool[order] = pad.reshape(b, per, page, hkv, d)
        pools.append(pool)
    return pools[0], pools[1], order, lens


@pytest.mark.parametrize("page", [1, 4, 16])
def test_paged_shards(page, rng):
    w = 3
    q, k, v = _cache(rng, "fp16", B, 8, 2, 64, N_MAX)
    lens = np.array([N_MAX, 0, 30], dtype=np.int32)
    contiguous = shard_cache(k, v, lens, _uneven_bounds(rng, N_MAX, w))
    paged = [_paged(rng, ks, vs, ls, page) for ks, vs, ls in contiguous]
    g = ThreadedGroup(w, timeout=30)
    results = g.run(lambda ex: context_parallel_decode(q, *paged[ex.rank][:2], paged[ex.rank][3], group=ex,
                                                       block_table=paged[ex.rank][2], return_lse=True))
    ref, ref_lse = attention_reference(q, k, v, lens)
    _check_ranks(results, ref, ref_lse, "fp16")
    one = sharded_decode_attention(q, [p[0] for p in paged], [p[1] for p in paged], [p[3] for p in paged],
                                   block_tables=[p[2] for p in paged], return_lse=True)
    np.testing.assert_array_equal(one[0], results[0][0])


def test_ranks_mix_paged_and_contiguous(rng):
    """Rank 0 paged, rank 1 contiguous: the exchanged buffers have one layout either way."""
    q, k, v = _cache(rng, "fp32", B, 4, 4, 64, N_MAX)
    lens = np.array([N_MAX, 3, 25], dtype=np.int32)
    (k0, v0, l0), (k1, v1, l1) = shard_cache(k, v, lens, [(0, 20), (20, N_MAX)])
    kp, vp, table, _ = _paged(rng, k0, v0, l0, 8)

    def rank(ex):
        if ex.rank == 0:
            return context_parallel_decode(q, kp, vp, l0, block_table=table, group=ex, return_lse=True)
        return context_parallel_decode(q, k1, v1, l1, group=ex, return_lse=True)

    ref, ref_lse = attention_reference(q, k, v, lens)
    _check_ranks(ThreadedGroup(2, timeout=30).run(rank), ref, ref_lse, "fp32")


# ---- outputs -----------------------------------------------------------------------------------------
def test_out_written_and_returned(rng):
    q, k, v = _cache(rng, "fp16", B, 8, 2, 64, N_MAX)
    shards = shard_cache(k, v, None, shard_bounds(N_MAX, 2))
    outs = [np.full(q.shape, np.nan, dtype=q.dtype) for _ in range(2)]
    res = ThreadedGroup(2, timeout=30).run(
        lambda ex: context_parallel_decode(q, *shards[ex.rank], group=ex, out=outs[ex.rank]))
    ref, _ = attention_reference(q, k, v)
    for o, given in zip(res, outs, strict=True):
        assert o is given  # return_lse=False: the array alone
        assert_close(o.astype(np.float64), ref, "fp16")
    ws = [np.full(q.shape, np.nan, dtype=q.dtype)]
    one, lse = sharded_decode_attention(q, [s[0] for s in shards], [s[1] for s in shards], out=ws[0],
                                        return_lse=True)
    assert one is ws[0] and lse.shape == (B, 8)
    np.testing.assert_array_equal(one, res[0])


def test_same_as_single_call_with_one_rank(rng):
    """W = 1: the merge of one part is that part (decode_attention over the whole cache)."""
    q, k, v = _cache(rng, "fp16", B, 8, 2, 64, N_MAX)
    lens = np.array([5, 0, N_MAX], dtype=np.int32)
    o, lse = context_parallel_decode(q, k, v, lens, group=ThreadedGroup(1).rank(0), return_lse=True)
    want, want_lse = fdpp.decode_attention(q, k, v, cache_seqlens=lens, return_lse=True)
    np.testing.assert_array_equal(o, want)
    np.testing.assert_array_equal(lse, want_lse)


# ---- argument validation -------------------------------------------------------------------------
def _small(rng):
    q, k, v = _cache(rng, "fp16", 2, 4, 2, 64, 8)
    return q, k, v, ThreadedGroup(1).rank(0)


class _FakeTorchGroup:
    pass


_FakeTorchGroup.__module__ = "torch.distributed.distributed_c10d"


def test_bad_group(rng):
    q, k, v, _ = _small(rng)
    for group, match in ((None, "group must be a ThreadedGroup rank"), (object(), "group must be"),
                         (ThreadedGroup(2), r"group\.rank\(r\)"), (_FakeTorchGroup(), "torch/CuPy communicator")):
        with pytest.raises(TypeError, match=match):
            context_parallel_decode(q, k, v, group=group)
    with pytest.raises(TypeError, match="group"):
        context_parallel_decode(q, k, v)  # group is required  # type: ignore[call-arg]


def test_bad_arrays_named(rng):
    q, k, v, g = _small(rng)
    with pytest.raises(TypeError, match="^q must be"):
        context_parallel_decode(q.tolist(), k, v, group=g)
    with pytest.raises(ValueError, match="^q must have shape"):
        context_parallel_decode(q[0], k, v, group=g)
    with pytest.raises(TypeError, match="local_k must be"):
        context_parallel_decode(q, k.tolist(), v, group=g)
    with pytest.raises(TypeError, match="local_v dtype"):
        context_parallel_decode(q, k, v.astype(np.float32), group=g)
    with pytest.raises(ValueError, match="local_k and local_v must have the same shape"):
        context_parallel_decode(q, k, v[:, :4], group=g)
    with pytest.raises(ValueError, match="local_k batch"):
        context_parallel_decode(q, k[:1], v[:1], group=g)
    with pytest.raises(ValueError, match="local_seqlens values must be in"):
        context_parallel_decode(q, k, v, np.array([9, 1], np.int32), group=g)
    with pytest.raises(ValueError, match="local_seqlens must have shape"):
        context_parallel_decode(q, k, v, np.array([1], np.int32), group=g)
    with pytest.raises(ValueError, match="kv_layout"):
        context_parallel_decode(q, k, v, group=g, kv_layout="NDH")
    with pytest.raises(ValueError, match="num_splits"):
        context_parallel_decode(q, k, v, group=g, num_splits=0)


def test_bad_paged_named(rng):
    q, k, v, g = _small(rng)
    kp, vp, table, lens = _paged(rng, k, v, np.array([8, 3], np.int32), 4)
    with pytest.raises(TypeError, match="local_seqlens must be an int32 array"):
        context_parallel_decode(q, kp, vp, block_table=table, group=g)
    with pytest.raises(ValueError, match="page_size"):
        context_parallel_decode(q, kp[:, :3], vp[:, :3], lens, block_table=table, group=g)
    bad = table.copy()
    bad[0, 0] = 999
    with pytest.raises(ValueError, match="block_table"):
        context_parallel_decode(q, kp, vp, lens, block_table=bad, group=g)


def test_bad_out_named(rng):
    q, k, v, g = _small(rng)
    with pytest.raises(ValueError, match="out must have shape"):
        context_parallel_decode(q, k, v, group=g, out=np.zeros((2, 4, 32), np.float16))
    with pytest.raises(TypeError, match="out dtype"):
        context_parallel_decode(q, k, v, group=g, out=np.zeros((2, 4, 64), np.float32))
    with pytest.raises(TypeError, match="out must be the same array type"):
        context_parallel_decode(q, k, v, group=g, out=[0.0])
    with pytest.raises(ValueError, match="out must not overlap local_k"):
        context_parallel_decode(q, k, v, group=g, out=k.reshape(-1)[: q.size].reshape(q.shape))


def test_threaded_group_arguments():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="world_size"):
            ThreadedGroup(bad)
    with pytest.raises(ValueError, match="rank"):
        ThreadedGroup(2).rank(2)


def test_q_shape_differs_across_ranks(rng):
    """Undetectable with NCCL (documented); the simulated exchange reports it."""
    q, k, v, _ = _small(rng)
    qs = [q, q[:, :2]]
    kvs = [(k, v), (k[:, :, :1], v[:, :, :1])]
    with pytest.raises(ValueError, match="different sizes"):
        ThreadedGroup(2, timeout=30).run(lambda ex: context_parallel_decode(qs[ex.rank], *kvs[ex.rank], group=ex))


def test_failing_rank_does_not_hang(rng):
    """Rank 1's bad shard raises its own error; rank 0, waiting in the all-gather, is released."""
    q, k, v, _ = _small(rng)
    shards = [(k, v), (k[:, :, :, :32], v[:, :, :, :32])]
    g = ThreadedGroup(2, timeout=30)
    with pytest.raises(ValueError, match="local_k head_dim 32"):
        g.run(lambda ex: context_parallel_decode(q, *shards[ex.rank], group=ex))
    assert threading.active_count() < 50
    res = g.run(lambda ex: context_parallel_decode(q, k[:, ex.rank * 4: ex.rank * 4 + 4],
                                                   v[:, ex.rank * 4: ex.rank * 4 + 4], group=ex))
    assert_close(res[0].astype(np.float64), attention_reference(q, k, v)[0], "fp16")  # reusable after


def test_sharded_arguments(rng):
    q, k, v, _ = _small(rng)
    shards = shard_cache(k, v, None, [(0, 3), (3, 8)])
    ks, vs = [s[0] for s in shards], [s[1] for s in shards]
    with pytest.raises(TypeError, match="k_shards must be a list"):
        sharded_decode_attention(q, k, vs)
    with pytest.raises(ValueError, match="k_shards must hold at least one"):
        sharded_decode_attention(q, [], [])
    with pytest.raises(ValueError, match="v_shards must hold one shard"):
        sharded_decode_attention(q, ks, vs[:1])
    with pytest.raises(ValueError, match="seqlens_shards must hold one entry"):
        sharded_decode_attention(q, ks, vs, [None])
    with pytest.raises(ValueError, match=r"k_shards\[1\] head_dim"):
        sharded_decode_attention(q, [ks[0], ks[1][..., :32]], [vs[0], vs[1][..., :32]])
    with pytest.raises(ValueError, match=r"seqlens_shards\[0\] values"):
        sharded_decode_attention(q, ks, vs, [np.array([4, 0], np.int32), None])


def test_shard_helpers():
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_bounds(0, 2) == [(0, 0), (0, 0)]
    for n, w in ((-1, 2), (3, 0), (3.0, 1)):
        with pytest.raises(ValueError):
            shard_bounds(n, w)
    k = np.zeros((2, 3, 10, 64), np.float16)  # HND
    (k0, _, l0), (k1, _, l1) = shard_cache(k, k, np.array([10, 5]), [(0, 6), (6, 10)], kv_layout="HND")
    assert k0.shape == (2, 3, 6, 64) and k1.shape == (2, 3, 4, 64)
    assert l0.tolist() == [6, 5] and l1.tolist() == [4, 0] and l1.dtype == np.int32
    with pytest.raises(ValueError, match=r"bounds\[1\]"):
        shard_cache(k, k, None, [(0, 6), (5, 10)], kv_layout="HND")  # overlap
    with pytest.raises(ValueError, match=r"bounds\[0\]"):
        shard_cache(k, k, None, [(0, 11)], kv_layout="HND")
    with pytest.raises(ValueError, match="kv_layout"):
        shard_cache(k, k, None, [(0, 1)], kv_layout="nhd")


def test_layout_is_aligned():
    """Each rank's buffer: out first, lse at a 16-byte offset, rows a multiple of 16 bytes."""
    for b, hq, d, isz in itertools.product([1, 3], [1, 5, 64], [64, 96, 128, 256], [2, 4]):
        lay = dist_mod._Layout(b, hq, d, isz)
        assert lay.out_bytes == b * hq * d * isz
        assert lay.lse_offset % 16 == 0 and lay.lse_offset >= lay.out_bytes
        assert lay.nbytes % 16 == 0 and lay.nbytes >= lay.lse_offset + 4 * b * hq
        assert lay.nbytes - (lay.lse_offset + 4 * b * hq) < 16


# ---- import hygiene ------------------------------------------------------------------------------
def test_import_does_not_load_torch_or_cupy():
    code = ("import sys, fdpp; assert not {'fdpp.distributed', 'fdpp.exchange'} & set(sys.modules); "
            "f = fdpp.context_parallel_decode; "
            "from fdpp.distributed import context_parallel_decode as g; assert f is g; "
            "bad = [m for m in ('torch', 'cupy') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(fdpp.__file__).parents[1]))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fdpp.nope  # noqa: B018


# ---- the torch exchange on the CPU (gloo), where torch is installed -----------------------------------
def test_torch_exchange_gloo(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed without gloo")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", world_size=1, rank=0)
    try:
        group = dist.group.WORLD
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(ValueError, match="NCCL backend"):
                exchange._exchange_for(group, "torch", None)
        with pytest.raises(TypeError, match="ProcessGroup"):
            exchange._exchange_for(object(), "torch", None)
        ex = exchange._TorchExchange(group)
        assert (ex.world_size, ex.rank) == (1, 0)
        for tdt, npdt in ((torch.float16, np.float16), (torch.bfloat16, DTYPES["bf16"].np_dtype),
                          (torch.float32, np.float32)):
            lay = dist_mod._Layout(3, 5, 64, torch.empty((), dtype=tdt).element_size())
            send = torch.zeros(lay.nbytes, dtype=torch.uint8)
            o = torch.randn(3, 5, 64).to(tdt)
            lse = torch.randn(3, 5)
            lay.out_view("torch", send.view(1, -1), tdt)[0].copy_(o)
            lay.lse_view("torch", send.view(1, -1))[0].copy_(lse)
            rows = ex.all_gather(send)
            assert tuple(rows.shape) == (1, lay.nbytes)
            assert torch.equal(lay.out_view("torch", rows, tdt)[0], o)
            assert torch.equal(lay.lse_view("torch", rows)[0], lse)
            # the same bytes read back by the NumPy views
            np_rows = rows.numpy()
            got = lay.out_view("numpy", np_rows, npdt)[0]
            np.testing.assert_array_equal(got.astype(np.float32), o.float().numpy())
            np.testing.assert_array_equal(lay.lse_view("numpy", np_rows)[0], lse.numpy())
    finally:
        dist.destroy_process_group()


def _gloo_worker(rank, world, path, shards_q):
    """One process of test_torch_gloo_two_processes: this rank's NumPy partial state through the
    torch exchange (gloo all-gather of CPU tensors), merged as context_parallel_decode merges."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", world_size=world, rank=rank)
    try:
        shards, q, want = shards_q
        lay = dist_mod._Layout(*q.shape, q.itemsize)
        send = np.zeros(lay.nbytes, dtype=np.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist_mod._local_partial(q, *shards[rank], None, send, "numpy", lay, dist_mod._opts(None, "NHD", None, False))
        rows = exchange._TorchExchange(dist.group.WORLD).all_gather(torch.from_numpy(send)).numpy()
        assert rows.shape == (world, lay.nbytes)
        np.testing.assert_array_equal(rows[rank], send)  # row r is rank r's buffer
        o, lse = dist_mod._merge_rows("numpy", rows, lay, q.dtype, None, True)
        np.testing.assert_array_equal(o, want[0])
        np.testing.assert_array_equal(lse, want[1])
    finally:
        dist.destroy_process_group()


def test_torch_gloo_two_processes(tmp_path, rng):
    """Two real processes exchanging through torch.distributed (gloo on the CPU): the same bytes
    and the same merge as the simulated ranks, so the same result bitwise."""
    pytest.importorskip("torch")
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed without gloo")
    q, k, v = _cache(rng, "fp16", B, 8, 2, 64, N_MAX)
    lens = np.array([N_MAX, 0, 11], dtype=np.int32)
    shards = shard_cache(k, v, lens, [(0, 10), (10, N_MAX)])
    want = sharded_decode_attention(q, [s[0] for s in shards], [s[1] for s in shards], [s[2] for s in shards],
                                    return_lse=True)
    mp.spawn(_gloo_worker, args=(2, str(tmp_path / "rdzv"), (shards, q, want)), nprocs=2, join=True)


# ---- the bench script's CSV (no GPU needed) ------------------------------------------------------
def test_bench_csv_round_trip(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_context_parallel.py"
    spec = importlib.util.spec_from_file_location("bench_context_parallel", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    base = dict(world_size=1, rank=0, device="H200", model="llama3-70b", dtype="fp16", batch=1, local_tokens=0,
                exchange_bytes=16400, local_us=1.0, gather_us=2.0, merge_us=3.0, step_us=6.0, gather_alone_us=2.0,
                graph_us=7.0, eager_us=9.0, decode_graph_us=5.5, error="")
    rows = [dict(base, seqlen=262144), dict(base, seqlen=524288, decode_graph_us="", error="decode_graph_us: x"),
            dict(base, seqlen=1048576, world_size=2, decode_graph_us=1.0)]
    out = bench.write_csv(str(tmp_path / "sub" / "w1.csv"), rows)
    assert out.read_text().splitlines()[0].split(",") == bench.COLUMNS
    # one-rank rows only; decode_graph_us, else graph_us where the plain call failed
    assert bench._baseline(str(out)) == {262144: 5.5, 524288: 7.0}
    assert bench._baseline(None) == {}


@pytest.mark.skipif(fdpp.gpu_available(), reason="the NumPy emulator runs only without a GPU")
def test_fp8_shards_with_their_descales(rng):
    """FP8 shards (each rank its own per-(request, KV head) descales) merge to the attention over
    the whole dequantised cache."""
    from fdpp.dtypes import KV_FORMATS
    from fdpp.reference import dequant_fp8_cache

    f = KV_FORMATS["fp8_e4m3"]
    b, hq, hkv, d, w = 2, 8, 2, 64, 3
    q = rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16)
    parts = []
    for n in (100, 37, 0):
        codes = [np.clip(rng.standard_normal((b, n, hkv, d), dtype=np.float32) * 100, -448, 448).astype(f.np_dtype)
                 for _ in range(2)]
        parts.append((*codes, rng.uniform(0.001, 0.01, size=(b, hkv)).astype(np.float32)))
    k = np.concatenate([dequant_fp8_cache(kc, f.name, ds) for kc, _, ds in parts], axis=1)
    v = np.concatenate([dequant_fp8_cache(vc, f.name, ds) for _, vc, ds in parts], axis=1)
    ref, ref_lse = attention_reference(q, k, v)

    def rank(ex):
        kc, vc, ds = parts[ex.rank]
        return context_parallel_decode(q, kc, vc, group=ex, return_lse=True, k_descale=ds, v_descale=ds)

    _check_ranks(ThreadedGroup(w, timeout=30).run(rank), ref, ref_lse, "fp16")


@pytest.mark.parametrize("flag", ["no", 1, None])
def test_return_lse_must_be_a_bool(flag, rng):
    """As decode_attention's: a truthy string once returned a tuple."""
    q = rng.standard_normal((2, 8, 64)).astype(np.float16)
    k = rng.standard_normal((2, 37, 2, 64)).astype(np.float16)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        sharded_decode_attention(q, [k[:, :20], k[:, 20:]], [k[:, :20], k[:, 20:]], return_lse=flag)
    shards = [(k[:, :20], k[:, :20]), (k[:, 20:], k[:, 20:])]
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        ThreadedGroup(2, timeout=30).run(
            lambda ex: context_parallel_decode(q, *shards[ex.rank], group=ex, return_lse=flag))
