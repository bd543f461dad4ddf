"""One decode_attention call per KV format at llama3-8b heads, B = 1, N = 64k, the shipped table's
plan, compiled with -lineinfo, for Nsight Compute (profile the 3rd launch of decode_split_mma):
where do the FP8 kernel's extra L2 sector reads (run Q7: 5.25 M for 4.20 M DRAM sectors) come from?
Usage: python3 ncu_kv.py fp16|fp8_e4m3|int4 [NHD|HND]"""
import sys

import cupy as cp

import fdpp
from fdpp import registry

registry.NVRTC_OPTIONS = (*registry.NVRTC_OPTIONS, "-lineinfo")
fmt = sys.argv[1]
layout = sys.argv[2] if len(sys.argv) > 2 else "NHD"
b, hq, hkv, d, n = 1, 32, 8, 128, 65536
rng = cp.random.default_rng(0)
q = rng.standard_normal((b, hq, d), dtype=cp.float32).astype(cp.float16)
shape = (b, n, hkv, d) if layout == "NHD" else (b, hkv, n, d)
k = rng.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
v = rng.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
if fmt == "fp16":
    args, kw = (q, k, v), {}
else:
    qkv = fdpp.quantize_kv(k, v, fmt, group_size=64, kv_layout=layout)
    args = (q, qkv.k, qkv.v)
    kw = (dict(kv_dtype="int4", k_descale=qkv.k_scale, v_descale=qkv.v_scale, k_zero=qkv.k_zero, v_zero=qkv.v_zero)
          if fmt == "int4" else dict(kv_dtype=fmt, k_descale=qkv.k_descale, v_descale=qkv.v_descale))
    print("k ptr % 256:", qkv.k.data.ptr % 256, "v ptr % 256:", qkv.v.data.ptr % 256, qkv.k.shape, qkv.k.strides)
for _ in range(3):
    fdpp.decode_attention(*args, kv_layout=layout, **kw)
cp.cuda.runtime.deviceSynchronize()
