import sys, cupy as cp, numpy as np, fdpp
from fdpp import configs, dispatch
fmt = sys.argv[1]  # fp8_e4m3 | fp16
w, s, u, splits = (int(x) for x in sys.argv[2:6])
b, hq, hkv, d, n = 1, 32, 8, 128, 65536
rng = cp.random.default_rng(0)
q = rng.standard_normal((b, hq, d), dtype=cp.float32).astype(cp.float16)
if fmt == "fp16":
    k = rng.standard_normal((b, n, hkv, d), dtype=cp.float32).astype(cp.float16); kw = {}
    cfg = configs.DecodeConfig("fp16", d, 4, w, s, u, mma=True)
else:
    k = (rng.integers(0, 120, size=(b, n, hkv, d), dtype=cp.int32)).astype(cp.uint8); kw = dict(kv_dtype=fmt, k_descale=0.01, v_descale=0.01)
    cfg = configs.DecodeConfig("fp16", d, 4, w, s, u, mma=True, kv_dtype=fmt)
v = k.copy()
plan = configs.LaunchPlan.split_kv(cfg, splits, fused=True)
with dispatch.forced_plan(plan):
    for _ in range(3):
        fdpp.decode_attention(q, k, v, **kw)
cp.cuda.runtime.deviceSynchronize()
