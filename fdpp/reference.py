"""Independent NumPy references. Nothing here calls an fdpp kernel.

- ``attention_reference``: plain float64 attention (full score matrix, K/V repeated for GQA).
- ``split_kv_emulator``: the split-KV algorithm of the GPU kernels in NumPy: the cache cut into
  chunks, a partial softmax per chunk (partial output, local max, local sum), then a second phase
  that rescales each partial by exp(m_i - m_max) and merges. Equal to the plain reference to
  rounding at any chunk size; it is what ``fdpp.decode_attention`` runs on a machine with no GPU.
- ``gather_pages`` / ``paged_attention_reference``: a paged cache copied out through its block
  table into a contiguous one (plain fancy indexing), then the plain reference.
- ``assert_close`` / ``max_rel_err``: the one place tolerances are applied (per dtype, from
  ``fdpp.dtypes``).
"""

from __future__ import annotations

import math

import numpy as np

from fdpp.dtypes import get_dtype


def _as_bhnd(k: np.ndarray, kv_layout: str) -> np.ndarray:
    """Return the cache as [B, Hkv, N, D] (a view)."""
    if kv_layout == "NHD":
        return k.transpose(0, 2, 1, 3)
    if kv_layout == "HND":
        return k
    raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")


def _lengths(cache_seqlens: np.ndarray | None, batch: int, n_max: int) -> np.ndarray:
    if cache_seqlens is None:
        return np.full(batch, n_max, dtype=np.int64)
    return np.asarray(cache_seqlens, dtype=np.int64).reshape(batch)


def _xp(x: object):
    """The array module of ``x``: NumPy, or CuPy for CuPy arrays (so the float64 reference of a large
    GPU test can run on the GPU; it still never calls an fdpp kernel)."""
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def attention_reference(q, k_cache, v_cache, cache_seqlens=None, softmax_scale: float | None = None,
                        kv_layout: str = "NHD"):
    """Plain float64 decode attention (full score matrix, query heads grouped per KV head for GQA).

    Parameters
    ----------
    q : [B, Hq, D]
    k_cache, v_cache : [B, N_max, Hkv, D] ("NHD") or [B, Hkv, N_max, D] ("HND")
    cache_seqlens : int [B] or None (all N_max)

    NumPy in, NumPy out; CuPy in, CuPy out (computed with CuPy's float64 matmul).

    Returns
    -------
    out : float64 [B, Hq, D] (zeros for an empty request)
    lse : float64 [B, Hq], natural log (-inf for an empty request)
    """
    xp = _xp(q)
    q64 = xp.asarray(q).astype(xp.float64)
    k = _as_bhnd(k_cache, kv_layout).astype(xp.float64)
    v = _as_bhnd(v_cache, kv_layout).astype(xp.float64)
    b, hq, d = q64.shape
    hkv, n_max = k.shape[1], k.shape[2]
    r = hq // hkv
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if cache_seqlens is None:
        lens = xp.full((b,), n_max, dtype=xp.int64)
    else:
        lens = xp.asarray(cache_seqlens).astype(xp.int64).reshape(b)
    if n_max == 0:
        return xp.zeros((b, hq, d)), xp.full((b, hq), -xp.inf)
    s = xp.matmul(q64.reshape(b, hkv, r, d), k.transpose(0, 1, 3, 2)) * scale  # [B, Hkv, r, N]
    valid = xp.arange(n_max)[None, :] < lens[:, None]  # [B, N]
    s = xp.where(valid[:, None, None, :], s, -xp.inf)
    nonempty = (lens > 0)[:, None, None]
    m = xp.where(nonempty, s.max(axis=-1), 0.0)
    p = xp.exp(s - m[..., None])
    den = p.sum(axis=-1)
    safe = xp.where(den > 0, den, 1.0)
    out = xp.matmul(p, v) / safe[..., None]
    lse = xp.where(den > 0, m + xp.log(safe), -xp.inf)
    return out.reshape(b, hq, d), lse.reshape(b, hq)


