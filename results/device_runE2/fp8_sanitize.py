import cupy as cp, numpy as np, fdpp
rng = np.random.default_rng(0)
for fmt, f8 in (("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")):
    import ml_dtypes
    for n, page in ((1000, 0), (700, 16), (333, 1)):
        b, hq, hkv, d = 3, 32, 8, 128
        q = cp.asarray(rng.standard_normal((b, hq, d), dtype=np.float32).astype(np.float16))
        if page:
            pp = -(-n // page); pool = b * pp + 2
            kc = cp.asarray(rng.integers(0, 126, size=(pool, page, hkv, d), dtype=np.uint8))
            table = cp.asarray(rng.permutation(pool)[:b * pp].reshape(b, pp).astype(np.int32))
            lens = cp.asarray(np.array([n, n // 2, 0], np.int32))
            for splits in (None, 3):
                fdpp.paged_decode_attention(q, kc, kc, table, lens, kv_dtype=fmt, k_descale=0.01, v_descale=0.02, num_splits=splits)
        else:
            kc = cp.asarray(rng.integers(0, 126, size=(b, n, hkv, d), dtype=np.uint8))
            ds = cp.asarray(rng.uniform(0.001, 0.01, size=(b, hkv)).astype(np.float32))
            for splits in (None, 1, 5):
                fdpp.decode_attention(q, kc, kc, cache_seqlens=cp.asarray(np.array([n, 7, 0], np.int32)), kv_dtype=fmt,
                                      k_descale=ds, v_descale=ds, num_splits=splits, return_lse=True)
cp.cuda.runtime.deviceSynchronize()
print("fp8 sanitize workload done")
