"""Graph-timed GPU time of the tuned plan against the same split config made one launch (fused
merge), llama3-8b heads, B=1, N in {1k, 4k}: what one launch fewer costs on the GPU."""
import dataclasses
import sys

import cupy as cp

import fdpp
from fdpp import dispatch, registry, timing
from fdpp.configs import DecodeProblem

rows = []
for n in (1024, 4096):
    prob = DecodeProblem(1, 32, 8, 128, n, "fp16", "fp16")
    lim = registry.device_limits(0)
    tuned = dispatch.select_plan(prob, lim, None)
    variants = {"tuned": tuned}
    if not tuned.fused:
        variants["same config, fused"] = dataclasses.replace(tuned, kernels=tuned.kernels[:1], fused=True)
        for s in (8, 32):
            variants[f"fused, {s} splits"] = dataclasses.replace(tuned, kernels=tuned.kernels[:1], fused=True,
                                                                  num_splits=s)
    sets = []
    for _ in range(8):  # rotated inputs: 8 x 4 MB at 1k, 8 x 16 MB at 4k (> 60 MB L2 at 4k)
        q = cp.random.standard_normal((1, 32, 128), dtype=cp.float32).astype(cp.float16)
        k = cp.random.standard_normal((1, n, 8, 128), dtype=cp.float32).astype(cp.float16)
        v = cp.random.standard_normal((1, n, 8, 128), dtype=cp.float32).astype(cp.float16)
        sets.append((q, k, v, cp.empty((1, 32, 128), cp.float16)))
    for name, plan in variants.items():
        def make(s, plan=plan):
            def call():
                with dispatch.forced_plan(plan):
                    fdpp.decode_attention(s[0], s[1], s[2], out=s[3])
            return call
        t = timing.time_calls([make(s) for s in sets], calls_per_replay=len(sets) * 4, warmup=3, repeats=20).median_us
        rows.append((n, name, len(plan.launches(n)), plan.num_splits, t))
        print(f"N={n:5d} {name:22s} launches={len(plan.launches(n))} splits={plan.num_splits:3d} {t:7.3f} us", flush=True)
sys.exit(0)
