"""GPU probe: where a decode-attention call's time goes, phase by phase, inside the kernels.

    python3 scripts/probe_phases.py [--points 32/8:1:1024,32/8:1:4096,...] [--prefetch-mb 0,4]
                                    [--no-marks] [--kernels DIR] [--prefetch-share]

Compiles the phase-1 kernels from a patched copy of kernels_cu/ (``probe_cluster.use_sources``)
whose thread 0 of every CTA writes ``%globaltimer`` (ns) at six marks into a module global:

    0 kernel entry (before the L2 prefetch and pdl_wait)   3 KV loop done (last tile's math)
    1 after pdl_wait / pdl_trigger                          4 the CTA's warps merged (shared memory)
    2 first KV tile in shared memory (t = 0, after wait)    5 end (cluster merge / partial stored)

Each point (heads, batch, N) runs the shipped table's plan (read without its source-hash check)
in a CUDA graph of back-to-back calls over rotated inputs, as ``fdpp.bench`` times it; the marks
are those of the graph's last call. Printed per point: the graph time per call, then for each
phase the median and max over CTAs of its length (µs; from clock64 at the maximum SM clock and
from %globaltimer, whose ticks may be coarse), the spread of the CTAs' entries and exits,
and the span from the first CTA's wait release to the last CTA's end (the kernel's own time once
the kernel before has finished; with two launches the rest of the call is the combine kernel).
``--no-marks`` times the same kernels without the marks. (Run T6's ``--variant split-barrier``,
the cluster merge's last barrier as an arrive after the remote reads and a wait at the end, is
shipped in merge.cuh since; its patch is gone from here.)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_cluster import _table_plan, use_kernel_dir, use_sources  # noqa: E402

from fdpp import configs, dispatch, launch, plan, registry, timing  # noqa: E402
from fdpp.reference import attention_reference  # noqa: E402

MARKS = 6
MAX_CTAS = 16384
PHASES = ("wait", "first tile", "KV loop", "CTA merge", "cluster/partial")

PROBE_CODE = f"""
extern "C" {{ __device__ unsigned long long fdpp_probe_ts[{MAX_CTAS} * 16]; }}  // C name: get_global finds it
__device__ __forceinline__ void probe_mark(int slot) {{
  if (threadIdx.x == 0) {{
    unsigned long long t, c;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(c));
    const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (cta < {MAX_CTAS}) {{ fdpp_probe_ts[cta * 16 + slot] = t; fdpp_probe_ts[cta * 16 + 8 + slot] = c; }}
  }}
}}
"""


def _sub(text: str, old: str, new: str, count: int) -> str:
    n = text.count(old)
    if n != count:
        raise SystemExit(f"probe_phases: expected {count} of {old!r} in the kernel source, found {n}")
    return text.replace(old, new)


NO_MARKS = "__device__ __forceinline__ void probe_mark(int) {}\n"


MARKS_ON = True


def patch(name: str, text: str) -> str:
    if name == "common.cuh":
        code = PROBE_CODE if MARKS_ON else NO_MARKS
        return _sub(text, "// ---- thread-block clusters", code + "\n// ---- thread-block clusters", 1)
    if name != "decode_split.cu":
        return text
    # entry and wait marks in every phase-1 kernel of the tensor-core family
    text = re.sub(r"(\n  const int split = blockIdx\.x, b = blockIdx\.z, h0 = blockIdx\.y \* GROUP_SIZE;\n)",
                  r"\n  probe_mark(0);\1", text)
    text = text.replace("  pdl_trigger();  // the merge (or the next call) may launch now; it waits for this grid to finish\n",
                        "  pdl_trigger();  // the merge (or the next call) may launch now; it waits for this grid to finish\n"
                        "  probe_mark(1);\n")
    text = text.replace("  pdl_trigger();  // the next call may launch now; it waits for this grid to finish\n",
                        "  pdl_trigger();  // the next call may launch now; it waits for this grid to finish\n"
                        "  probe_mark(1);\n")
    # attend_chunk_mma: first tile, loop end, CTA merge, end
    text = _sub(text, "    cp_async_wait<NUM_STAGES - 2>();\n    __syncthreads();  // tile t visible to all warps; all warps are done with tile t-1\n",
                "    cp_async_wait<NUM_STAGES - 2>();\n    __syncthreads();  // tile t visible to all warps; all warps are done with tile t-1\n"
                "    if (t == 0) probe_mark(2);\n", 1)
    text = _sub(text, "  cp_async_wait<0>();\n  l += __shfl_xor_sync(0xffffffffu, l, 1);\n",
                "  cp_async_wait<0>();\n  probe_mark(3);\n  l += __shfl_xor_sync(0xffffffffu, l, 1);\n", 1)
    text = _sub(text, "  __syncthreads();\n  if constexpr (CLUSTER > 1) {\n    cluster_merge<",
                "  __syncthreads();\n  probe_mark(4);\n  if constexpr (CLUSTER > 1) {\n    cluster_merge<", 1)
    return _sub(text, "    if (a.counters != nullptr && a.num_splits > 1) fused_merge<DTypeQ, HEAD_DIM, G, THREADS>(a, b, h0, split, red);\n  }\n}\n",
                "    if (a.counters != nullptr && a.num_splits > 1) fused_merge<DTypeQ, HEAD_DIM, G, THREADS>(a, b, h0, split, red);\n  }\n"
                "  probe_mark(5);\n}\n", 1)


_modules: list = []


def _keep_modules() -> None:
    """Remember every RawModule fdpp compiles (its global holds the marks)."""
    base = cp.RawModule

    class Kept(base):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            _modules.append(self)

    cp.RawModule = Kept


def _globals() -> list:
    out = []
    for mod in _modules:
        try:
            ptr = mod.get_global("fdpp_probe_ts")
        except Exception:  # noqa: BLE001 - a module without the symbol
            continue
        out.append(cp.ndarray((MAX_CTAS * 16,), dtype=cp.uint64, memptr=ptr))
    return out


def _zero_marks() -> None:
    for g in _globals():
        g.fill(0)
    cp.cuda.Device().synchronize()


def _marks(nctas: int) -> tuple[np.ndarray, np.ndarray]:
    """([nctas, MARKS] globaltimer ns, [nctas, MARKS] clock64 cycles) of the module that ran."""
    for g in _globals():
        a = cp.asnumpy(g).reshape(MAX_CTAS, 16)[:nctas].astype(np.int64)
        if (a[:, 0] > 0).all() and (a[:, MARKS - 1] > 0).all():
            return a[:, :MARKS], a[:, 8:8 + MARKS]
    raise SystemExit("probe_phases: no module holds a full set of marks for this grid")


def run_point(hq: int, hkv: int, b: int, n: int) -> None:
    d = 128
    prob = configs.DecodeProblem(b, hq, hkv, d, n, "fp16")
    src, p = _table_plan(prob)
    per = 2 * b * n * hkv * d * 2
    count = timing.rotation_count(per, timing.l2_bytes(), factor=4, max_sets=64)
    rs = cp.random.RandomState(n + b)
    sets = [(rs.standard_normal((b, hq, d), dtype=cp.float32).astype(cp.float16),
             rs.standard_normal((b, n, hkv, d), dtype=cp.float32).astype(cp.float16),
             rs.standard_normal((b, n, hkv, d), dtype=cp.float32).astype(cp.float16)) for _ in range(count)]
    outs = [cp.empty((b, hq, d), dtype=cp.float16) for _ in sets]
    import fdpp

    _zero_marks()
    with dispatch.forced_plan(p):
        t = timing.time_calls([(lambda s=s, o=o: fdpp.decode_attention(*s, out=o)) for s, o in zip(sets, outs, strict=True)],
                              repeats=9)
        cp.cuda.Device().synchronize()
        rec = next(r for r in plan._records.values() if r.prob == prob)
    nctas = int(np.prod(rec.calls[0].grid))
    q0, k0, v0 = (cp.asnumpy(x) for x in sets[0])
    ref = attention_reference(q0, k0, v0)[0]
    with dispatch.forced_plan(p):
        o0 = cp.asnumpy(fdpp.decode_attention(*sets[0])).astype(np.float64)
    err = float(np.abs(o0 - ref).max() / np.abs(ref).max())
    if not MARKS_ON:
        print(f"{hq}/{hkv} B={b} N={n}: {src} {p.split.key} splits {p.effective_splits(n)} {p.mode}, "
              f"no marks: {t.median_us:.2f} us per call (graph; p10 {t.p10_us:.2f}, "
              f"p90 {t.p90_us:.2f}), max error {err:.1e}", flush=True)
        return
    m, c = _marks(nctas)
    ghz = cp.cuda.Device().attributes["ClockRate"] / 1e6  # the SM clock's maximum (kHz -> GHz)
    dl = np.diff(c, axis=1) / (ghz * 1e3)  # µs per phase, per CTA (clock64 at the maximum clock)
    span = (m[:, 5].max() - m[:, 1].min()) / 1e3
    print(f"\n{hq}/{hkv} B={b} N={n}: {src} {p.split.key} splits {p.effective_splits(n)} {p.mode}, "
          f"{nctas} CTAs, l2_prefetch {int(rec.params['l2_prefetch'][0])}: {t.median_us:.2f} us per call (graph)")
    gl = np.diff(m, axis=1) / 1e3
    for i, name in enumerate(PHASES):
        print(f"  {name:16s} clock64 median {np.median(dl[:, i]):6.2f}  max {dl[:, i].max():6.2f} us;  "
              f"globaltimer median {np.median(gl[:, i]):6.2f}  max {gl[:, i].max():6.2f} us")
    print(f"  entries spread {(m[:, 0].max() - m[:, 0].min()) / 1e3:.2f} us, wait releases spread "
          f"{(m[:, 1].max() - m[:, 1].min()) / 1e3:.2f} us, ends spread {(m[:, 5].max() - m[:, 5].min()) / 1e3:.2f} us; "
          f"first release -> last end {span:.2f} us; first entry -> first release "
          f"{(m[:, 1].min() - m[:, 0].min()) / 1e3:.2f} us", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="32/8:1:1024,32/8:1:4096,32/8:1:16384,8/1:1:1024,8/1:1:16384,32/8:8:1024",
                    help="heads:batch:N list")
    ap.add_argument("--prefetch-mb", default="0", help="FDPP_L2_PREFETCH_MB values to run each point with")
    ap.add_argument("--prefetch-share", action="store_true", help="a call larger than the budget "
                    "prefetches the first budget/kv_bytes of every CTA's chunk (default: nothing)")
    ap.add_argument("--no-marks", action="store_true", help="time the (variant) kernels without the marks")
    ap.add_argument("--kernels", type=Path, help="read the kernel sources from this directory (another "
                    "revision's kernels_cu/, e.g. from `git archive`) instead of the working tree's")
    args = ap.parse_args()
    global MARKS_ON
    MARKS_ON = not args.no_marks
    if args.kernels:
        use_kernel_dir(args.kernels, names=None, transform=patch)
    else:
        use_sources(patch)
    _keep_modules()
    registry._compiled.clear()
    if args.prefetch_share:
        whole = launch.attention_prefetch

        def share(pdl: bool, kv_bytes: int, chunk: int) -> int:
            rows = whole(pdl, kv_bytes, chunk)
            if rows or not pdl or kv_bytes <= 0:
                return rows
            return int(chunk) * launch.L2_PREFETCH_BYTES // int(kv_bytes)

        launch.attention_prefetch = share
    for mb in [float(x) for x in args.prefetch_mb.split(",")]:
        launch.L2_PREFETCH_BYTES = int(mb * (1 << 20))
        print(f"\n=== L2 prefetch budget {mb:g} MiB", flush=True)
        for pt in args.points.split(","):
            heads, bs, ns = pt.split(":")
            hq, hkv = (int(x) for x in heads.split("/"))
            plan.clear()
            run_point(hq, hkv, int(bs), int(ns))


if __name__ == "__main__":
    main()
