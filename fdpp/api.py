"""Public entry points: argument validation, array normalisation, output allocation, launch."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any, NamedTuple

import numpy as np

from fdpp.configs import HEAD_DIMS, MAX_SPLITS, DecodeProblem, LaunchPlan, combine_config, nosplit_config
from fdpp.dtypes import get_dtype

log = logging.getLogger("fdpp")

LOG2E = 1.4426950408889634
MAX_GRID_YZ = 65535


# ---- arrays ---------------------------------------------------------------------------------
def _kind(x: Any) -> str:
    mod = type(x).__module__.split(".")[0]
    if mod == "numpy" and isinstance(x, np.ndarray):
        return "numpy"
    if mod == "cupy":
        return "cupy"
    if mod == "torch":
        return "torch"
    return "other"


class _View(NamedTuple):  # a tuple: built 3-5 times per call, cheaper than a frozen dataclass
    """What the launcher needs of an array: shape, element strides, dtype, pointer, device."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: Any  # numpy/cupy dtype or torch dtype
    ptr: int
    device: int  # -1 for host
    itemsize: int

    @property
    def nbytes_span(self) -> int:
        """Bytes from ptr to one past the last element (for overlap checks); 0 when empty."""
        if not all(self.shape):
            return 0
        return self.itemsize * (1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True)))


