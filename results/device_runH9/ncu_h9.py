"""H9: 3 calls each of contiguous and paged (pages of 16 in order) decode at llama3-8b heads, B=1,
N=16k, the same forced plan (mma w8 s3 u1, 16 splits, two launches), for Nsight Compute."""
import cupy as cp
import numpy as np
import fdpp
from fdpp import configs, dispatch

b, hq, hkv, d, n, page = 1, 32, 8, 128, 16384, 16
q = cp.random.standard_normal((b, hq, d), dtype=cp.float32).astype(cp.float16)
k = cp.random.standard_normal((b, n, hkv, d), dtype=cp.float32).astype(cp.float16)
v = cp.random.standard_normal((b, n, hkv, d), dtype=cp.float32).astype(cp.float16)
kp, vp = k.reshape(n // page, page, hkv, d), v.reshape(n // page, page, hkv, d)
table = cp.arange(n // page, dtype=cp.int32).reshape(1, -1)
lens = cp.full(1, n, cp.int32)
for page_size, fn in ((0, lambda: fdpp.decode_attention(q, k, v)),
                      (page, lambda: fdpp.paged_decode_attention(q, kp, vp, table, lens))):
    cfg = configs.DecodeConfig("fp16", d, 4, 8, 3, 1, mma=True, page_size=page_size)
    with dispatch.forced_plan(configs.LaunchPlan.split_kv(cfg, 16)):
        for _ in range(3):
            fn()
    cp.cuda.runtime.deviceSynchronize()
