"""GPU probe: the cluster merge against the shipped table's plan, CUDA-graph timed.

    python3 scripts/probe_cluster.py [--heads 32/8,8/1] [--batch 1,8] [--seqlens 1024,4096,16384,65536]
                                     [--shapes w4s2u1,w4s3u1,...] [--clusters 2,4,8,16] [--splits 16,32]
                                     [--groups 0,2]
    python3 scripts/probe_cluster.py --heuristic [--heads 28/4,16/8] [--seqlens 1024,2048,4096]
    python3 scripts/probe_cluster.py --occupancy [--heads 32/8] [--shapes w4s3u1] [--clusters 2,...,16]

For each point: the plan the shipped table's entry names (read without its source-hash check, so a
table tuned before a kernel edit still names its plan; "heuristic" where it has none), then for
each tensor-core shape (``w<warps>s<stages>u<unroll>``, any stage count the validity rules allow,
not only the tuner's) the cluster merge at each cluster size and, for each ``--splits`` count, the
split-KV plan merged by the combine kernel and merged in the same launch (fused), for each
``--groups`` size (query heads per CTA; 0 = ``configs.group_size_for``, the tuner's, where each KV
head is read once; a smaller divisor of the GQA ratio gives each KV head ratio / group CTAs, which
read the same K/V, and skips the others). Prints µs per call (median of
graph replays over input sets rotated past L2) and the max error against the float64 reference.

``--heuristic``: only the heuristic's plan (configs.default_config, whose cluster merge
configs.heuristic_cluster allows for CLUSTER_HEURISTIC_GROUPS) and its fused twin (the same kernel
and split count merged in the launch, the heuristic before 2026-12-05): does the cluster merge pay
at head configurations no table holds.

``--occupancy``: for each head configuration (B = 1), shape and cluster size, the driver's
``cuOccupancyMaxActiveClusters`` for the cluster variant's launch (grid = size x KV-head groups):
how many clusters the GPU holds at once, against the number the launch asks for. Any size 2..16
runs (``configs.MAX_CLUSTER``); the tuner searches ``configs.CLUSTER_SIZES``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import cupy as cp

import fdpp
from fdpp import configs, dispatch, registry, tables, timing, tune
from fdpp.reference import attention_reference

ROOT = Path(__file__).resolve().parent.parent


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


_CP16 = 'asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n"'


def cp_prefetch(size: int) -> Callable[[str, str], str]:
    """A source transform for :func:`use_sources`: the K/V tiles' 16-byte cp.async (common.cuh's
    cp_async16) with the L2 prefetch-size hint ``.L2::<size>B`` (64, 128 or 256): on a miss L2
    fetches that many bytes around the line, the neighbouring rows of other heads or tokens."""
    if size not in (64, 128, 256):
        raise SystemExit(f"cp prefetch size {size}: 64, 128 or 256")

    def transform(name: str, text: str) -> str:
        if name != "common.cuh":
            return text
        if text.count(_CP16) != 1:
            raise SystemExit("cp_prefetch: common.cuh's cp_async16 asm not found")
        return text.replace(_CP16, _CP16.replace(".global [", f".global.L2::{size}B ["))
    return transform


def use_sources(transform: Callable[[str, str], str]) -> Path:
    """Compile from a temporary copy of kernels_cu/ with every file's text passed through
    ``transform(name, text)``: headers too (NVRTC reads them from the include directory, which is
    part of CuPy's cache key, so patched headers never meet kernels compiled from the shipped ones)."""
    src = registry.kernel_dir()
    tmp = Path(tempfile.mkdtemp(prefix="fdpp_probe_kernels_"))
    for f in src.iterdir():
        if f.is_file():
            (tmp / f.name).write_text(transform(f.name, f.read_text()))
    registry.kernel_dir = lambda: tmp
    registry.kernel_source.cache_clear()
    return tmp


def use_kernel_dir(kdir: Path, names: tuple[str, ...] | None = ("decode_split.cu", "kv_cache.cuh"),
                   transform: Callable[[str, str], str] = lambda name, text: text) -> Path:
    """:func:`use_sources` with ``names`` (None: every file) read from ``kdir`` (another revision's
    kernels), each file then passed through ``transform(name, text)``."""
    names = tuple(f.name for f in kdir.iterdir() if f.is_file()) if names is None else names
    texts = {name: (kdir / name).read_text() for name in names}
    return use_sources(lambda name, text: transform(name, texts.get(name, text)))


def shape_config(shape: str, dtype: str, head_dim: int, group_size: int, **kw) -> configs.DecodeConfig:
    """The tensor-core config of ``shape``, ``w<warps>s<stages>u<unroll>`` (e.g. ``w4s3u1``)."""
    w, rest = shape[1:].split("s")
    st, u = (int(x) for x in rest.split("u"))
    return configs.DecodeConfig(dtype, head_dim, group_size, int(w), st, u, mma=True, **kw)


def _table_path() -> Path:
    """The shipped table of the GPU the probe runs on (the H200's where that GPU has none)."""
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    path = ROOT / "tuning" / tables.table_filename(name.decode() if isinstance(name, bytes) else name)
    return path if path.is_file() else ROOT / "tuning" / "NVIDIA_H200.json"


def _table_plan(prob: configs.DecodeProblem) -> tuple[str, configs.LaunchPlan]:
    raw = json.loads(_table_path().read_text())
    key = tables.Bucket.of(prob).key
    for d in raw["entries"].values():
        e = tables.Entry.from_json(d)
        if e.bucket.key == key:
            return "table", e.plan()
    return "heuristic", configs.default_config(prob, configs.SM90)


def time_plans(heads: str, b: int, n: int, plans_for) -> None:
    """Time every (label, plan) of ``plans_for(problem)`` on one point; print a row each."""
    hq, hkv = (int(x) for x in heads.split("/"))
    d = 128
    prob = configs.DecodeProblem(b, hq, hkv, d, n, "fp16")
    per = 2 * b * n * hkv * d * 2
    count = timing.rotation_count(per, timing.l2_bytes(), factor=4, max_sets=64)
    sets = [tuple(cp.random.standard_normal(s, dtype=cp.float32).astype(cp.float16)
                  for s in ((b, hq, d), (b, n, hkv, d), (b, n, hkv, d))) for _ in range(count)]
    outs = [cp.empty((b, hq, d), cp.float16) for _ in sets]
    q0, k0, v0 = sets[0]
    ref, _ = attention_reference(q0, k0, v0)
    time_rows(f"{heads:>5} {b:>3} {n:>6}", plans_for(prob), sets, outs, ref,
              lambda s, o=None: fdpp.decode_attention(*s, out=o))
    del sets, outs
    cp.get_default_memory_pool().free_all_blocks()


def time_rows(prefix: str, labelled, sets: list, outs: list, ref, call: Callable[..., object]) -> None:
    """One printed row per (label, plan): ``call(set, out)`` under the plan, timed over every set
    (graph replays), and its max error on set 0 against ``ref`` relative to ``ref``'s largest value."""
    for label, plan in labelled:
        with dispatch.forced_plan(plan):
            try:
                o = call(sets[0])
                err = float(cp.abs(o.astype(cp.float64) - ref).max() / cp.abs(ref).max())
                t = timing.time_calls([(lambda s=s, o=o: call(s, o)) for s, o in zip(sets, outs, strict=True)],
                                      repeats=9)
            except Exception as e:  # noqa: BLE001 - a probe: report and go on
                print(f"{prefix} failed: {type(e).__name__}: {str(e)[:200]}  {label}", flush=True)
                continue
        print(f"{prefix} {t.median_us:8.2f} {t.p10_us:8.2f} {t.p90_us:8.2f} {err:9.2e}  {label}", flush=True)


def table_row(prob: configs.DecodeProblem) -> tuple[str, configs.LaunchPlan]:
    """The shipped table's plan of ``prob`` (or the heuristic's), labelled for a probe row."""
    name, base = _table_plan(prob)
    return f"{name} {base.split.key} splits {base.effective_splits(prob.seqlen)} {base.mode}", base


PROBE_HEADER = f"{'heads':>5} {'B':>3} {'N':>6} {'us':>8} {'p10':>8} {'p90':>8} {'err':>9}  plan"


def max_active_clusters(cfg: configs.DecodeConfig, groups: int) -> int:
    """cuOccupancyMaxActiveClusters of ``cfg`` (a cluster variant) launched with ``groups`` KV-head
    groups: the clusters the GPU can run at once."""
    from cuda.bindings import driver

    kern = registry.get_kernel(cfg)
    lc = driver.CUlaunchConfig()
    lc.gridDimX, lc.gridDimY, lc.gridDimZ = cfg.cluster, groups, 1
    lc.blockDimX, lc.blockDimY, lc.blockDimZ = cfg.num_warps * 32, 1, 1
    lc.sharedMemBytes = cfg.smem_bytes()
    lc.hStream = driver.CUstream(0)
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cfg.cluster, 1, 1
    lc.attrs = [attr]
    lc.numAttrs = 1
    err, n = driver.cuOccupancyMaxActiveClusters(driver.CUfunction(kern.kernel.ptr), lc)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters: {err}")
    return int(n)


def occupancy(heads: str, shapes: str, clusters: list[int]) -> None:
    """Print, per head configuration, shape and cluster size, the clusters the GPU holds at once."""
    print(f"{'heads':>5} {'shape':>8} {'cluster':>7} {'smem':>7} {'wanted':>6} {'fit':>4}")
    for h in heads.split(","):
        hq, hkv = (int(x) for x in h.split("/"))
        g = configs.group_size_for(hq // hkv)
        for shape in shapes.split(","):
            for c in clusters:
                cfg = dataclasses.replace(shape_config(shape, "fp16", 128, g), cluster=c)
                if not cfg.is_valid(configs.SM90):
                    print(f"{h:>5} {shape:>8} {c:>7} invalid: {cfg.check(configs.SM90)}")
                    continue
                fit = max_active_clusters(cfg, hq // g)
                print(f"{h:>5} {shape:>8} {c:>7} {cfg.smem_bytes():>7} {hq // g:>6} {fit:>4}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="32/8,8/1")
    ap.add_argument("--batch", type=_ints, default=[1, 8])
    ap.add_argument("--seqlens", type=_ints, default=[1024, 4096, 16384, 65536])
    ap.add_argument("--shapes", default="w4s2u1,w4s3u1,w8s2u1,w4s3u2")
    ap.add_argument("--clusters", type=_ints, default=list(configs.CLUSTER_SIZES))
    ap.add_argument("--splits", type=_ints, default=[])
    ap.add_argument("--groups", type=_ints, default=[0], help="query heads per CTA (0: configs.group_size_for)")
    ap.add_argument("--heuristic", action="store_true", help="the heuristic's cluster plan against its fused twin")
    ap.add_argument("--occupancy", action="store_true", help="clusters the GPU holds at once, per cluster size")
    args = ap.parse_args()
    if args.occupancy:
        occupancy(args.heads, args.shapes, args.clusters)
        return

    def heuristic_plans(prob: configs.DecodeProblem) -> list[tuple[str, configs.LaunchPlan]]:
        splits = configs.split_heuristic(prob, configs.SM90)
        cfg = configs.default_kernel(prob, configs.SM90, split=splits > 1)
        fused = configs.LaunchPlan.split_kv(cfg, splits, fused=True)
        plans = [(f"heuristic fused {cfg.key} splits {fused.effective_splits(prob.seqlen)}", fused)]
        plan = configs.default_config(prob, configs.SM90)
        if plan.mode == "cluster":
            plans.append((f"heuristic cluster {plan.split.key}", plan))
        tune.precompile(list({k.key: k for _, p in plans for k in p.kernels}.values()), jobs=16)
        return plans

    def plans_for(prob: configs.DecodeProblem) -> list[tuple[str, configs.LaunchPlan]]:
        plans = [table_row(prob)]
        b, hq, n = prob.batch, prob.num_q_heads, prob.seqlen
        for g in [gs or configs.group_size_for(prob.ratio) for gs in args.groups]:
            if prob.ratio % g or g > 8:
                continue
            for shape in args.shapes.split(","):
                cfg = shape_config(shape, "fp16", prob.head_dim, g)
                for c in args.clusters:
                    cc = dataclasses.replace(cfg, cluster=c)
                    if cc.is_valid(configs.SM90) and b * (hq // g) * c <= 2 * 132 and n >= 64 * c:
                        plans.append((f"cluster {cc.key}", configs.LaunchPlan.cluster_merge(cfg, c)))
                if not cfg.is_valid(configs.SM90):
                    continue
                for sp in args.splits:
                    if n >= 64 * sp:
                        plans.append((f"combine {cfg.key} splits {sp}", configs.LaunchPlan.split_kv(cfg, sp)))
                        plans.append((f"fused {cfg.key} splits {sp}", configs.LaunchPlan.split_kv(cfg, sp, fused=True)))
        tune.precompile(list({k.key: k for _, p in plans for k in p.kernels}.values()), jobs=16)
        return plans

    print(PROBE_HEADER)
    for heads in args.heads.split(","):
        for b in args.batch:
            for n in args.seqlens:
                time_plans(heads, b, n, heuristic_plans if args.heuristic else plans_for)


if __name__ == "__main__":
    main()
