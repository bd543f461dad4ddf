"""Context-parallel decode: one process per GPU, each holding only its shard of the KV cache.

On one host (N GPUs)::

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=N scripts/context_parallel_example.py \\
        --model llama3-70b --seqlen 1048576

On several hosts, the same script under torchrun's rendezvous (run on every host)::

    NCCL_NVLS_ENABLE=0 torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST0:29500 --rdzv-id=cp1 scripts/context_parallel_example.py --seqlen 4194304

Rank r holds positions ``fdpp.distributed.shard_bounds(seqlen, W)[r]`` of each layer's cache
(random data, allocated on its GPU only: no rank ever holds the whole cache), the same query on
every rank (broadcast from rank 0), and calls ``fdpp.context_parallel_decode`` once per layer per
step. Rank 0 prints the per-rank shard size and the step time (median over ``--iters`` steps,
CUDA events, after a warm-up; the slowest rank's median). With ``--check`` (small caches only)
rank 0 also recomputes the step from a full copy of the cache on its GPU and compares.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fdpp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3-70b")
    p.add_argument("--seqlen", type=int, default=1 << 20, help="tokens of the whole (all ranks') cache")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--layers", type=int, default=1, help="layers per step (each its own sharded cache)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--check", action="store_true", help="compare with a one-GPU call (rank 0 holds a full copy)")
    args = p.parse_args()

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (read at communicator creation)
    import torch
    import torch.distributed as dist

    import fdpp
    from fdpp.distributed import shard_bounds
    from fdpp.models import get_model

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")  # torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    hq, hkv, d = get_model(args.model).heads()
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    lo, hi = shard_bounds(args.seqlen, world)[rank]
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    caches = [tuple(torch.randn(args.batch, hi - lo, hkv, d, device="cuda", dtype=dt, generator=gen)
                    for _ in range(2)) for _ in range(args.layers)]
    q = torch.randn(args.batch, hq, d, device="cuda", dtype=dt, generator=gen)
    dist.broadcast(q, src=0)  # q must be identical on every rank

    def step() -> torch.Tensor:
        for k, v in caches:
            o = fdpp.context_parallel_decode(q, k, v, group=group)
        return o

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.iters):
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    med = statistics.median(times)
    meds = [None] * world
    dist.all_gather_object(meds, med)
    shard_gb = args.layers * 2 * args.batch * (hi - lo) * hkv * d * q.element_size() / 1e9
    if rank == 0:
        print(f"{args.model} heads {hq}/{hkv}/{d} {args.dtype}, B={args.batch}, {args.seqlen} tokens, "
              f"{args.layers} layer(s) on {world} GPU(s): {hi - lo} tokens and {shard_gb:.2f} GB of KV per rank")
        print(f"step: {max(meds):.1f} us (slowest rank's median of {args.iters}); per rank: "
              + ", ".join(f"{m:.1f}" for m in meds))
    if args.check:
        _check(args, q, caches, out, rank, world, dt, hkv, d)
    dist.destroy_process_group()


def _check(args, q, caches, out, rank, world, dt, hkv, d) -> None:
    """Rank 0 collects the last layer's shards and runs fdpp.decode_attention over the whole cache."""
    import torch
    import torch.distributed as dist

    import fdpp
    from fdpp.distributed import shard_bounds

    bounds = shard_bounds(args.seqlen, world)
    whole = []
    for x in caches[-1]:
        if rank == 0:
            parts = [x] + [torch.empty(args.batch, b - a, hkv, d, device="cuda", dtype=dt) for a, b in bounds[1:]]
            for r in range(1, world):
                dist.recv(parts[r], src=r)
            whole.append(torch.cat(parts, dim=1))
        else:
            dist.send(x.contiguous(), dst=0)
    if rank == 0:
        want = fdpp.decode_attention(q, *whole)
        err = (out.float() - want.float()).abs().max().item()
        print(f"check: max |context-parallel - one GPU| = {err:.3g} (fp16/bf16 rounding of the partials)")


if __name__ == "__main__":
    main()