def _view(x: Any, kind: str) -> _View:
    if kind == "torch":
        if not x.is_cuda:
            raise TypeError("torch tensors must be on a CUDA device (got a CPU tensor); "
                            "pass NumPy arrays for host data")
        return _View(tuple(x.shape), tuple(x.stride()), x.dtype, x.data_ptr(), x.device.index, x.element_size())
    isz = x.itemsize
    strides = tuple(s // isz for s in x.strides)
    if kind == "cupy":
        return _View(x.shape, strides, x.dtype, x.data.ptr, x.device.id, isz)
    return _View(x.shape, strides, x.dtype, x.ctypes.data, -1, isz)


def _overlaps(a: _View, b: _View) -> bool:
    sa, sb = a.nbytes_span, b.nbytes_span
    return sa > 0 and sb > 0 and a.ptr < b.ptr + sb and b.ptr < a.ptr + sa


def gather_views(first_name: str, first: Any, others: dict[str, Any]) -> tuple[str, dict[str, _View]]:
    """Check that ``first`` and every non-None array in ``others`` share one array type and device;
    return that type ("numpy" | "cupy" | "torch") and a _View of each (None entries skipped)."""
    kind = _kind(first)
    if kind == "other":
        raise TypeError(f"{first_name} must be a NumPy array, CuPy array or torch tensor, got "
                        f"{type(first).__name__}")
    named = {n: x for n, x in others.items() if x is not None}
    for name, x in named.items():
        if _kind(x) != kind:
            raise TypeError(f"{name} must be the same array type as {first_name} ({kind}), got "
                            f"{type(x).__module__}.{type(x).__name__}")
    views = {first_name: _view(first, kind), **{n: _view(x, kind) for n, x in named.items()}}
    devs = {n: v.device for n, v in views.items()}
    if len(set(devs.values())) > 1:
        raise ValueError(f"all arrays must be on one device, got {devs}")
    return kind, views


@cache
def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no cupy, no driver, no device: all mean "no GPU"
        return False


@cache
def _warn_emulator() -> None:
    warnings.warn("fdpp: no GPU found (CuPy sees no CUDA device); decode_attention runs the NumPy "
                  "split-KV emulator on the CPU", RuntimeWarning, stacklevel=3)


# ---- validation -----------------------------------------------------------------------------
def _check_args(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, softmax_scale: Any,
                kv_layout: Any, num_splits: Any, out: Any) -> tuple[str, DecodeProblem, dict[str, _View]]:
    kind, views = gather_views("q", q, {"k_cache": k_cache, "v_cache": v_cache,
                                        "cache_seqlens": cache_seqlens, "out": out})

    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    qv, kv, vv = views["q"], views["k_cache"], views["v_cache"]
    if len(qv.shape) != 3:
        raise ValueError(f"q must have shape [batch, num_q_heads, head_dim], got {qv.shape}")
    b, hq, d = qv.shape
    for name, v in (("k_cache", kv), ("v_cache", vv)):
        if len(v.shape) != 4:
            want = "[batch, seqlen, kv_heads, head_dim]" if kv_layout == "NHD" else "[batch, kv_heads, seqlen, head_dim]"
            raise ValueError(f"{name} must have shape {want} for kv_layout={kv_layout!r}, got {v.shape}")
    if kv.shape != vv.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {kv.shape} and {vv.shape}")
    if kv_layout == "NHD":
        kb, n_max, hkv, kd = kv.shape
    else:
        kb, hkv, n_max, kd = kv.shape
    if kb != b:
        raise ValueError(f"k_cache batch {kb} != q batch {b}")
    if kd != d:
        raise ValueError(f"k_cache head_dim {kd} != q head_dim {d}")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {d}")
    if hkv < 1 or hq < 1 or hq % hkv:
        raise ValueError(f"num_q_heads ({hq}) must be a positive multiple of num_kv_heads ({hkv})")
    if b < 1:
        raise ValueError(f"batch must be >= 1, got {b}")
    if b > MAX_GRID_YZ:
        raise ValueError(f"batch must be <= {MAX_GRID_YZ}, got {b}")

    dt_q = get_dtype(qv.dtype)
    for name in ("k_cache", "v_cache"):
        if get_dtype(views[name].dtype) != dt_q:
            raise TypeError(f"{name} dtype {views[name].dtype} must match q dtype {qv.dtype}")

    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, np.floating, np.integer)):
            raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        if not math.isfinite(float(softmax_scale)):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
            raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")

    if cache_seqlens is not None:
        sv = views["cache_seqlens"]
        if sv.shape != (b,):
            raise ValueError(f"cache_seqlens must have shape [batch] = ({b},), got {sv.shape}")
        sdt = np.dtype(str(sv.dtype).removeprefix("torch."))
        if kind == "numpy":
            if sdt.kind not in "iu":
                raise TypeError(f"cache_seqlens must be an integer array, got {sdt}")
            lens = np.asarray(cache_seqlens)
            if lens.min(initial=0) < 0 or lens.max(initial=0) > n_max:
                raise ValueError(f"cache_seqlens values must be in [0, {n_max}] (N_max), got "
                                 f"min {lens.min()} max {lens.max()}")
        elif sdt != np.int32:
            raise TypeError(f"cache_seqlens must be int32 on the device, got {sdt}")
        elif sv.strides != (1,) and b > 1:
            raise ValueError("cache_seqlens must be contiguous")

    if out is not None:
        ov = views["out"]
        if ov.shape != (b, hq, d):
            raise ValueError(f"out must have shape {(b, hq, d)}, got {ov.shape}")
        if get_dtype(ov.dtype) != dt_q:
            raise TypeError(f"out dtype {ov.dtype} must match q dtype {qv.dtype}")
        if ov.strides != (hq * d, d, 1):
            raise ValueError(f"out must be C-contiguous, got element strides {ov.strides}")
        for name in ("q", "k_cache", "v_cache"):
            if _overlaps(ov, views[name]):
                raise ValueError(f"out must not overlap {name}")

    if kind != "numpy":
        if qv.strides[2] != 1:
            raise ValueError(f"q must be contiguous in head_dim (last stride 1), got strides {qv.strides}")
        isz = dt_q.itemsize
        for name in ("k_cache", "v_cache"):
            v = views[name]
            if v.strides[3] != 1:
                raise ValueError(f"{name} must be contiguous in head_dim (last stride 1), got strides {v.strides}")
            if any(s < 0 for s in v.strides):
                raise ValueError(f"{name} has negative strides {v.strides}")
            if v.ptr % 16 or any((s * isz) % 16 for s in v.strides[:3]):
                raise ValueError(f"{name} must be 16-byte aligned with strides that are multiples of 16 "
                                 f"bytes (got pointer {v.ptr:#x}, element strides {v.strides}); "
                                 "copy it to a contiguous array")
    prob = DecodeProblem(b, hq, hkv, d, n_max, dt_q.name)
    return kind, prob, views


