"""Hostile inputs on the GPU, memory stability, and the sanitizer workload's structure.

GPU tests (``@pytest.mark.gpu``; CuPy arrays and torch tensors), each followed by a clean call
that must still give the right answer (no corrupted state: :func:`_still_healthy`) and a check
that the inputs were not modified:

- NaN / Inf in q, K or V of one request: that request's affected heads are non-finite, every
  other output element (other requests, other heads) is bit for bit the clean call's; NaN or Inf
  *past* a request's length (or in unused slots of its last page) is never read: the output is
  bit for bit the clean one;
- lengths beyond the capacity and negative, block-table entries outside the pool: NaN output
  and lse for that request only (contiguous and paged); ``fdpp.set_checks(True)`` raises
  ValueError naming the request instead;
- misaligned K/V pointers and strides: ValueError ("16-byte"); q and out may be misaligned
  (element loads and stores): they work; non-contiguous views (strided in N, sliced heads, HND
  over NHD storage) work and match the reference; ``out`` overlapping an input: ValueError
  ("overlap"); arrays on another device: ValueError (skipped with one GPU); a CPU torch tensor:
  TypeError; an empty cache (N_max = 0): zeros and lse -inf;
- memory: 100k eager calls and 10k CUDA-graph replays leave CuPy's pool, the compiled-kernel
  registry and the workspaces as they were after a warm-up.

CPU tests (no mark): ``scripts/sanitize_workload.py`` imports without a GPU, lists every kernel
family, parses its arguments, and its compute-sanitizer log parser classifies fdpp and library
kernel errors in both log formats; ``scripts/sanitize.sh`` is valid bash naming the four tools.
"""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import fdpp
from fdpp.dtypes import DTYPES
from fdpp.reference import assert_close, attention_reference, paged_attention_reference

ROOT = Path(__file__).resolve().parent.parent
DTS = ("fp16", "bf16", "fp32")
gpu = pytest.mark.gpu


# ---- helpers (GPU tests) --------------------------------------------------------------------
def _cp():
    import cupy

    return cupy


def _np(dt: str) -> np.dtype:
    return DTYPES[dt].np_dtype


