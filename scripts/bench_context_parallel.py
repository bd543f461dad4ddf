"""Latency of context-parallel decode per rank, communication separated (torchrun, one process per GPU).

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 scripts/bench_context_parallel.py \\
        --out results/context_parallel_h200_w2.csv
    torchrun --nproc_per_node=1 scripts/bench_context_parallel.py --out results/context_parallel_h200_w1.csv

With one process it runs too: the one-GPU baseline (a 1-rank NCCL group; its all-gather is a local
copy). For each total length N (default 256k, 512k, 1M) every rank allocates only its shard
(``fdpp.distributed.shard_bounds``) of one layer's cache, llama3-70b heads by default (64 q / 8 KV,
D 128), B = 1, random data, the same q on every rank. Rows, one per rank and N:

- ``local_us``, ``gather_us``, ``merge_us``: the three phases of one ``context_parallel_decode``
  step (local split-KV decode into the send buffer, NCCL all-gather, merge_states), CUDA events
  between them on the step's stream, median over ``--repeats`` steps, each step started after a
  ``dist.barrier()`` (so ranks start together). ``gather_us`` includes the wait for the slowest
  rank's local phase; ``step_us`` is the three together.
- ``gather_alone_us``: the all-gather alone (same bytes), barrier before each: the communication
  latency without the skew.
- ``graph_us``: the whole step captured in one CUDA graph (``torch.cuda.graph``), ``--calls``
  replays back to back after a barrier, per replay (no host launch cost); empty with the error
  column set if capture fails.
- ``eager_us``: ``--calls`` eager ``context_parallel_decode`` calls back to back, per call
  (host cost included).
- ``decode_graph_us``: plain ``fdpp.decode_attention`` over the rank's shard, graph-replayed as
  ``graph_us``: with one rank, the one-GPU time over the whole cache (no exchange, no merge), the
  baseline the speedups are taken against.

The caches are GBs, far past the 50 MB L2, so repeats need no input rotation. Rank 0 writes the
CSV and prints, per N, the slowest rank's graph time (and, with ``--baseline`` — a CSV of this
script run with one rank — its ratio to that run's ``decode_graph_us``).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fdpp

COLUMNS = ["world_size", "rank", "device", "model", "dtype", "batch", "seqlen", "local_tokens", "exchange_bytes",
           "local_us", "gather_us", "merge_us", "step_us", "gather_alone_us", "graph_us", "eager_us", "decode_graph_us",
           "error"]


def _median_us(pairs) -> float:
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in pairs)


def _bench_one(args, n: int, group, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    import fdpp
    from fdpp import distributed as fd
    from fdpp.exchange import _exchange_for
    from fdpp.models import get_model

    hq, hkv, d = get_model(args.model).heads()
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    lo, hi = fd.shard_bounds(n, world)[rank]
    gen = torch.Generator(device="cuda").manual_seed(n + rank)
    k = torch.randn(args.batch, hi - lo, hkv, d, device="cuda", dtype=dt, generator=gen)
    v = torch.randn(args.batch, hi - lo, hkv, d, device="cuda", dtype=dt, generator=gen)
    q = torch.randn(args.batch, hq, d, device="cuda", dtype=dt, generator=gen)
    dist.broadcast(q, src=0)
    kind, layout = fd._check_q(q)
    ex = _exchange_for(group, kind, q)
    opts = fd._opts(None, "NHD", None, False)
    row = dict(world_size=world, rank=rank, device=torch.cuda.get_device_name(), model=args.model,
               dtype=args.dtype, batch=args.batch, seqlen=n, local_tokens=hi - lo,
               exchange_bytes=layout.nbytes * world, error="")

    def phases(ev):
        send = ex.send_buffer(kind, q, layout.nbytes)
        ev[0].record()
        fd._local_partial(q, k, v, None, None, send, kind, layout, opts)
        ev[1].record()
        rows = ex.all_gather(send)
        ev[2].record()
        fd._merge_rows(kind, rows, layout, q.dtype, None, False)
        ev[3].record()

    def events(m):
        return [torch.cuda.Event(enable_timing=True) for _ in range(m)]

    for _ in range(args.warmup):
        phases(events(4))
    steps = []
    for _ in range(args.repeats):
        dist.barrier()
        ev = events(4)
        phases(ev)
        steps.append(ev)
    torch.cuda.synchronize()
    row["local_us"] = _median_us([(e[0], e[1]) for e in steps])
    row["gather_us"] = _median_us([(e[1], e[2]) for e in steps])
    row["merge_us"] = _median_us([(e[2], e[3]) for e in steps])
    row["step_us"] = _median_us([(e[0], e[3]) for e in steps])

    send = ex.send_buffer(kind, q, layout.nbytes).zero_()
    alone = []
    for _ in range(args.repeats):
        dist.barrier()
        a, b = events(2)
        a.record()
        ex.all_gather(send)
        b.record()
        alone.append((a, b))
    torch.cuda.synchronize()
    row["gather_alone_us"] = _median_us(alone)

    def back_to_back(fn):
        per = []
        for _ in range(max(3, args.repeats // 10)):
            dist.barrier()
            a, b = events(2)
            a.record()
            for _ in range(args.calls):
                fn()
            b.record()
            per.append((a, b))
        torch.cuda.synchronize()
        return _median_us(per) / args.calls

    row["eager_us"] = back_to_back(lambda: fdpp.context_parallel_decode(q, k, v, group=group))
    errors = []
    for col, fn in (("graph_us", lambda: fdpp.context_parallel_decode(q, k, v, group=group)),
                    ("decode_graph_us", lambda: fdpp.decode_attention(q, k, v))):
        try:
            row[col] = back_to_back(_captured(torch, fn).replay)
        except Exception as e:  # noqa: BLE001 - reported in the CSV, the other columns stand
            row[col] = ""
            errors.append(f"{col}: {type(e).__name__}: {e}".replace("\n", " ")[:300])
            if rank == 0:
                traceback.print_exc()
    row["error"] = "; ".join(errors)
    return row


def _captured(torch, fn):
    """``fn`` captured in a CUDA graph, after a warm-up call on the capture stream (torch's default
    capture mode; where that fails, "thread_local", which lets other threads make CUDA calls)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        traceback.print_exc()
        print("capture in the default mode failed; retrying with capture_error_mode='thread_local'", flush=True)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
    return graph  # the shard goes with this frame: main empties torch's cache before the next N


