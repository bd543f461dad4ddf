"""INT4 test helpers shared by the CPU and GPU tests: random caches in fdpp's INT4 format and an
independent NumPy dequantiser (written from the README's byte-layout table, not from fdpp.quant)."""

import numpy as np


def dequant(packed, scale, zero):
    """uint8 [..., D // 2] codes, fp16 [..., D // g] scale / zero -> float64 [..., D]: element 2i
    is the low nibble of byte i; value float16(n * scale + zero), one rounding."""
    packed = np.asarray(packed)
    n = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    g = n.shape[-1] // np.shape(scale)[-1]
    s = np.repeat(np.asarray(scale, np.float16).astype(np.float64), g, axis=-1)
    z = np.repeat(np.asarray(zero, np.float16).astype(np.float64), g, axis=-1)
    return (n * s + z).astype(np.float16).astype(np.float64)


def random_int4(shape, group_size, rng, outliers=False):
    """Codes [*shape[:-1], D // 2] uint8 and fp16 scale / zero [*shape[:-1], D // g] of a cache of
    ``shape`` (last axis D): random codes, scales ~ [0.01, 0.3] (a few large-magnitude channels'
    groups scaled 30x with ``outliers``), zeros ~ -8 * scale."""
    *lead, d = shape
    codes = rng.integers(0, 256, size=(*lead, d // 2), dtype=np.uint8)
    ng = d // group_size
    s = rng.uniform(0.01, 0.3, size=(*lead, ng))
    if outliers:
        s[..., : max(1, ng // 4)] *= 30.0  # groups holding the large channels (K of real models)
    z = -8.0 * s + rng.uniform(-0.1, 0.1, size=s.shape)
    return codes, s.astype(np.float16), z.astype(np.float16)


def reference(q, k, v, lens, scale=None, layout="NHD"):
    """float64 attention over dequantised K/V (float64 arrays [B, N, Hkv, D] or HND), GQA by repeating
    K/V; returns (out [B, Hq, D], lse [B, Hq]); empty requests give 0 and -inf."""
    q = np.asarray(q, np.float64)
    if layout == "HND":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    b, hq, d = q.shape
    hkv = k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((b, hq, d))
    lse = np.full((b, hq), -np.inf)
    for i in range(b):
        n = int(lens[i])
        if n == 0:
            continue
        kk = np.repeat(k[i, :n], hq // hkv, axis=1)  # [n, Hq, D]
        vv = np.repeat(v[i, :n], hq // hkv, axis=1)
        s = np.einsum("hd,nhd->hn", q[i], kk) * scale
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        out[i] = np.einsum("hn,nhd->hd", p, vv) / p.sum(axis=1, keepdims=True)
        lse[i] = (m[:, 0] + np.log(p.sum(axis=1)))
    return out, lse
