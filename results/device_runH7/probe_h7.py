"""H7: the fixed cost of a paged call at B=1: contiguous without lengths, contiguous with
cache_seqlens, paged (pages in order, and shuffled); same forced plan (mma w8 s3 u1, 16 splits,
two launches), graph-timed over rotated sets."""
import sys
import cupy as cp
import numpy as np
import fdpp
from fdpp import configs, dispatch, timing

b, hq, hkv, d = 1, 32, 8, 128
rng = np.random.default_rng(0)
plans = sys.argv[1].split(",") if len(sys.argv) > 1 else ["w8s3u1"]


def sets(n, mode):
    per = 2 * b * n * hkv * d * 2
    out = []
    for _ in range(timing.rotation_count(per, timing.l2_bytes(), factor=4, max_sets=64)):
        q = cp.random.standard_normal((b, hq, d), dtype=cp.float32).astype(cp.float16)
        if mode.startswith("contig"):
            k = cp.random.standard_normal((b, n, hkv, d), dtype=cp.float32).astype(cp.float16)
            v = cp.random.standard_normal((b, n, hkv, d), dtype=cp.float32).astype(cp.float16)
            lens = cp.full(b, n, cp.int32) if mode == "contig_len" else None
            out.append((q, k, v, None, lens))
        else:
            page = 16
            pages = b * n // page
            k = cp.random.standard_normal((pages, page, hkv, d), dtype=cp.float32).astype(cp.float16)
            v = cp.random.standard_normal((pages, page, hkv, d), dtype=cp.float32).astype(cp.float16)
            order = rng.permutation(pages) if mode == "paged_shuf" else np.arange(pages)
            out.append((q, k, v, cp.asarray(order.reshape(b, -1).astype(np.int32)), cp.full(b, n, cp.int32)))
    return out


def call(s, o):
    q, k, v, t, lens = s
    if t is None:
        return lambda: fdpp.decode_attention(q, k, v, cache_seqlens=lens, out=o)
    return lambda: fdpp.paged_decode_attention(q, k, v, t, lens, out=o)


for n in (4096, 16384, 65536):
    for mode in ("contig", "contig_len", "paged_seq", "paged_shuf"):
        ss = sets(n, mode)
        outs = [cp.empty((b, hq, d), cp.float16) for _ in ss]
        for name in plans:
            w, rest = name[1:].split("s"); st, u = rest.split("u")
            page = 0 if mode.startswith("contig") else 16
            cfg = configs.DecodeConfig("fp16", d, 4, int(w), int(st), int(u), mma=True, page_size=page)
            with dispatch.forced_plan(configs.LaunchPlan.split_kv(cfg, 16)):
                t = timing.time_calls([call(s, o) for s, o in zip(ss, outs)], repeats=9)
            print(f"N={n:6d} {mode:11s} {name:8s} {t.median_us:8.2f} us", flush=True)
        del ss, outs
        cp.get_default_memory_pool().free_all_blocks()
