"""One decode_attention call per format at llama3-8b heads, B=1, N=64k, the shipped table's plan,
for Nsight Compute (profile the 3rd launch of decode_split_mma)."""
import sys

import cupy as cp

import fdpp

fmt = sys.argv[1]  # int4 | fp8_e4m3 | fp16
b, hq, hkv, d, n = 1, 32, 8, 128, 65536
rng = cp.random.default_rng(0)
q = rng.standard_normal((b, hq, d), dtype=cp.float32).astype(cp.float16)
k = rng.standard_normal((b, n, hkv, d), dtype=cp.float32).astype(cp.float16)
v = rng.standard_normal((b, n, hkv, d), dtype=cp.float32).astype(cp.float16)
if fmt == "fp16":
    args, kw = (q, k, v), {}
else:
    qkv = fdpp.quantize_kv(k, v, fmt, group_size=64)
    args = (q, qkv.k, qkv.v)
    kw = (dict(kv_dtype="int4", k_descale=qkv.k_scale, v_descale=qkv.v_scale, k_zero=qkv.k_zero, v_zero=qkv.v_zero)
          if fmt == "int4" else dict(kv_dtype=fmt, k_descale=qkv.k_descale, v_descale=qkv.v_descale))
for _ in range(3):
    fdpp.decode_attention(*args, **kw)
cp.cuda.runtime.deviceSynchronize()