# ---- public API -----------------------------------------------------------------------------
def decode_attention(q: Any, k_cache: Any, v_cache: Any, *, cache_seqlens: Any = None,
                     softmax_scale: float | None = None, kv_layout: str = "NHD",
                     num_splits: int | None = None, return_lse: bool = False,
                     out: Any = None) -> Any:
    """Exact single-query ("decode") attention over a KV cache, split along the sequence.

    The cache is cut into ``num_splits`` chunks; one CTA per (request, KV head, chunk) computes a
    partial softmax for every query head sharing that KV head (GQA packing: KV is read once), and
    a second kernel rescales the partials by exp(m_i - m_max) and merges them.

    Parameters
    ----------
    q : array [B, Hq, D]
        The new token's queries. fp16, bf16 or fp32. NumPy, CuPy or torch (CUDA).
    k_cache, v_cache : array [B, N_max, Hkv, D] for ``kv_layout="NHD"`` (flash-attn/FlashInfer
        convention) or [B, Hkv, N_max, D] for ``"HND"``
        Same dtype and array type as ``q``. Hq must be a multiple of Hkv (MHA, GQA, MQA).
        D in {64, 96, 128, 256}. Device arrays need a unit stride in D and 16-byte aligned
        pointers and strides (any other strides are read as given).
    cache_seqlens : int32 array [B] or None
        Valid length of each request (0 <= len <= N_max); ``None`` means N_max for all. A request of
        length 0 yields zeros and lse = -inf. NumPy lengths are checked on the host; device lengths
        are clamped to [0, N_max] in the kernel (no host sync), so the cache is never read out of
        bounds.
    softmax_scale : float, optional
        Defaults to 1/sqrt(D).
    kv_layout : {"NHD", "HND"}
    num_splits : int, optional
        Number of KV chunks per request (1..1024). ``None``: the tuned table for this GPU and
        problem, else a heuristic (4x SM count CTAs, chunks >= 64 tokens, no split when
        batch x heads fills the GPU). 1: one pass, no combine launch. The chunk is
        ceil(N_max / num_splits) tokens, so fewer splits than asked run when N_max is small.
    return_lse : bool
        Also return the log-sum-exp of the scores (natural log) so partial results can be merged.
    out : array [B, Hq, D], optional
        C-contiguous, q's dtype and array type; written in place and returned.

    Returns
    -------
    out : array [B, Hq, D], q's dtype and array type
    lse : float32 array [B, Hq] (only with ``return_lse=True``)

    Notes
    -----
    NumPy in, NumPy out: computed on the GPU when CuPy sees one, else by the NumPy emulator
    (``fdpp.reference.split_kv_emulator``) with a one-time RuntimeWarning. CuPy arrays run on the
    current CuPy stream; torch tensors run zero-copy on torch's current stream. Device calls do
    no host synchronisation and no device-to-host copy, so they can be captured in CUDA graphs
    (CuPy's or torch's); for CuPy, make one call before capturing so the compiled kernel and the
    workspace exist.
    """
    return _attention(q, k_cache, v_cache, cache_seqlens, softmax_scale, kv_layout, num_splits,
                      return_lse, out, nosplit=False)


