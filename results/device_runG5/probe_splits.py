"""Graph-timed fp16 llama3-8b heads, B=1: the tuned plan against the same kernel family with the
split count that fills the GPU at the kernel's occupancy (CTAs per SM x SMs), N in {16k, 64k}."""
import dataclasses

import cupy as cp

import fdpp
from fdpp import dispatch, registry, timing
from fdpp.configs import DecodeConfig, DecodeProblem, LaunchPlan

for n in (16384, 65536):
    prob = DecodeProblem(1, 32, 8, 128, n, "fp16", "fp16")
    lim = registry.device_limits(0)
    tuned = dispatch.select_plan(prob, lim, None)
    variants = {"tuned": tuned}
    for w, s in ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3)):
        cfg = DecodeConfig("fp16", 128, 4, w, s, 1, mma=True)
        if cfg.check(lim):
            continue
        for splits in (16, 33, 49, 66):
            for fused in (False, True):
                variants[f"w{w} s{s} splits {splits} {'fused' if fused else 'combine'}"] = \
                    LaunchPlan.split_kv(cfg, splits, fused=fused)
    sets = []
    for _ in range(2 if n > 20000 else 4):
        q = cp.random.standard_normal((1, 32, 128), dtype=cp.float32).astype(cp.float16)
        k = cp.random.standard_normal((1, n, 8, 128), dtype=cp.float32).astype(cp.float16)
        v = cp.random.standard_normal((1, n, 8, 128), dtype=cp.float32).astype(cp.float16)
        sets.append((q, k, v, cp.empty((1, 32, 128), cp.float16)))
    res = []
    for name, plan in variants.items():
        def make(st, plan=plan):
            def call():
                with dispatch.forced_plan(plan):
                    fdpp.decode_attention(st[0], st[1], st[2], out=st[3])
            return call
        try:
            t = timing.time_calls([make(st) for st in sets], calls_per_replay=len(sets) * 4, warmup=3,
                                  repeats=15).median_us
        except Exception as e:  # noqa: BLE001
            print(f"N={n} {name}: {type(e).__name__}: {e}", flush=True)
            continue
        res.append((t, name))
        print(f"N={n:6d} {name:32s} {t:8.3f} us", flush=True)
    print(f"N={n} best: {sorted(res)[:4]}", flush=True)