def _hrand(rng, shape, dt, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(_np(dt))


def _dev(h: np.ndarray, kind: str = "cupy"):
    """A host array on the device: a CuPy array, or a torch CUDA tensor (bits copied, so bf16 and
    NaN payloads survive); kind "numpy": a copy of the host array (the NumPy path's twin tests)."""
    if kind == "numpy":
        return h.copy()
    if kind == "cupy":
        return _cp().asarray(h)
    import torch

    if h.dtype.kind in "iu":
        return torch.from_numpy(np.ascontiguousarray(h)).cuda()
    tdt = {2: torch.int16, 4: torch.int32}[h.dtype.itemsize]
    t = torch.from_numpy(np.ascontiguousarray(h).view(f"i{h.dtype.itemsize}")).cuda()
    assert t.dtype == tdt
    return t.view({"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[h.dtype.name])


def _bits(x) -> np.ndarray:
    """The raw bits of a device (or NumPy) array on the host (exact, NaN-safe comparisons)."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).view(f"u{x.dtype.itemsize}").copy()
    if type(x).__module__.split(".")[0] == "torch":
        import torch

        x = x.contiguous()
        if x.dtype.is_floating_point:
            x = x.view({2: torch.int16, 4: torch.int32}[x.element_size()])
        return x.cpu().numpy().copy()
    cp = _cp()
    if x.dtype.kind not in "iu":  # same-size view first: no CuPy kernel ever runs on bf16
        x = x.view(f"u{x.dtype.itemsize}")
    return cp.asnumpy(cp.ascontiguousarray(x))


def _f64(x, dt: str) -> np.ndarray:
    b = _bits(x)
    return b.view(f"u{b.dtype.itemsize}").view(_np(dt)).astype(np.float64)


def _contig(rng, dt, b=3, hkv=2, ratio=4, d=128, n=300, layout="NHD"):
    hq = hkv * ratio
    shape = (b, n, hkv, d) if layout == "NHD" else (b, hkv, n, d)
    return _hrand(rng, (b, hq, d), dt), _hrand(rng, shape, dt), _hrand(rng, shape, dt)


def _paged(rng, dt, lens, b=3, hkv=2, ratio=4, d=128, page=16, spare=3):
    per = [-(-int(n) // page) for n in lens]
    width = max(1, max(per))
    num_pages = sum(per) + spare
    perm = rng.permutation(num_pages)
    table = rng.integers(-5, 2 * num_pages, size=(b, width)).astype(np.int32)  # unused: never read
    nxt = 0
    for i, p in enumerate(per):
        table[i, :p] = perm[nxt:nxt + p]
        nxt += p
    shape = (num_pages, page, hkv, d)
    return (_hrand(rng, (b, hkv * ratio, d), dt), _hrand(rng, shape, dt), _hrand(rng, shape, dt), table,
            np.asarray(lens, np.int32))


def _sync(kind="cupy"):
    if kind == "numpy":
        return
    if kind == "torch":
        import torch

        torch.cuda.synchronize()
    else:
        _cp().cuda.Device().synchronize()


_HEALTH: dict = {}


def _still_healthy(kind: str = "cupy"):
    """A fixed clean call (contiguous and paged) gives the reference answer: no state left
    corrupted by the hostile call before it (a sticky CUDA error, a poisoned workspace, ...)."""
    if not _HEALTH:
        rng = np.random.default_rng(1234)
        _HEALTH["c"] = _contig(rng, "fp16", b=2, n=200)
        _HEALTH["lens"] = np.array([200, 77], np.int32)
        _HEALTH["p"] = _paged(rng, "fp16", [150, 33], b=2)
    q, k, v = _HEALTH["c"]
    lens = _HEALTH["lens"]
    for splits in (1, 4):
        out = fdpp.decode_attention(_dev(q, kind), _dev(k, kind), _dev(v, kind), cache_seqlens=_dev(lens, kind),
                                    num_splits=splits)
        assert_close(_f64(out, "fp16"), attention_reference(q, k, v, lens)[0], "fp16")
        args = _HEALTH["p"]
        out = fdpp.paged_decode_attention(*(_dev(a, kind) for a in args), num_splits=splits)
        assert_close(_f64(out, "fp16"), paged_attention_reference(*args)[0], "fp16")


@contextlib.contextmanager
def _unchanged(*arrays, kind: str = "cupy"):
    """The device arrays hold the same bits after the block."""
    before = [_bits(a) for a in arrays]
    yield
    _sync(kind)
    for i, (a, b) in enumerate(zip(arrays, before, strict=True)):
        assert np.array_equal(_bits(a), b), f"input {i} was modified"


def _torch():
    return pytest.importorskip("torch")


# ---- NaN / Inf in the inputs ----------------------------------------------------------------
POISONS = ("q_nan", "q_inf", "k_nan", "k_inf", "v_nan", "v_inf")


def _poison(kind, q, k, v, r, hq_of_group, g, tok, layout="NHD"):
    """Poison request r: q of head hq_of_group[0], or K/V of KV head g at token tok."""
    q, k, v = q.copy(), k.copy(), v.copy()
    val = np.nan if kind.endswith("nan") else np.inf
    kv_index = (r, tok, g) if layout == "NHD" else (r, g, tok)
    if kind.startswith("q"):
        q[r, hq_of_group[0], 3] = val
        heads = [hq_of_group[0]]
    elif kind.startswith("k"):
        k[kv_index] = val
        if kind == "k_inf":  # q > 0 against +inf: a score of +inf (not NaN from mixed signs)
            q[r, hq_of_group] = np.abs(q[r, hq_of_group].astype(np.float32)).astype(q.dtype)
        heads = list(hq_of_group)
    else:
        v[kv_index] = val
        heads = list(hq_of_group)
    return q, k, v, heads




def _check_poisoned(out, lse, clean_out, clean_lse, r, heads, kind, dt):
    o, c = _bits(out), _bits(clean_out)
    mask = np.zeros(o.shape[:2], bool)
    mask[r, heads] = True
    assert np.array_equal(o[~mask], c[~mask]), "an unaffected request or head changed"
    assert np.array_equal(_bits(lse)[~mask], _bits(clean_lse)[~mask]), "an unaffected lse changed"
    of = _f64(out, dt)[r, heads]
    assert not np.isfinite(of).any(), (
        f"{kind}: the affected heads of request {r} must be NaN/Inf-propagated; got {np.isfinite(of).mean():.0%} "
        f"finite values (e.g. {of.ravel()[:4]}): a poisoned chunk was dropped or answered as empty")
    lf = _f64(lse, "fp32")[r, heads]
    if kind.startswith("v"):  # scores are untouched: the lse is exactly the clean one
        assert np.array_equal(_bits(lse)[r, heads], _bits(clean_lse)[r, heads])
    else:
        assert np.isnan(lf).all(), f"{kind}: lse of the affected heads must be NaN (-inf reads as empty), got {lf}"


#: the array types a hostile-input test runs on: NumPy (the emulator, in CI) and CuPy (the kernels)
BACKENDS = ("numpy", pytest.param("cupy", marks=gpu))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", POISONS)
@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("splits", [1, 4])
def test_nan_inf_contiguous_affects_only_that_request(rng, kind, dt, splits, backend):
    q, k, v = _contig(rng, dt)
    lens = np.array([300, 250, 97], np.int32)
    r, g, tok = 1, 1, 123  # request 1, KV head 1 (q heads 4..7), a token inside its length
    qp, kp, vp, heads = _poison(kind, q, k, v, r, list(range(4 * g, 4 * g + 4)), g, tok)
    dl = _dev(lens, backend)
    clean = fdpp.decode_attention(_dev(q, backend), _dev(k, backend), _dev(v, backend), cache_seqlens=dl,
                                  num_splits=splits, return_lse=True)
    args = [_dev(qp, backend), _dev(kp, backend), _dev(vp, backend)]
    with _unchanged(*args, dl, kind=backend):
        out, lse = fdpp.decode_attention(*args, cache_seqlens=dl, num_splits=splits, return_lse=True)
        _sync(backend)
    _check_poisoned(out, lse, *clean, r, heads, kind, dt)
    _still_healthy(backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", POISONS)
@pytest.mark.parametrize("dt", ["fp16", "fp32"])
@pytest.mark.parametrize("splits", [1, 4])
def test_nan_inf_paged_affects_only_that_request(rng, kind, dt, splits, backend):
    q, kp, vp, table, lens = _paged(rng, dt, [300, 250, 97])
    r, g, tok = 1, 0, 70
    page = kp.shape[1]
    hs = list(range(4 * g, 4 * g + 4))
    qq, kk, vv = q.copy(), kp.copy(), vp.copy()
    val = np.nan if kind.endswith("nan") else np.inf
    slot = (int(table[r, tok // page]), tok % page, g)  # where request r's token tok lives in the pool
    if kind.startswith("q"):
        qq[r, hs[0], 3] = val
        heads = [hs[0]]
    elif kind.startswith("k"):
        kk[slot] = val
        if kind == "k_inf":  # q > 0 against +inf: a score of +inf (not NaN from mixed signs)
            qq[r, hs] = np.abs(q[r, hs].astype(np.float32)).astype(q.dtype)
        heads = hs
    else:
        vv[slot] = val
        heads = hs
    dev = lambda a: _dev(a, backend)  # noqa: E731
    dt_, dl = dev(table), dev(lens)
    clean = fdpp.paged_decode_attention(dev(q), dev(kp), dev(vp), dt_, dl, num_splits=splits, return_lse=True)
    args = [dev(qq), dev(kk), dev(vv)]
    with _unchanged(*args, dt_, dl, kind=backend):
        out, lse = fdpp.paged_decode_attention(*args, dt_, dl, num_splits=splits, return_lse=True)
        _sync(backend)
    _check_poisoned(out, lse, *clean, r, heads, kind, dt)
    _still_healthy(backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("splits", [1, 3])
def test_garbage_past_the_length_is_never_read(rng, dt, splits, backend):
    """NaN/Inf in K and V past each request's length (contiguous), and in the unused slots of the
    last page and the unused pages (paged): the output is bit for bit that of a clean cache."""
    q, k, v = _contig(rng, dt, n=200)
    lens = np.array([200, 131, 0], np.int32)
    kg, vg = k.copy(), v.copy()
    for i, n in enumerate(lens):
        kg[i, n:] = np.nan
        vg[i, n:] = np.inf
    dev = lambda a: _dev(a, backend)  # noqa: E731
    dl = dev(lens)
    clean = fdpp.decode_attention(dev(q), dev(k), dev(v), cache_seqlens=dl, num_splits=splits, return_lse=True)
    dirty = fdpp.decode_attention(dev(q), dev(kg), dev(vg), cache_seqlens=dl, num_splits=splits, return_lse=True)
    for a, b in zip(clean, dirty, strict=True):
        assert np.array_equal(_bits(a), _bits(b))
    q, kp, vp, table, lens = _paged(rng, dt, [100, 33, 1], page=16, spare=4)
    kg, vg = kp.copy(), vp.copy()
    used = {(int(table[i, t // 16]), t % 16) for i, n in enumerate(lens) for t in range(n)}
    for p in range(kp.shape[0]):
        for s in range(16):
            if (p, s) not in used:
                kg[p, s], vg[p, s] = np.nan, -np.inf
    clean = fdpp.paged_decode_attention(*(dev(a) for a in (q, kp, vp, table, lens)), num_splits=splits,
                                        return_lse=True)
    dirty = fdpp.paged_decode_attention(*(dev(a) for a in (q, kg, vg, table, lens)), num_splits=splits,
                                        return_lse=True)
    for a, b in zip(clean, dirty, strict=True):
        assert np.array_equal(_bits(a), _bits(b))
    _still_healthy(backend)


# ---- bad lengths and block tables -----------------------------------------------------------
@gpu
@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("splits", [1, 4])
def test_bad_lengths_contiguous_nan_for_that_request_only(rng, kind, splits):
    if kind == "torch":
        _torch()
    q, k, v = _contig(rng, "bf16", b=4, n=100)
    good = np.array([100, 50, 7, 1], np.int32)
    args = [_dev(x, kind) for x in (q, k, v)]
    clean, clean_lse = fdpp.decode_attention(*args, cache_seqlens=_dev(good, kind), num_splits=splits, return_lse=True)
    for bad_req, val in ((1, 101), (2, -1), (3, 2**31 - 1), (0, -(2**31))):
        lens = good.copy()
        lens[bad_req] = val
        dl = _dev(lens, kind)
        with _unchanged(*args, dl):
            out, lse = fdpp.decode_attention(*args, cache_seqlens=dl, num_splits=splits, return_lse=True)
            _sync(kind)
        o, lo = _f64(out, "bf16"), _f64(lse, "fp32")
        assert np.isnan(o[bad_req]).all() and np.isnan(lo[bad_req]).all(), (bad_req, val)
        keep = [i for i in range(4) if i != bad_req]
        assert np.array_equal(_bits(out)[keep], _bits(clean)[keep])
        assert np.array_equal(_bits(lse)[keep], _bits(clean_lse)[keep])
    _still_healthy()


@gpu
@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("page", [1, 16, 256])
def test_bad_tables_and_lengths_paged_nan_for_that_request_only(rng, kind, page):
    if kind == "torch":
        _torch()
    q, kp, vp, table, lens = _paged(rng, "fp16", [300, 200, 97, 40], b=4, page=page)
    cap = table.shape[1] * page
    dq, dk, dv = (_dev(x, kind) for x in (q, kp, vp))
    clean = fdpp.paged_decode_attention(dq, dk, dv, _dev(table, kind), _dev(lens, kind), num_splits=4)
    cases = []
    t = table.copy()
    t[1, (200 - 1) // page] = kp.shape[0]  # the last page request 1 uses: one past the pool
    cases.append((1, t, lens))
    t = table.copy()
    t[2, 0] = -1
    cases.append((2, t, lens))
    t = table.copy()
    t[3, 0] = 2**31 - 1
    cases.append((3, t, lens))
    ln = lens.copy()
    ln[0] = cap + 1
    cases.append((0, table, ln))
    ln = lens.copy()
    ln[3] = -5
    cases.append((3, table, ln))
    for bad_req, t, ln in cases:
        dt_, dl = _dev(t, kind), _dev(ln, kind)
        with _unchanged(dq, dk, dv, dt_, dl):
            out = fdpp.paged_decode_attention(dq, dk, dv, dt_, dl, num_splits=4)
            _sync(kind)
        o = _f64(out, "fp16")
        assert np.isnan(o[bad_req]).all(), bad_req
        keep = [i for i in range(4) if i != bad_req]
        assert np.array_equal(_bits(out)[keep], _bits(clean)[keep])
    _still_healthy()


@gpu
def test_checking_mode_names_the_request(rng):
    cp = _cp()
    q, k, v = (_dev(x) for x in _contig(rng, "fp16", b=3, n=64))
    pq, pk, pv, table, lens = _paged(rng, "fp16", [100, 30, 5])
    fdpp.set_checks(True)
    try:
        with pytest.raises(ValueError, match="request 2"):
            fdpp.decode_attention(q, k, v, cache_seqlens=cp.asarray(np.array([64, 3, 65], np.int32)))
        with pytest.raises(ValueError, match="request 0"):
            fdpp.decode_attention(q, k, v, cache_seqlens=cp.asarray(np.array([-1, 3, 6], np.int32)))
        bad = table.copy()
        bad[1, 0] = 10_000
        with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 10000.*request 1"):
            fdpp.paged_decode_attention(_dev(pq), _dev(pk), _dev(pv), _dev(bad), _dev(lens))
        big = lens.copy()
        big[2] = table.shape[1] * 16 + 1
        with pytest.raises(ValueError, match="request 2"):
            fdpp.paged_decode_attention(_dev(pq), _dev(pk), _dev(pv), _dev(table), _dev(big))
        # valid device values pass the host check and compute
        out = fdpp.paged_decode_attention(_dev(pq), _dev(pk), _dev(pv), _dev(table), _dev(lens))
        assert_close(_f64(out, "fp16"), paged_attention_reference(pq, pk, pv, table, lens)[0], "fp16")
    finally:
        fdpp.set_checks(False)
    _still_healthy()


# ---- layouts, alignment, aliasing, devices --------------------------------------------------
@gpu
def test_misaligned_kv_pointers_and_strides_raise(rng):
    cp = _cp()
    q, k, v = _contig(rng, "fp16", b=2, n=64)
    dq, dk, dv = _dev(q), _dev(k), _dev(v)
    flat = cp.zeros(k.size + 8, cp.float16)
    off = flat[1:1 + k.size].reshape(k.shape)  # 2 bytes past a 16-byte boundary
    off[...] = dk
    with pytest.raises(ValueError, match="16-byte"):
        fdpp.decode_attention(dq, off, dv)
    with pytest.raises(ValueError, match="16-byte"):
        fdpp.decode_attention(dq, dk, off)
    wide = cp.zeros(k.shape[:3] + (k.shape[3] + 1,), cp.float16)  # head stride 129 elements: 258 bytes
    wide[..., :128] = dk
    with pytest.raises(ValueError, match="16-byte"):
        fdpp.decode_attention(dq, wide[..., :128], dv)
    dstride = cp.zeros(k.shape[:3] + (256,), cp.float16)[..., ::2]
    with pytest.raises(ValueError, match="head_dim"):
        fdpp.decode_attention(dq, dstride, dstride)
    with pytest.raises(ValueError, match="negative strides"):
        fdpp.decode_attention(dq, dk[:, ::-1], dv[:, ::-1])
    qs = cp.zeros((2, 8, 256), cp.float16)[..., ::2]
    with pytest.raises(ValueError, match="q must be contiguous in head_dim"):
        fdpp.decode_attention(qs, dk, dv)
    pq, pk, pv, table, lens = _paged(rng, "fp16", [40, 3], b=2)
    pflat = cp.zeros(pk.size + 8, cp.float16)
    poff = pflat[4:4 + pk.size].reshape(pk.shape)  # 8 bytes off
    with pytest.raises(ValueError, match="16-byte"):
        fdpp.paged_decode_attention(_dev(pq), poff, _dev(pv), _dev(table), _dev(lens))
    torch = pytest.importorskip("torch")
    tk = torch.empty(k.size + 8, dtype=torch.float16, device="cuda")[1:1 + k.size].view(k.shape)
    with pytest.raises(ValueError, match="16-byte"):
        fdpp.decode_attention(torch.from_dlpack(dq), tk, tk)
    _still_healthy()


@gpu
@pytest.mark.parametrize("dt", ["fp16", "fp32"])
def test_misaligned_q_and_out_work(rng, dt):
    """q and out are read and written element by element: any element-aligned pointer works."""
    cp = _cp()
    q, k, v = _contig(rng, dt, b=2, n=100)
    lens = np.array([100, 37], np.int32)
    npdt = _np(dt)
    qbuf = cp.asarray(np.concatenate([np.zeros(1, npdt), q.ravel()]))
    dq = qbuf[1:].reshape(q.shape)
    obuf = cp.zeros(q.size + 3, npdt)
    out = obuf[3:].reshape(q.shape)
    with _unchanged(dq):
        res = fdpp.decode_attention(dq, _dev(k), _dev(v), cache_seqlens=_dev(lens), out=out, num_splits=3)
        _sync()
    assert res is out
    assert_close(_f64(out, dt), attention_reference(q, k, v, lens)[0], dt)
    _still_healthy()


@gpu
@pytest.mark.parametrize("dt", DTS)
def test_strided_views_work(rng, dt):
    """Strides are honoured: every other token of a larger cache, two of four KV heads, an HND
    view of NHD storage, q heads sliced from a wider tensor, a paged pool seen through a
    combined [pages, 2, page, H, D] buffer."""
    b, hkv, d, n = 3, 2, 128, 150
    big = _hrand(rng, (b, 2 * n, 2 * hkv, d), dt)
    bigv = _hrand(rng, (b, 2 * n, 2 * hkv, d), dt)
    qbig = _hrand(rng, (b, 16, d), dt)
    lens = np.array([150, 1, 77], np.int32)
    dk, dv, dq = _dev(big)[:, ::2, 1::2], _dev(bigv)[:, ::2, 1::2], _dev(qbig)[:, 4:12]
    k, v, q = big[:, ::2, 1::2], bigv[:, ::2, 1::2], qbig[:, 4:12]
    with _unchanged(dk, dv, dq):
        out = fdpp.decode_attention(dq, dk, dv, cache_seqlens=_dev(lens), num_splits=4)
        _sync()
    assert_close(_f64(out, dt), attention_reference(q, k, v, lens)[0], dt)
    hnd = dk.transpose(0, 2, 1, 3)  # [b, hkv, n, d] view with NHD strides
    out = fdpp.decode_attention(dq, hnd, dv.transpose(0, 2, 1, 3), cache_seqlens=_dev(lens), kv_layout="HND")
    assert_close(_f64(out, dt), attention_reference(q, k, v, lens)[0], dt)
    pool = _hrand(rng, (20, 2, 16, hkv, d), dt)
    table = rng.permutation(20)[:18].reshape(3, 6).astype(np.int32)
    plens = np.array([96, 5, 50], np.int32)
    dpool = _dev(pool)
    out = fdpp.paged_decode_attention(dq, dpool[:, 0], dpool[:, 1], _dev(table), _dev(plens))
    ref = paged_attention_reference(q, np.ascontiguousarray(pool[:, 0]), np.ascontiguousarray(pool[:, 1]), table, plens)
    assert_close(_f64(out, dt), ref[0], dt)
    _still_healthy()


@gpu
def test_out_overlapping_an_input_raises(rng):
    cp = _cp()
    q, k, v = (_dev(x) for x in _contig(rng, "fp16", b=2, n=64))
    with _unchanged(q, k, v):
        with pytest.raises(ValueError, match="overlap"):
            fdpp.decode_attention(q, k, v, out=q)
        with pytest.raises(ValueError, match="overlap"):
            fdpp.decode_attention(q, k, v, out=k.reshape(-1)[:q.size].reshape(q.shape))
        buf = cp.zeros(2 * q.size, cp.float16)
        qq = buf[:q.size].reshape(q.shape)
        qq[...] = q
        with pytest.raises(ValueError, match="overlap"):
            fdpp.decode_attention(qq, k, v, out=buf[q.size // 2:q.size // 2 + q.size].reshape(q.shape))
    torch = pytest.importorskip("torch")
    tq = torch.from_dlpack(q)
    with pytest.raises(ValueError, match="overlap"):
        fdpp.decode_attention(tq, torch.from_dlpack(k), torch.from_dlpack(v), out=tq)
    _still_healthy()


@gpu
def test_wrong_devices_and_array_types(rng):
    cp = _cp()
    q, k, v = _contig(rng, "fp16", b=2, n=64)
    dq, dk, dv = _dev(q), _dev(k), _dev(v)
    with pytest.raises(TypeError, match="same array type"):
        fdpp.decode_attention(dq, k, dv)  # a NumPy K with CuPy q
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="CUDA device"):
        fdpp.decode_attention(torch.from_numpy(q.astype(np.float32)).half(), torch.from_dlpack(dk),
                              torch.from_dlpack(dv))
    with pytest.raises(TypeError, match="CUDA device"):
        fdpp.decode_attention(torch.from_dlpack(dq), torch.from_numpy(k), torch.from_dlpack(dv))
    if cp.cuda.runtime.getDeviceCount() < 2:
        _still_healthy()
        pytest.skip("one GPU: no second device for the cross-device case")
    with cp.cuda.Device(1):
        k1 = cp.asarray(k)
    with pytest.raises(ValueError, match="one device"):
        fdpp.decode_attention(dq, k1, dv)
    _still_healthy()


@gpu
@pytest.mark.parametrize("paged", [False, True])
def test_empty_cache(rng, paged):
    """N_max = 0 (a cache of no tokens, or a block table 0 pages wide): zeros and lse -inf."""
    q = _dev(_hrand(rng, (2, 8, 128), "fp16"))
    if paged:
        kp = _dev(_hrand(rng, (3, 16, 2, 128), "fp16"))
        out, lse = fdpp.paged_decode_attention(q, kp, kp, _dev(np.zeros((2, 0), np.int32)),
                                               _dev(np.zeros(2, np.int32)), return_lse=True)
    else:
        k = _dev(np.zeros((2, 0, 2, 128), np.float16))
        out, lse = fdpp.decode_attention(q, k, k, return_lse=True)
    assert (_f64(out, "fp16") == 0).all() and np.isneginf(_f64(lse, "fp32")).all()
    _still_healthy()


# ---- memory ---------------------------------------------------------------------------------
@gpu
def test_no_memory_growth_eager_and_graph(rng):
    """100k eager calls and 10k CUDA-graph replays: CuPy's pool, fdpp's compiled kernels and
    workspaces do not grow past what the warm-up made."""
    cp = _cp()
    from fdpp import dispatch, launch, registry, workspace

    q, k, v = (_dev(x) for x in _contig(rng, "fp16", b=1, hkv=2, ratio=4, n=256))
    lens = _dev(np.array([200], np.int32))
    ref = attention_reference(*(_f64(x, "fp16") for x in (q, k, v)), np.array([200]))[0]
    pool = cp.get_default_memory_pool()

    def sizes():
        return (len(registry._compiled), len(workspace._partials), len(workspace._retired), len(dispatch._plan_cache),
                len(launch._ext_streams))

    def call(**kw):
        return fdpp.decode_attention(q, k, v, cache_seqlens=lens, num_splits=4, **kw)

    for _ in range(200):  # warm-up: compile, workspace, pool blocks
        out = call()
    out = None
    cp.cuda.Device().synchronize()
    used0, total0, s0 = pool.used_bytes(), pool.total_bytes(), sizes()
    t0 = time.perf_counter()
    for i in range(100_000):
        out = call()
        if i % 10_000 == 0:
            cp.cuda.Device().synchronize()  # keep the queue bounded
    cp.cuda.Device().synchronize()
    eager_s = time.perf_counter() - t0
    assert_close(_f64(out, "fp16"), ref, "fp16")
    out = None
    assert pool.used_bytes() <= used0, (pool.used_bytes(), used0)
    assert pool.total_bytes() <= total0, (pool.total_bytes(), total0)
    assert sizes() == s0, (sizes(), s0)

    stream = cp.cuda.Stream(non_blocking=True)
    stream.wait_event(cp.cuda.get_current_stream().record())  # the work queued before (inputs) first
    gout = cp.full(q.shape, np.nan, dtype=cp.float16)
    with stream:
        call(out=gout)  # this stream's workspace exists before the capture
        stream.synchronize()
        stream.begin_capture()
        call(out=gout)
        graph = stream.end_capture()
        for _ in range(100):
            graph.launch()
        stream.synchronize()
        used1, total1, s1 = pool.used_bytes(), pool.total_bytes(), sizes()
        t0 = time.perf_counter()
        for _ in range(10_000):
            graph.launch()
        stream.synchronize()
    graph_s = time.perf_counter() - t0
    assert_close(_f64(gout, "fp16"), ref, "fp16")
    assert pool.used_bytes() <= used1 and pool.total_bytes() <= total1
    assert sizes() == s1, (sizes(), s1)
    print(f"100k eager calls: {eager_s:.1f} s ({eager_s * 10:.1f} us/call); 10k graph replays: {graph_s:.2f} s")
    assert eager_s + graph_s < 120


@gpu
def test_no_memory_growth_torch(rng):
    """10k eager calls on torch tensors: torch's allocated bytes do not grow (the partials come
    from torch's allocator and are released with each call)."""
    torch = _torch()
    q, k, v = (_dev(x, "torch") for x in _contig(rng, "bf16", b=2, n=256))
    lens = _dev(np.array([256, 9], np.int32), "torch")
    for _ in range(100):
        out = fdpp.decode_attention(q, k, v, cache_seqlens=lens, num_splits=4)
    out = None
    torch.cuda.synchronize()
    a0 = torch.cuda.memory_allocated()
    for _ in range(10_000):
        out = fdpp.decode_attention(q, k, v, cache_seqlens=lens, num_splits=4)
    torch.cuda.synchronize()
    del out
    assert torch.cuda.memory_allocated() <= a0


# ---- the sanitizer workload's structure (CPU) -----------------------------------------------
def _workload():
    spec = importlib.util.spec_from_file_location("sanitize_workload", ROOT / "scripts" / "sanitize_workload.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sanitize_workload", mod)
    spec.loader.exec_module(mod)
    return mod


def test_sanitize_workload_imports_without_a_gpu_and_lists_every_family(capsys):
    before = set(sys.modules)
    sw = _workload()
    assert not {"cupy", "torch"} & (set(sys.modules) - before), "the workload imports a GPU library at import"
    want = {"decode_split", "decode_split_mma", "decode_combine", "fused", "cluster", "decode_nosplit", "paged", "cache",
            "flat_gemm"}
    assert want <= set(sw.FAMILIES)
    assert all(callable(f) and f.__doc__ for f in sw.FAMILIES.values())
    assert sw.select_families("all") == list(sw.FAMILIES)
    assert sw.select_families("paged, cache") == ["paged", "cache"]
    with pytest.raises(SystemExit):
        sw.select_families("paged,nonsense")
    args = sw.build_parser().parse_args(["--families", "paged", "--device", "1"])
    assert args.families == "paged" and args.device == 1
    with pytest.raises(SystemExit) as e:  # a missing log was a FileNotFoundError traceback
        sw.main(["--summarize", "/proc/fdpp-no-such.log"])
    assert e.value.code == 2 and "cannot read" in capsys.readouterr().err
    assert sw.main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in listed] == list(sw.FAMILIES)
    # every family kernel the README names is one the log parser calls fdpp's
    for name in ("decode_split", "decode_split_mma", "decode_split_mma_cluster", "decode_combine", "decode_nosplit", "paged_append",
                 "paged_table_update", "flat_gemm", "flat_tma", "gemv", "stream_read"):
        assert sw.is_fdpp_kernel(f"void fdpp::{name}<float, 4>(fdpp::Params)")
    assert not sw.is_fdpp_kernel("void cupy_copy__float16_float16(CIndexer<1>, ...)")
    assert not sw.is_fdpp_kernel("ampere_fp16_s16816gemm_fp16_64x64_ldg8_f2f_stages_64x5_nn")


NEW_LOG = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at void fdpp::decode_split_mma<fdpp::half_t, fdpp::half_t, fdpp::PagedCache<16>, 128, 4, 4, 3, 1>(fdpp::DecodeParams)+0x1d40 in /w/kernels_cu/decode_split.cu:331
=========     by thread (5,0,0) in block (0,2,1)
=========     Address 0x7f0000001000 is out of bounds
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: cuLaunchKernel [0x2cf6a0] in libcuda.so.1
=========
========= Uninitialized __global__ memory read of size 4 bytes
=========     at cupy_copy__float32_float32+0x90
=========     by thread (0,0,0) in block (0,0,0)
=========
========= Program hit cudaErrorPeerAccessUnsupported (error 217) due to "peer access is not supported between these two devices" on CUDA API call to cudaDeviceCanAccessPeer.
=========     Saved host backtrace up to driver entry point at error
=========
========= ERROR SUMMARY: 3 errors
"""
OLD_LOG = """\
========= CUDA-MEMCHECK
========= Error: Race reported between Write access at 0x00000a40 in /w/kernels_cu/flat_gemm.cu:210:void fdpp::flat_tma<fdpp::half_t, 4, 8, 1, 2, 0, 1>(Args)
=========     and Read access at 0x00000b00 in /w/kernels_cu/flat_gemm.cu:215:void fdpp::flat_tma<fdpp::half_t, 4, 8, 1, 2, 0, 1>(Args) [512 hazards]
=========
========= Warning: Race reported between Read access at 0x00000100 in paged_append.cu:40:void fdpp::paged_append<float, 64, 16, false>(fdpp::PagedAppendParams)
=========     and Write access at 0x00000120 in paged_append.cu:44:void fdpp::paged_append<float, 64, 16, false>(fdpp::PagedAppendParams) [2 hazards]
=========
========= Error: Race reported between Write access at 0x00000010 in sm80_xmma_gemm_f16f16_f16f32(params)
=========     and Read access at 0x00000020 in sm80_xmma_gemm_f16f16_f16f32(params) [8 hazards]
=========
========= RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warnings)
"""


def test_sanitizer_log_parser():
    sw = _workload()
    s = sw.summarize(NEW_LOG)
    assert s["summary"] == ["ERROR SUMMARY: 3 errors"]
    assert s["fdpp_errors"] == 1 and len(s["fdpp_error_kernels"]) == 1
    assert s["fdpp_error_kernels"][0].startswith("void fdpp::decode_split_mma<")
    assert s["other_kernels"] == ["cupy_copy__float32_float32 (1x)"]
    assert len(s["api_errors"]) == 1 and "cudaErrorPeerAccessUnsupported" in s["api_errors"][0]
    assert "decode_split.cu:331" in s["first_fdpp_error"]
    s = sw.summarize(OLD_LOG)
    assert s["summary"] == ["RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warnings)"]
    assert s["fdpp_errors"] == 1 and "fdpp::flat_tma" in s["fdpp_error_kernels"][0]
    assert len(s["fdpp_warning_kernels"]) == 1 and "paged_append" in s["fdpp_warning_kernels"][0]
    assert len(s["other_kernels"]) == 1 and "xmma" in s["other_kernels"][0]
    clean = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"
    s = sw.summarize(clean)
    assert s["fdpp_errors"] == 0 and s["records"] == 0 and s["summary"] == ["ERROR SUMMARY: 0 errors"]


def test_sanitize_script_is_valid_bash():
    script = ROOT / "scripts" / "sanitize.sh"
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    text = script.read_text()
    for tool in ("memcheck", "racecheck", "initcheck", "synccheck"):
        assert tool in text
    assert "sanitize_report.txt" in text and "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in text


STAND_IN = r'''
import sys, types, warnings
import numpy as np
sys.path.insert(0, {scripts!r})


class Dev:
    def __init__(self, i=0):
        self.id = i

    def synchronize(self):
        pass

    def use(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        pass


def no_device():
    raise RuntimeError("a stand-in CuPy: no device")


cp = types.ModuleType("cupy")  # NumPy behind CuPy's names: fdpp takes its NumPy path (the emulator)
cp.asarray, cp.asnumpy, cp.ascontiguousarray = np.asarray, np.asarray, np.ascontiguousarray
cp.zeros, cp.full, cp.uint8, cp.float16, cp.ndarray = np.zeros, np.full, np.uint8, np.float16, np.ndarray
cp.cuda = types.SimpleNamespace(Device=Dev, set_allocator=lambda a: None, set_pinned_memory_allocator=lambda a: None,
                                runtime=types.SimpleNamespace(getDeviceCount=no_device))
sys.modules["cupy"] = cp
from fdpp import cache, registry
from fdpp.configs import SM90

registry.device_limits = lambda device_id=0: SM90
init = cache.PagedKVCache.__init__


def numpy_backend(self, *a, **kw):  # the stand-in cannot launch paged_append: the NumPy scatter
    kw.update(backend="numpy", device=None)
    init(self, *a, **kw)


cache.PagedKVCache.__init__ = numpy_backend
import sanitize_workload as sw

warnings.simplefilter("ignore")
ctx = sw._setup(0)
for name in {families!r}:
    sw.FAMILIES[name](ctx)
print("checks", ctx.checks)
'''


def test_sanitize_workload_families_run_on_a_stand_in_cupy(tmp_path):
    """The families' Python (shapes, references, expectations) on the NumPy emulator behind a
    stand-in CuPy module, in a subprocess: catches a broken workload before a GPU run. Families
    that need device semantics (NaN for bad device values, the nosplit baseline, stream_read,
    torch) are left to the GPU."""
    families = ["decode_split", "decode_split_mma", "decode_combine", "flat_gemm", "cache", "quantized"]
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN.format(scripts=str(ROOT / "scripts"), families=families))
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) >= 50