def decode_attention_nosplit(q: Any, k_cache: Any, v_cache: Any, *, cache_seqlens: Any = None,
                             softmax_scale: float | None = None, kv_layout: str = "NHD",
                             return_lse: bool = False, out: Any = None) -> Any:
    """Baseline: the same attention with grid B x Hq and no sequence split (FlashAttention-2-style
    decode). One CTA per query head reads its KV head's whole cache, so at small batch most SMs
    idle. Same arguments and results as :func:`decode_attention` (GPU only)."""
    return _attention(q, k_cache, v_cache, cache_seqlens, softmax_scale, kv_layout, None,
                      return_lse, out, nosplit=True)


def _attention(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, softmax_scale: Any,
               kv_layout: str, num_splits: Any, return_lse: bool, out: Any, nosplit: bool) -> Any:
    kind, prob, views = _check_args(q, k_cache, v_cache, cache_seqlens, softmax_scale, kv_layout,
                                    num_splits, out)
    scale = 1.0 / math.sqrt(prob.head_dim) if softmax_scale is None else float(softmax_scale)
    if kind == "numpy":
        return _numpy_call(q, k_cache, v_cache, cache_seqlens, scale, kv_layout, num_splits,
                           return_lse, out, prob, nosplit)
    from fdpp import dispatch, registry

    dev = views["q"].device
    limits = registry.device_limits(dev)
    if nosplit:
        plan = LaunchPlan(nosplit_config(prob.dtype, prob.head_dim), 1, None, source="baseline")
    else:
        plan = dispatch.select_plan(prob, limits, num_splits)
    return _device_call(kind, q, views, out, return_lse, prob, plan, scale, kv_layout, dev)


def _numpy_call(q: np.ndarray, k: np.ndarray, v: np.ndarray, lens: Any, scale: float, kv_layout: str,
                num_splits: Any, return_lse: bool, out: Any, prob: DecodeProblem, nosplit: bool) -> Any:
    if lens is not None:
        lens = np.ascontiguousarray(lens, dtype=np.int32)
    if gpu_available():
        import cupy

        res = _attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v),
                         None if lens is None else cupy.asarray(lens), scale, kv_layout, num_splits,
                         return_lse, None, nosplit)
        o, lse = (res if return_lse else (res, None))
        o = cupy.asnumpy(o)
        lse = None if lse is None else cupy.asnumpy(lse)
    else:
        if nosplit:
            raise RuntimeError("decode_attention_nosplit needs a GPU (it is a GPU baseline)")
        _warn_emulator()
        from fdpp.configs import SM90, default_config
        from fdpp.reference import split_kv_emulator

        splits = num_splits if num_splits is not None else default_config(prob, SM90).num_splits
        chunk = max(1, math.ceil(prob.seqlen / max(1, int(splits))))
        o32, lse32 = split_kv_emulator(q, k, v, lens, scale, kv_layout, chunk=chunk)
        o = o32.astype(q.dtype)
        lse = lse32.astype(np.float32)
    if out is not None:
        out[...] = o
        o = out
    return (o, lse) if return_lse else o


# ---- device launch --------------------------------------------------------------------------
_workspaces: dict[tuple[int, int], Any] = {}
_retired: list[Any] = []  # outgrown CuPy workspaces stay alive: a captured graph may point at them
_ext_streams: dict[tuple[int, int], Any] = {}


@contextmanager
def scoped_workspaces() -> Iterator[None]:
    """Free the CuPy workspaces created inside the block when it exits.

    For tools (tuner, benchmarks) that capture graphs on throwaway streams and drop the graphs
    before the block ends; otherwise every new stream would keep its workspace alive."""
    before, n_retired = set(_workspaces), len(_retired)
    try:
        yield
    finally:
        for key in set(_workspaces) - before:
            del _workspaces[key]
        del _retired[n_retired:]


def _cupy_workspace(dev: int, stream_ptr: int, n_floats: int) -> Any:
    import cupy

    key = (dev, stream_ptr)
    ws = _workspaces.get(key)
    if ws is None or ws.size < n_floats:
        if ws is not None:
            _retired.append(ws)
        ws = cupy.empty(max(n_floats, 1 << 16), dtype=np.float32)
        _workspaces[key] = ws
    return ws


