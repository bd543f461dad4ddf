"""fdpp.context_parallel_decode across all GPUs of the machine (needs >= 2): one process per GPU
launched by torch.multiprocessing.spawn, NCCL through torch.distributed and through CuPy.

Every rank builds the same full cache on the host from one seed, keeps only its shard on its GPU,
and checks that
- its result equals, bitwise, every other rank's result;
- it equals, bitwise, the same shards merged on one GPU (sharded_decode_attention: the same kernels
  and the same merge order, without NCCL) when all GPUs are the same model;
- it equals fdpp.decode_attention over the whole cache on one GPU within tolerance, and the
  float64 reference (fdpp.reference, never an fdpp kernel).
A failing check in a child raises there; spawn re-raises it here.
"""

import datetime
import os
import socket
import zlib

import numpy as np
import pytest


def _world() -> int:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()):
        pytest.skip("needs torch with CUDA and NCCL")
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs >= 2 GPUs for a multi-GPU group, this machine has {n}")
    return n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (name, B, Hq, Hkv, D, N, lengths or None, dtype)
CASES = [
    ("llama3-70b-b1", 1, 64, 8, 128, 65536 + 7, None, "bf16"),
    ("varlen-b3", 3, 32, 8, 128, 20000, [20000, 0, 900], "fp16"),  # 0 everywhere; 900: rank 0 only
]


def _bounds(n: int, w: int) -> list[tuple[int, int]]:
    """Uneven shards: rank 0 holds a quarter more than its share, and with W >= 3 rank 1 none."""
    if w >= 3:
        sizes = [n // w + n // (4 * w), 0]
        rest = n - sum(sizes)
        sizes += [rest // (w - 2) + (i < rest % (w - 2)) for i in range(w - 2)]
    else:
        sizes = [n // w + n // (4 * w), n - (n // w + n // (4 * w))]
    edges = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return list(zip(edges[:-1], edges[1:], strict=True))


def _worker(rank: int, world: int, port: int) -> None:
    import cupy as cp
    import torch
    import torch.distributed as dist

    import fdpp
    from fdpp.distributed import context_parallel_decode, shard_cache, sharded_decode_attention
    from fdpp.dtypes import DTYPES
    from fdpp.reference import assert_close, attention_reference

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank,
                            timeout=datetime.timedelta(seconds=120))
    group = dist.group.WORLD
    names = [None] * world
    dist.all_gather_object(names, torch.cuda.get_device_name(rank))
    same_model = len(set(names)) == 1
    try:
        from cupy.cuda import nccl

        uid = [nccl.get_unique_id() if rank == 0 else None]
        dist.broadcast_object_list(uid, src=0)
        with cp.cuda.Device(rank):
            comm = nccl.NcclCommunicator(world, uid[0], rank)
    except (ImportError, AttributeError):
        comm = None  # CuPy without NCCL: the torch path only (the parent test reports it)
    tdt = {"fp16": torch.float16, "bf16": torch.bfloat16}
    for name, b, hq, hkv, d, n, lens_list, dt in CASES:
        rng = np.random.default_rng(zlib.crc32(name.encode()))  # the same cache on every rank
        q_h = rng.standard_normal((b, hq, d), dtype=np.float32)
        k_h = rng.standard_normal((b, n, hkv, d), dtype=np.float32) * 2
        v_h = rng.standard_normal((b, n, hkv, d), dtype=np.float32)
        bounds = _bounds(n, world)
        lo, hi = bounds[rank]

        def dev(x, dt=dt):
            return torch.from_numpy(np.ascontiguousarray(x)).cuda().to(tdt[dt])

        q = dev(q_h)
        lens = None if lens_list is None else torch.tensor(lens_list, dtype=torch.int32, device="cuda")
        k_loc, v_loc = dev(k_h[:, lo:hi]), dev(v_h[:, lo:hi])  # only this rank's shard on its GPU
        lens_loc = None if lens is None else (lens - lo).clamp(0, hi - lo).to(torch.int32)
        o, lse = context_parallel_decode(q, k_loc, v_loc, lens_loc, group=group, return_lse=True)
        # every rank the same, bitwise
        gathered = [torch.empty_like(o) for _ in range(world)]
        dist.all_gather(gathered, o)
        for r, g in enumerate(gathered):
            assert torch.equal(g, o), f"{name}: rank {r}'s result differs from rank {rank}'s"
        # the whole cache on this GPU: the same shards merged without NCCL, the one-GPU call, float64
        k_full, v_full = dev(k_h), dev(v_h)
        shards = shard_cache(k_full, v_full, lens, bounds)
        one, one_lse = sharded_decode_attention(q, [s[0] for s in shards], [s[1] for s in shards],
                                                [s[2] for s in shards], return_lse=True)
        if same_model:
            assert torch.equal(o, one) and torch.equal(lse, one_lse), f"{name}: NCCL result != one-GPU shards"
        full = fdpp.decode_attention(q, k_full, v_full, cache_seqlens=lens)
        tol = DTYPES[dt]
        np.testing.assert_allclose(o.float().cpu().numpy(), full.float().cpu().numpy(),
                                   rtol=2 * tol.rtol, atol=2 * tol.atol, err_msg=f"{name}: vs one-GPU decode")
        lens_ref = None if lens is None else cp.asarray(np.asarray(lens_list, dtype=np.int64))
        ref, _ = attention_reference(cp.from_dlpack(q.float()), cp.from_dlpack(k_full.float()),
                                     cp.from_dlpack(v_full.float()), lens_ref)
        assert_close(o.float().cpu().numpy(), cp.asnumpy(ref), dt)
        del k_full, v_full, shards
        if comm is not None:  # the same through CuPy's NCCL communicator
            with cp.cuda.Device(rank):
                cq, ck, cv = (cp.from_dlpack(x.contiguous()) for x in (q, k_loc, v_loc))
                cl = None if lens_loc is None else cp.from_dlpack(lens_loc)
                co = context_parallel_decode(cq, ck, cv, cl, group=comm)
                cp.cuda.get_current_stream().synchronize()
                assert torch.equal(torch.from_dlpack(co), o), f"{name}: CuPy NCCL result != torch NCCL result"
    # a captured graph of the whole step, replayed on every rank
    q, k_loc, v_loc = q.clone(), k_loc.contiguous(), v_loc.contiguous()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        context_parallel_decode(q, k_loc, v_loc, lens_loc, group=group)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = context_parallel_decode(q, k_loc, v_loc, lens_loc, group=group)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    want = context_parallel_decode(q, k_loc, v_loc, lens_loc, group=group)
    assert torch.equal(g_out, want), "graph replay != eager"
    if comm is not None:
        comm.destroy()
    dist.destroy_process_group()


@pytest.mark.gpu
def test_multi_gpu_equals_one_gpu():
    world = _world()
    pytest.importorskip("cupy")
    import torch.multiprocessing as mp

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device notes)
    mp.spawn(_worker, args=(world, _free_port()), nprocs=world, join=True)


def test_bounds_helper():
    """The shard layout the multi-GPU test uses (runs wherever the GPU tests run)."""
    for n, w in ((65543, 2), (20000, 3), (20000, 8)):
        b = _bounds(n, w)
        assert len(b) == w and b[0][0] == 0 and b[-1][1] == n
        assert all(x[1] == y[0] for x, y in zip(b, b[1:], strict=False))
        if w >= 3:
            assert b[1][0] == b[1][1]
