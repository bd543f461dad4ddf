"""Quick GPU probe: contiguous vs paged (shuffled pages) decode attention, CUDA-graph timed.

    python3 scripts/probe_paged.py [--pages 0,1,16,64] [--batch 1,8] [--seqlens 4096,16384,65536]

Page size 0 is the contiguous cache. With ``FDPP_PROBE_CONTIGUOUS_ONLY=1`` only page size 0 runs
(so the same script times an older fdpp that has no paged path, for a before/after comparison).
Prints one line per point: µs per call (median of graph replays over rotated input sets) and
the max error against the float64 reference on the first set.
"""

from __future__ import annotations

import argparse
import os

import cupy as cp
import numpy as np

import fdpp
from fdpp import timing
from fdpp.reference import attention_reference


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _sets(b: int, hq: int, hkv: int, d: int, n: int, page: int, rng: np.random.Generator,
          shuffled: bool = True) -> list[tuple]:
    per = 2 * b * n * hkv * d * 2
    count = timing.rotation_count(per, timing.l2_bytes(), factor=4, max_sets=64)
    out = []
    for _ in range(count):
        q = cp.random.standard_normal((b, hq, d), dtype=cp.float32).astype(cp.float16)
        if page == 0:
            k = cp.random.standard_normal((b, n, hkv, d), dtype=cp.float32).astype(cp.float16)
            v = cp.random.standard_normal((b, n, hkv, d), dtype=cp.float32).astype(cp.float16)
            out.append((q, k, v, None, None))
            continue
        width = n // page
        pages = b * width
        k = cp.random.standard_normal((pages, page, hkv, d), dtype=cp.float32).astype(cp.float16)
        v = cp.random.standard_normal((pages, page, hkv, d), dtype=cp.float32).astype(cp.float16)
        order = rng.permutation(pages) if shuffled else np.arange(pages)
        table = cp.asarray(order.reshape(b, width).astype(np.int32))
        out.append((q, k, v, table, cp.full(b, n, cp.int32)))
    return out


def _call(s: tuple, o: cp.ndarray):
    q, k, v, table, lens = s
    if table is None:
        return lambda: fdpp.decode_attention(q, k, v, out=o)
    return lambda: fdpp.paged_decode_attention(q, k, v, table, lens, out=o)


def _error(s: tuple) -> float:
    q, k, v, table, lens = s
    if table is None:
        o = fdpp.decode_attention(q, k, v)
        ref, _ = attention_reference(q[:1], k[:1], v[:1])
    else:
        from fdpp.reference import paged_attention_reference

        o = fdpp.paged_decode_attention(q, k, v, table, lens)
        ref, _ = paged_attention_reference(q[:1], k, v, table[:1], lens[:1])
    return float(cp.abs(o[:1].astype(cp.float64) - ref).max() / cp.abs(ref).max())


def _forced(name: str, b: int, hq: int, hkv: int, d: int, n: int, page: int):
    """A context forcing the mma variant ``wWsSuU`` at the heuristic's split count ("": none)."""
    import contextlib

    if not name:
        return contextlib.nullcontext()
    from fdpp import configs, dispatch

    w, rest = name[1:].split("s")
    st, u = rest.split("u")
    prob = configs.DecodeProblem(b, hq, hkv, d, n, "fp16", page_size=page)
    heur = configs.default_config(prob, configs.SM90)
    cfg = configs.DecodeConfig("fp16", d, heur.split.group_size, int(w), int(st), int(u), mma=True, page_size=page)
    if not cfg.is_valid(configs.SM90):
        return None
    return dispatch.forced_plan(configs.LaunchPlan.split_kv(cfg, heur.num_splits))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=_ints, default=[0, 1, 16, 64])
    ap.add_argument("--batch", type=_ints, default=[1, 8])
    ap.add_argument("--seqlens", type=_ints, default=[4096, 16384, 65536])
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--sequential", action="store_true", help="pages in order (block table = arange)")
    ap.add_argument("--plans", default="", help="comma list of forced mma variants wWsSuU (e.g. w4s3u1); "
                    "default: the dispatcher's plan")
    args = ap.parse_args()
    if os.environ.get("FDPP_PROBE_CONTIGUOUS_ONLY"):
        args.pages = [0]
    hq, hkv = (int(x) for x in args.heads.split("/"))
    d = 128
    rng = np.random.default_rng(0)
    print(f"fdpp at {fdpp.__file__}")
    print(f"{'B':>3} {'N':>7} {'page':>5} {'us':>9} {'p10':>9} {'p90':>9} {'err':>9}")
    for b in args.batch:
        for n in args.seqlens:
            for page in args.pages:
                sets = _sets(b, hq, hkv, d, n, page, rng, shuffled=not args.sequential)
                outs = [cp.empty((b, hq, d), cp.float16) for _ in sets]
                for name in (args.plans.split(",") if args.plans else [""]):
                    ctx = _forced(name, b, hq, hkv, d, n, page)
                    if ctx is None:
                        print(f"{b:>3} {n:>7} {page:>5} {'invalid':>9} {name}")
                        continue
                    with ctx:
                        err = _error(sets[0])
                        t = timing.time_calls([_call(s, o) for s, o in zip(sets, outs, strict=True)], repeats=7)
                    print(f"{b:>3} {n:>7} {page:>5} {t.median_us:9.2f} {t.p10_us:9.2f} {t.p90_us:9.2f} {err:9.2e} "
                          f"{name}", flush=True)
                del sets, outs
                cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