def gather_pages(pages, block_table, cache_seqlens, kv_layout: str = "NHD"):
    """The contiguous cache [B, N_max, Hkv, D] ("NHD") or [B, Hkv, N_max, D] ("HND") that a page
    pool [num_pages, page_size, Hkv, D] / [num_pages, Hkv, page_size, D] holds through
    ``block_table`` [B, max_pages]; N_max = max_pages * page_size. Tokens at or past a request's
    length are zero (their block-table entries are not read). NumPy or CuPy."""
    xp = _xp(pages)
    table = xp.asarray(block_table).astype(xp.int64)
    lens = xp.asarray(cache_seqlens).astype(xp.int64).reshape(-1)
    b, max_pages = table.shape
    pool = pages if kv_layout == "NHD" else pages.transpose(0, 2, 1, 3)  # [P, page, Hkv, D]
    bits = pool.view(f"u{pool.dtype.itemsize}")  # copy bit patterns: any float type, CuPy or NumPy
    page = pool.shape[1]
    tok = xp.arange(max_pages * page)
    used = tok[None, :] < lens[:, None]  # [B, N_max]
    pg = xp.where(used, table[:, tok // page], 0)
    out = bits[pg, (tok % page)[None, :]]  # [B, N_max, Hkv, D]
    out = xp.where(used[:, :, None, None], out, 0).astype(bits.dtype).view(pool.dtype)  # 0 bits: +0.0
    return out if kv_layout == "NHD" else out.transpose(0, 2, 1, 3)


def dequant_fp8_cache(codes, kv_dtype: str, descale=None, kv_layout: str = "NHD") -> np.ndarray:
    """Float32 K or V of an FP8 cache, as the kernels define it: ``float32(code) * descale[b, h]``
    (one float32 product). ``codes`` [B, N, Hkv, D] (NHD) or [B, Hkv, N, D] (HND): ml_dtypes FP8
    or uint8 codes of format ``kv_dtype`` ("fp8_e4m3" | "fp8_e5m2"); ``descale`` None (1), a
    float, or an array [B, Hkv], [Hkv] or of one element. NumPy."""
    from fdpp.quant import dequant_fp8

    ds = np.asarray(1.0 if descale is None else descale, dtype=np.float32)
    if ds.ndim == 1 and ds.size > 1:  # [Hkv]: every request
        ds = ds[None]
    if ds.size > 1:  # [B, Hkv] onto the cache's (request, head) axes
        ds = ds[:, None, :, None] if kv_layout == "NHD" else ds[:, :, None, None]
    return dequant_fp8(np.asarray(codes).view(np.uint8), kv_dtype, ds.reshape(ds.shape if ds.size > 1 else ()))


def paged_attention_reference(q, k_pages, v_pages, block_table, cache_seqlens, softmax_scale=None,
                              kv_layout: str = "NHD"):
    """Float64 decode attention over a paged cache: :func:`gather_pages`, then
    :func:`attention_reference`. Returns out [B, Hq, D] and lse [B, Hq] (natural log)."""
    k = gather_pages(k_pages, block_table, cache_seqlens, kv_layout)
    v = gather_pages(v_pages, block_table, cache_seqlens, kv_layout)
    return attention_reference(q, k, v, cache_seqlens, softmax_scale, kv_layout)


def split_kv_emulator(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                      cache_seqlens: np.ndarray | None = None, softmax_scale: float | None = None,
                      kv_layout: str = "NHD", chunk: int = 256,
                      accum: type = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """The two-phase split-KV algorithm in NumPy, accumulating in ``accum``.

    Phase 1, per chunk c of ``chunk`` tokens: m_c = max s, l_c = sum exp(s - m_c),
    o_c = sum exp(s - m_c) v / l_c. Phase 2: m = max m_c, w_c = l_c exp(m_c - m),
    out = sum w_c o_c / sum w_c, lse = m + log sum w_c. Chunks past a request's length are empty
    (m_c = -inf, weight 0).

    Returns out [B, Hq, D] and lse [B, Hq] (natural log) in ``accum``.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    qf = np.asarray(q).astype(accum)
    k = _as_bhnd(np.asarray(k_cache), kv_layout)
    v = _as_bhnd(np.asarray(v_cache), kv_layout)
    b, hq, d = qf.shape
    hkv, n_max = k.shape[1], k.shape[2]
    r = hq // hkv
    scale = accum(1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale)
    lens = _lengths(cache_seqlens, b, n_max)
    if n_max == 0:  # nothing to attend to: zeros and lse = -inf, as the kernels and the reference
        return np.zeros((b, hq, d), dtype=accum), np.full((b, hq), -np.inf, dtype=accum)
    qg = (qf * scale).reshape(b, hkv, r, d)  # GQA: the r query heads of a KV head together
    nsplit = max(1, math.ceil(n_max / chunk))
    m_p = np.full((nsplit, b, hkv, r), -np.inf, dtype=accum)
    l_p = np.zeros((nsplit, b, hkv, r), dtype=accum)
    o_p = np.zeros((nsplit, b, hkv, r, d), dtype=accum)
    # Every chunk is computed at its full width (the last one zero-padded) from a C-contiguous copy,
    # and phase 2 adds the chunks one by one in order: a request's bits then do not depend on N_max
    # (batch_invariant's promise) -- NumPy's sums otherwise group their terms by the array's length
    # and layout, and trailing empty chunks or padded tokens would move the rounding.
    tok = np.arange(nsplit * chunk)
    with np.errstate(invalid="ignore", over="ignore"):
        for c in range(nsplit):
            lo, hi = c * chunk, min((c + 1) * chunk, n_max)
            kc = np.zeros((b, hkv, chunk, d), dtype=accum)
            vc = np.zeros((b, hkv, chunk, d), dtype=accum)
            kc[:, :, :hi - lo] = k[:, :, lo:hi]
            vc[:, :, :hi - lo] = v[:, :, lo:hi]
            valid = tok[lo:lo + chunk][None, :] < np.minimum(lens, n_max)[:, None]  # [B, chunk]
            # tokens past a request's length are never read, as in the kernels (their zero-filled
            # copies): a NaN / inf there must not reach the output through p = 0 times it
            if not valid.all():
                kc.transpose(0, 2, 1, 3)[~valid] = 0  # [B, chunk, Hkv, D] view: zeroed in place
                vc.transpose(0, 2, 1, 3)[~valid] = 0
            s = np.einsum("bhrd,bhnd->bhrn", qg, kc)
            s = np.where(valid[:, None, None, :], s, -np.inf)
            m = s.max(axis=-1)
            safe_m = np.where(np.isfinite(m), m, 0).astype(accum)
            p = np.exp(s - safe_m[..., None])
            lsum = p.sum(axis=-1)
            o = np.einsum("bhrn,bhnd->bhrd", p, vc)
            m_p[c], l_p[c] = m, lsum
            o_p[c] = np.where(lsum[..., None] > 0, o / np.where(lsum > 0, lsum, 1)[..., None], 0)
        m_all = m_p.max(axis=0)
        safe = np.where(np.isfinite(m_all), m_all, 0).astype(accum)
        w = l_p * np.exp(m_p - safe)  # empty chunk: l = 0 and exp(-inf) = 0
        den = np.zeros_like(safe)
        acc = np.zeros((b, hkv, r, d), dtype=accum)
        for c in range(nsplit):  # in order, one chunk at a time: an empty one adds exact zeros
            den = den + w[c]
            acc = acc + w[c][..., None] * o_p[c]
        out = acc / np.where(den > 0, den, 1)[..., None]
        lse = np.where(den > 0, safe + np.log(np.where(den > 0, den, 1)), -np.inf)
        # a NaN score poisons lse too (not "empty": -inf), and so does a +inf one (the kernels' exp(s - m)
        # is then exp(inf - inf) = NaN; here m is set aside as 0 and den would come out inf)
        lse = np.where(np.isnan(den) | (m_all == np.inf), np.nan, lse)
    return out.reshape(b, hq, d).astype(accum), lse.reshape(b, hq).astype(accum)


def max_rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out - ref| / max(|ref|_max, tiny): one number per call, NaN-aware (NaN -> inf)."""
    o = np.asarray(out, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    if o.shape != r.shape:
        raise ValueError(f"shapes differ: {o.shape} vs {r.shape}")
    if not np.all(np.isfinite(o) == np.isfinite(r)):
        return math.inf
    fin = np.isfinite(r)
    if not fin.any():
        return 0.0 if np.array_equal(o, r) else math.inf
    scale = max(float(np.abs(r[fin]).max()), 1e-30)
    return float(np.abs(o[fin] - r[fin]).max() / scale)


def assert_close(out: np.ndarray, ref: np.ndarray, dtype: object) -> None:
    """Assert ``out`` matches ``ref`` elementwise within the dtype's tolerances (fdpp.dtypes)."""
    dt = get_dtype(dtype)
    o = np.asarray(out, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    assert o.shape == r.shape, f"shape {o.shape} != reference {r.shape}"
    assert not np.isnan(o).any(), "output has NaN (unwritten or poisoned elements?)"
    np.testing.assert_allclose(o, r, rtol=dt.rtol, atol=dt.atol * max(1.0, float(np.abs(r[np.isfinite(r)]).max(initial=0))),
                               err_msg=f"tolerance of {dt.name}")


def merge_states_reference(outs, lses):
    """Float64 merge of S partial attention states (never calls an fdpp kernel).

    Parameters
    ----------
    outs : [S, B, H, D] (or a sequence of S [B, H, D])
    lses : [S, B, H] (or a sequence of S [B, H]), natural log; -inf marks an empty part

    Returns
    -------
    out : float64 [B, H, D] = sum_s exp(lse_s - lse) out_s (zeros where every part is empty; an
        empty part's output is not used)
    lse : float64 [B, H] = log sum_s exp(lse_s) (-inf where every part is empty)

    A row with a NaN or +inf lse in any part is NaN in both. NumPy or CuPy.
    """
    xp = _xp(outs if not isinstance(outs, (list, tuple)) else outs[0])
    o = xp.stack([xp.asarray(x) for x in outs]) if isinstance(outs, (list, tuple)) else xp.asarray(outs)
    lp = xp.stack([xp.asarray(x) for x in lses]) if isinstance(lses, (list, tuple)) else xp.asarray(lses)
    o = o.astype(xp.float64)
    lp = lp.astype(xp.float64)
    invalid = (xp.isnan(lp) | (lp == xp.inf)).any(axis=0)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        lp = xp.where(invalid[None], 0.0, lp)
        m = lp.max(axis=0)
        m = xp.where(m == -xp.inf, 0.0, m)
        lse = m + xp.log(xp.exp(lp - m[None]).sum(axis=0))  # log 0 = -inf when every part is empty
        used = lp != -xp.inf
        w = xp.where(used, xp.exp(lp - xp.where(lse == -xp.inf, 0.0, lse)[None]), 0.0)
        out = (w[..., None] * xp.where(used[..., None], o, 0.0)).sum(axis=0)
    out = xp.where(invalid[..., None], xp.nan, out)
    lse = xp.where(invalid, xp.nan, lse)
    return out, lse