def _device_call(kind: str, q: Any, views: dict[str, _View], out: Any, return_lse: bool,
                 prob: DecodeProblem, plan: LaunchPlan, scale: float, kv_layout: str, dev: int) -> Any:
    import cupy

    from fdpp import registry

    b, hq, d = prob.batch, prob.num_q_heads, prob.head_dim
    cfg = plan.split
    n = prob.seqlen
    chunk = plan.chunk(n)
    splits = plan.effective_splits(n)
    part_floats = b * hq * splits * (d + 1) if splits > 1 else 0

    if kind == "torch":
        import torch

        tdev = q.device
        if out is None:
            out = torch.empty((b, hq, d), dtype=q.dtype, device=tdev)
        lse = torch.empty((b, hq), dtype=torch.float32, device=tdev) if return_lse else None
        part = torch.empty(part_floats, dtype=torch.float32, device=tdev) if part_floats else None
        sptr = torch.cuda.current_stream(tdev).cuda_stream
        skey = (dev, sptr)
        stream = _ext_streams.get(skey)
        if stream is None:
            stream = _ext_streams[skey] = cupy.cuda.ExternalStream(sptr, dev)
        out_ptr = out.data_ptr()
        lse_ptr = lse.data_ptr() if lse is not None else 0
        part_ptr = part.data_ptr() if part is not None else 0
    else:
        with cupy.cuda.Device(dev):
            if out is None:
                out = cupy.empty((b, hq, d), dtype=q.dtype)
            lse = cupy.empty((b, hq), dtype=np.float32) if return_lse else None
            stream = cupy.cuda.get_current_stream()
            part_ptr = _cupy_workspace(dev, stream.ptr, part_floats).data.ptr if part_floats else 0
        out_ptr = out.data.ptr
        lse_ptr = lse.data.ptr if lse is not None else 0

    qv, kv, vv = views["q"], views["k_cache"], views["v_cache"]
    if kv_layout == "NHD":
        k_sb, k_sn, k_sh = kv.strides[0], kv.strides[1], kv.strides[2]
        v_sb, v_sn, v_sh = vv.strides[0], vv.strides[1], vv.strides[2]
    else:
        k_sb, k_sh, k_sn = kv.strides[0], kv.strides[1], kv.strides[2]
        v_sb, v_sh, v_sn = vv.strides[0], vv.strides[1], vv.strides[2]
    seq_ptr = views["cache_seqlens"].ptr if "cache_seqlens" in views else 0
    o_part = part_ptr
    lse_part = part_ptr + 4 * b * hq * splits * d if part_ptr else 0

    u64, i64, i32 = np.uint64, np.int64, np.int32
    args = (u64(qv.ptr), u64(kv.ptr), u64(vv.ptr), u64(seq_ptr), u64(out_ptr), u64(lse_ptr),
            u64(o_part), u64(lse_part), i64(qv.strides[0]), i64(qv.strides[1]),
            i64(k_sb), i64(k_sn), i64(k_sh), i64(v_sb), i64(v_sn), i64(v_sh),
            i32(n), i32(hq), i32(prob.ratio), i32(chunk), i32(splits), np.float32(scale * LOG2E))
    if cfg.kernel == "decode_nosplit":
        grid = (1, hq, b)
    else:
        grid = (splits, hq // cfg.group_size, b)
    kern = registry.get_kernel(cfg, dev)
    with cupy.cuda.Device(dev), stream:
        kern(grid, (cfg.threads, 1, 1), args, shared_mem=cfg.smem_bytes())
        if splits > 1:
            comb = plan.combine or combine_config(prob.dtype, d)
            ck = registry.get_kernel(comb, dev)
            ck((b * hq, 1, 1), (comb.num_warps * 32, 1, 1),
               (u64(o_part), u64(lse_part), u64(out_ptr), u64(lse_ptr), i32(splits)))
    return (out, lse) if return_lse else out