def write_csv(path: str, rows: list[dict]) -> Path:
    """The rows (one per rank and length) as CSV, floats with two decimals."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({c: (f"{r[c]:.2f}" if isinstance(r[c], float) else r[c]) for c in COLUMNS})
    return out


def _baseline(path: str | None) -> dict[int, float]:
    """seqlen -> the one-GPU time of a one-rank run's CSV (decode_graph_us, else graph/step time)."""
    if not path:
        return {}
    with open(path, newline="") as f:
        return {int(r["seqlen"]): float(r["decode_graph_us"] or r["graph_us"] or r["step_us"])
                for r in csv.DictReader(f) if r["world_size"] == "1"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3-70b")
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlens", default="262144,524288,1048576", help="comma-separated total lengths")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--calls", type=int, default=20, help="back-to-back calls per timed batch (eager, graph)")
    p.add_argument("--out", default="results/context_parallel.csv")
    p.add_argument("--baseline", default=None, help="CSV of a one-rank run: speedups printed against it")
    args = p.parse_args()

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    base = _baseline(args.baseline) if rank == 0 else {}
    rows = []
    for n in (int(x) for x in args.seqlens.split(",")):
        row = _bench_one(args, n, group, rank, world)
        torch.cuda.empty_cache()
        everyone = [None] * world
        dist.all_gather_object(everyone, row)
        rows += everyone
        if rank == 0:
            slow = max(everyone, key=lambda r: r["graph_us"] or r["step_us"])
            t = slow["graph_us"] or slow["step_us"]
            vs = f"; {t / base[n]:.2f} x the 1-GPU decode_attention time ({base[n]:.1f} us)" if n in base else ""
            print(f"N={n} W={world}: {t:.1f} us per step (slowest rank; local {slow['local_us']:.1f}, "
                  f"all-gather {slow['gather_us']:.1f} (alone {slow['gather_alone_us']:.1f}), "
                  f"merge {slow['merge_us']:.1f}, eager {slow['eager_us']:.1f}){vs}", flush=True)
    if rank == 0:
        print(f"wrote {write_csv(args.out, rows)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
