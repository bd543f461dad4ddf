"""GPU probe: the cluster merge against the shipped table's plan, CUDA-graph timed.

    python3 scripts/probe_cluster.py [--heads 32/8,8/1] [--batch 1,8] [--seqlens 1024,4096,16384,65536]

For each point: the plan the shipped table's entry names (read without its source-hash check, so a
table tuned before a kernel edit still names its plan; "heuristic" where it has none), then the
cluster merge at each cluster size with a few tensor-core shapes. Prints µs per call (median of
graph replays over input sets rotated past L2) and the max error against the float64 reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import cupy as cp

import fdpp
from fdpp import configs, dispatch, tables, timing
from fdpp.reference import attention_reference

ROOT = Path(__file__).resolve().parent.parent


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _table_plan(prob: configs.DecodeProblem) -> tuple[str, configs.LaunchPlan]:
    raw = json.loads((ROOT / "tuning" / "NVIDIA_H200.json").read_text())
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
    for label, plan in plans_for(prob):
        with dispatch.forced_plan(plan):
            try:
                o = fdpp.decode_attention(q0, k0, v0)
                err = float(cp.abs(o.astype(cp.float64) - ref).max() / cp.abs(ref).max())
                t = timing.time_calls([(lambda q=q, k=k, v=v, o=o: fdpp.decode_attention(q, k, v, out=o))
                                       for (q, k, v), o in zip(sets, outs, strict=True)], repeats=9)
            except Exception as e:  # noqa: BLE001 - a probe: report and go on
                print(f"{heads:>5} {b:>3} {n:>6} failed: {type(e).__name__}: {str(e)[:200]}  {label}")
                continue
        print(f"{heads:>5} {b:>3} {n:>6} {t.median_us:8.2f} {t.p10_us:8.2f} {t.p90_us:8.2f} {err:9.2e}  "
              f"{label}", flush=True)
    del sets, outs
    cp.get_default_memory_pool().free_all_blocks()


def table_row(prob: configs.DecodeProblem) -> tuple[str, configs.LaunchPlan]:
    """The shipped table's plan of ``prob`` (or the heuristic's), labelled for a probe row."""
    name, base = _table_plan(prob)
    return f"{name} {base.split.key} splits {base.effective_splits(prob.seqlen)} {base.mode}", base


PROBE_HEADER = f"{'heads':>5} {'B':>3} {'N':>6} {'us':>8} {'p10':>8} {'p90':>8} {'err':>9}  plan"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="32/8,8/1")
    ap.add_argument("--batch", type=_ints, default=[1, 8])
    ap.add_argument("--seqlens", type=_ints, default=[1024, 4096, 16384, 65536])
    ap.add_argument("--shapes", default="w4s2u1,w4s3u1,w8s2u1,w4s3u2")
    args = ap.parse_args()

    def plans_for(prob: configs.DecodeProblem) -> list[tuple[str, configs.LaunchPlan]]:
        plans = [table_row(prob)]
        g = configs.group_size_for(prob.ratio)
        b, hq, n = prob.batch, prob.num_q_heads, prob.seqlen
        for shape in args.shapes.split(","):
            w, rest = shape[1:].split("s")
            st, u = (int(x) for x in rest.split("u"))
            cfg = configs.DecodeConfig("fp16", prob.head_dim, g, int(w), st, u, mma=True)
            for c in configs.CLUSTER_SIZES:
                cc = dataclasses.replace(cfg, cluster=c)
                if cc.is_valid(configs.SM90) and b * (hq // g) * c <= 2 * 132 and n >= 64 * c:
                    plans.append((f"cluster {cc.key}", configs.LaunchPlan.cluster_merge(cfg, c)))
        return plans

    print(PROBE_HEADER)
    for heads in args.heads.split(","):
        for b in args.batch:
            for n in args.seqlens:
                time_plans(heads, b, n, plans_for)


if __name__ == "__main__":
    main()
