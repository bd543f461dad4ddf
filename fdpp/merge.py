"""Merging partial attention states: cascade / shared-prefix attention and context-parallel merges.

A partial state of one (request, head) row is the attention output over a subset of the keys
(normalised by its own softmax sum) and the natural-log log-sum-exp of its scaled scores, as
``fdpp.decode_attention(..., return_lse=True)`` returns them. Attention over the union of
disjoint key sets is then exact to rounding::

    lse = log sum_s exp(lse_s)          out = sum_s exp(lse_s - lse) * out_s

- :func:`merge_states` — S parts, stacked ``[S, B, H, D]`` / ``[S, B, H]`` or sequences of
  ``[B, H, D]`` / ``[B, H]`` arrays, into a new (or given) ``out`` / ``lse``.
- :func:`merge_state_` — two parts, in place into the first.

NumPy inputs are merged by NumPy in float64 (the emulator; no GPU is used); CuPy arrays and torch
CUDA tensors by one launch of ``kernels_cu/merge_states.cu`` on the array type's current stream,
with no host synchronisation and no allocation besides the outputs (CUDA-graph capturable).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from fdpp.api import _check_writable, _kind, _overlaps, _View, _view, get_dtype
from fdpp.dtypes import DTYPES

SOURCE = "merge_states.cu"
MAX_LIST = 16  # parts given as a sequence on the device (MERGE_MAX_LIST in the kernel)
MAX_HEAD_DIM = 1024
MAX_ROWS = 2**31 - 2**16  # B * H: the kernel's row index is an int
THREADS_TARGET = 128  # threads per CTA the default rows-per-CTA aims at

#: Python mirror of ``fdpp::MergeParams`` (kernels_cu/merge_states.cu); strides in elements.
MERGE_PARAMS = np.dtype([
    ("out_part", np.uint64, (MAX_LIST,)), ("lse_part", np.uint64, (MAX_LIST,)),
    ("o_sb", np.int64, (MAX_LIST,)), ("o_sh", np.int64, (MAX_LIST,)),
    ("l_sb", np.int64, (MAX_LIST,)), ("l_sh", np.int64, (MAX_LIST,)),
    ("o_ss", np.int64), ("l_ss", np.int64), ("out", np.uint64), ("lse", np.uint64),
    ("out_sb", np.int64), ("out_sh", np.int64), ("lse_sb", np.int64), ("lse_sh", np.int64),
    ("num_parts", np.int32), ("num_heads", np.int32), ("rows", np.int32), ("stacked", np.int32),
], align=True)


def merge_params_static_asserts() -> str:
    """C++ that fails to compile unless ``fdpp::MergeParams``' layout equals :data:`MERGE_PARAMS`."""
    lines = [f'static_assert(sizeof(fdpp::MergeParams) == {MERGE_PARAMS.itemsize}, "MergeParams size");']
    lines += [f'static_assert(__builtin_offsetof(fdpp::MergeParams, {n}) == {MERGE_PARAMS.fields[n][1]}, '
              f'"MergeParams.{n}");' for n in MERGE_PARAMS.names]
    return "\n".join(lines)


# ---- kernel config ----------------------------------------------------------------------------
@dataclass(frozen=True)
class MergeConfig:
    """Compile-time parameters of ``fdpp::merge_states`` (the registry's KernelConfig protocol)."""

    dtype: str
    head_dim: int
    rows_per_cta: int

    @property
    def source(self) -> str:
        return SOURCE

    @property
    def vec(self) -> int:
        """Elements per 16-byte vector (TypeTraits<DType>::VEC)."""
        return 16 // DTYPES[self.dtype].itemsize

    @property
    def threads(self) -> int:
        return self.rows_per_cta * self.head_dim // self.vec

    @property
    def key(self) -> str:
        return f"merge_states.{DTYPES[self.dtype].tag}.d{self.head_dim}.r{self.rows_per_cta}"

    def name_expression(self) -> str:
        return f"fdpp::merge_states<{DTYPES[self.dtype].ctype},{self.head_dim},{self.rows_per_cta}>"

    def smem_bytes(self) -> int:
        return 0

    def grid(self, rows: int) -> tuple[int, int, int]:
        return (-(-rows // self.rows_per_cta), 1, 1)

    def check(self) -> str | None:
        if self.dtype not in DTYPES:
            return f"dtype {self.dtype!r} not one of {sorted(DTYPES)}"
        if self.head_dim < 1 or self.head_dim % self.vec:
            return f"head_dim {self.head_dim} not a positive multiple of {self.vec} ({self.dtype}: 16-byte vectors)"
        if not 1 <= self.threads <= 1024:
            return f"{self.threads} threads per CTA not in 1..1024"
        return None

    def is_valid(self) -> bool:
        return self.check() is None


@cache
def merge_config(dtype: str, head_dim: int) -> MergeConfig:
    """The variant a call uses: about THREADS_TARGET threads per CTA, whole rows per CTA."""
    tpr = head_dim // (16 // DTYPES[dtype].itemsize)
    return MergeConfig(dtype, head_dim, max(1, THREADS_TARGET // tpr))


def merge_variants(head_dims: Sequence[int] = (64, 128, 256)) -> list[MergeConfig]:
    """The default variant of every dtype at ``head_dims`` (what the CI compile check covers)."""
    return [merge_config(dt, d) for dt in DTYPES for d in head_dims]


# ---- validation -------------------------------------------------------------------------------
class _Parts:
    """One input (outs or lses) normalised: the arrays, their views and whether it was stacked."""

    def __init__(self, name: str, x: Any, ndim_part: int):
        self.name = name
        if isinstance(x, (list, tuple)):
            self.stacked = False
            self.arrays = list(x)
            self.names = [f"{name}[{i}]" for i in range(len(x))]
        elif _kind(x) != "other":
            self.stacked = True
            self.arrays = [x]
            self.names = [name]
        else:
            raise TypeError(f"{name} must be an array [S, ...] or a list/tuple of arrays (NumPy, CuPy or "
                            f"torch), got {type(x).__name__}")
        self.ndim_part = ndim_part
        self.views: list[_View] = []

    @property
    def count(self) -> int:
        return self.views[0].shape[0] if self.stacked else len(self.arrays)

    def part_shape(self) -> tuple[int, ...]:
        return self.views[0].shape[1:] if self.stacked else self.views[0].shape


def _check_kind(kind: str, name: str, x: Any) -> None:
    k = _kind(x)
    if k == "other":
        raise TypeError(f"{name} must be a NumPy array, CuPy array or torch tensor, got {type(x).__name__}")
    if k != kind:
        raise TypeError(f"{name} must be the same array type as the other inputs ({kind}), got "
                        f"{type(x).__module__}.{type(x).__name__}")


def _gather(parts: list[_Parts], extra: dict[str, Any]) -> tuple[str, dict[str, _View]]:
    """Check array types and devices of every input and output; fill each _Parts' views."""
    first = parts[0]
    if not first.arrays:
        raise ValueError(f"{first.name} must hold at least one part (S >= 1), got an empty sequence")
    kind = _kind(first.arrays[0])
    _check_kind(kind if kind != "other" else "numpy", first.names[0], first.arrays[0])
    views: dict[str, _View] = {}
    named = [(p, n, x) for p in parts for n, x in zip(p.names, p.arrays, strict=True)]
    named += [(None, n, x) for n, x in extra.items() if x is not None]
    for p, n, x in named:
        _check_kind(kind, n, x)
        try:
            v = _view(x, kind)
        except TypeError as e:
            raise TypeError(f"{n}: {e}") from None
        views[n] = v
        if p is not None:
            p.views.append(v)
    devs = {n: v.device for n, v in views.items()}
    if len(set(devs.values())) > 1:
        raise ValueError(f"all arrays must be on one device, got {devs}")
    return kind, views


def _check_parts(outs: _Parts, lses: _Parts) -> tuple[int, int, int, int, Any]:
    """Shapes and dtypes of the inputs: (S, B, H, D, dtype entry)."""
    want_o = "[S, B, H, D]" if outs.stacked else "[B, H, D] each"
    for n, v in zip(outs.names, outs.views, strict=True):
        if len(v.shape) != (4 if outs.stacked else 3):
            raise ValueError(f"{n} must have shape {want_o}, got {v.shape}")
    want_l = "[S, B, H]" if lses.stacked else "[B, H] each"
    for n, v in zip(lses.names, lses.views, strict=True):
        if len(v.shape) != (3 if lses.stacked else 2):
            raise ValueError(f"{n} must have shape {want_l}, got {v.shape}")
    s = outs.count
    if s < 1:
        raise ValueError(f"outs must hold at least one part (S >= 1), got S = {s}")
    if lses.count != s:
        raise ValueError(f"lses must hold one lse per part of outs: outs has S = {s}, lses has {lses.count}")
    b, h, d = outs.part_shape()
    for n, v in zip(outs.names, outs.views, strict=True):
        if (v.shape[1:] if outs.stacked else v.shape) != (b, h, d):
            raise ValueError(f"{n} must have the shape of {outs.names[0]} ({(b, h, d)} per part), got {v.shape}")
    for n, v in zip(lses.names, lses.views, strict=True):
        if (v.shape[1:] if lses.stacked else v.shape) != (b, h):
            raise ValueError(f"{n} must have shape {(b, h)} per part (outs' [B, H]), got {v.shape}")
    try:
        dt = get_dtype(outs.views[0].dtype)
    except TypeError as e:
        raise TypeError(f"{outs.names[0]}: {e}") from None
    for n, v in zip(outs.names, outs.views, strict=True):
        if _np_name(v) != _np_name(outs.views[0]):
            raise TypeError(f"{n} dtype {v.dtype} must match {outs.names[0]} dtype {outs.views[0].dtype}")
    for n, v in zip(lses.names, lses.views, strict=True):
        if _np_name(v) != "float32":
            raise TypeError(f"{n} must be float32 (natural-log lse), got {v.dtype}")
    if d % 8 or not 8 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim (last axis of outs) must be a multiple of 8 in 8..{MAX_HEAD_DIM}, got {d}")
    return s, b, h, d, dt


def _np_name(v: _View) -> str:
    return str(v.dtype).removeprefix("torch.")


def _check_outputs(kind: str, views: dict[str, _View], out: Any, lse: Any, out_name: str, lse_name: str,
                   b: int, h: int, d: int, dt: Any, inputs: list[str]) -> None:
    ov, lv = views.get(out_name), views.get(lse_name)
    if ov is not None:
        if ov.shape != (b, h, d):
            raise ValueError(f"{out_name} must have shape {(b, h, d)}, got {ov.shape}")
        if _dtype_or_none(ov) != dt:
            raise TypeError(f"{out_name} dtype {ov.dtype} must match the inputs' dtype ({dt.name})")
    if lv is not None:
        if lv.shape != (b, h):
            raise ValueError(f"{lse_name} must have shape {(b, h)}, got {lv.shape}")
        if _np_name(lv) != "float32":
            raise TypeError(f"{lse_name} must be float32, got {lv.dtype}")
    for name, x in ((out_name, out), (lse_name, lse)):
        _check_writable(kind, x, name)
    if ov is not None and lv is not None and _overlaps(ov, lv):
        raise ValueError(f"{out_name} must not overlap {lse_name}")
    for name in (out_name, lse_name):
        if name in views:
            for other in inputs:
                if _overlaps(views[name], views[other]):
                    raise ValueError(f"{name} must not overlap {other}")


def _dtype_or_none(v: _View) -> Any:
    try:
        return get_dtype(v.dtype)
    except TypeError:
        return None


def _check_device_layout(name: str, v: _View, isz: int, last: int) -> None:
    """A device out array: unit stride in D, 16-byte aligned pointer and strides (the other axes
    ``0 .. last-1``; size-1 axes take any stride)."""
    if not all(v.shape):
        return
    if v.shape[-1] > 1 and v.strides[-1] != 1:
        raise ValueError(f"{name} must be contiguous in head_dim (last stride 1), got element strides {v.strides}")
    strides = [s for s, n in zip(v.strides[:last], v.shape[:last], strict=True) if n > 1]
    if any(s < 0 for s in strides):
        raise ValueError(f"{name} has negative strides {v.strides}")
    if v.ptr % 16 or any((s * isz) % 16 for s in strides):
        raise ValueError(f"{name} must be 16-byte aligned with strides that are multiples of 16 bytes (got "
                         f"pointer {v.ptr:#x}, element strides {v.strides}); copy it to a contiguous array")


# ---- NumPy -------------------------------------------------------------------------------------
def _stack_np(p: _Parts) -> np.ndarray:
    return np.asarray(p.arrays[0]) if p.stacked else np.stack([np.asarray(a) for a in p.arrays])


def _merge_numpy(o: np.ndarray, l32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """o [S, B, H, D], l32 [S, B, H]: the merge in float64 -> (out [B, H, D] float64, lse [B, H])."""
    lse_s = l32.astype(np.float64)
    bad = np.isnan(lse_s).any(axis=0) | np.isposinf(lse_s).any(axis=0)
    empty = np.isneginf(lse_s)
    m = np.where(empty, -np.inf, lse_s).max(axis=0)
    m = np.where(bad | np.isneginf(m), 0.0, m)  # finite: no inf - inf
    with np.errstate(invalid="ignore", over="ignore"):
        w = np.where(empty | bad, 0.0, np.exp(np.where(empty | bad, 0.0, lse_s - m)))  # [S, B, H]
        total = w.sum(axis=0)
        acc = np.einsum("sbh,sbhd->bhd", w, np.where(empty[..., None], 0.0, o.astype(np.float64)))
        none = total == 0  # every part empty
        out = np.where(none[..., None], 0.0, acc / np.where(none, 1.0, total)[..., None])
        lse = np.where(none, -np.inf, m + np.log(np.where(none, 1.0, total)))
    out[bad] = np.nan
    lse[bad] = np.nan
    return out, lse


# ---- device ------------------------------------------------------------------------------------
def _device_merge(kind: str, outs: _Parts, lses: _Parts, views: dict[str, _View], out: Any, lse: Any,
                  out_name: str, lse_name: str, b: int, h: int, d: int, dt: Any) -> tuple[Any, Any]:
    for p in (outs, lses):
        if not p.stacked and len(p.arrays) > MAX_LIST:
            raise ValueError(f"{p.name}: at most {MAX_LIST} parts as a sequence on the device, got "
                             f"{len(p.arrays)}; stack them into one [S, ...] array")
    for n, v in zip(outs.names, outs.views, strict=True):
        _check_device_layout(n, v, dt.itemsize, 3 if outs.stacked else 2)
    if out is not None:
        _check_device_layout(out_name, views[out_name], dt.itemsize, 2)
    if b * h > MAX_ROWS:
        raise ValueError(f"B * H must be at most {MAX_ROWS}, got {b * h}")
    dev = outs.views[0].device
    if out is None:
        out = _empty(kind, outs.arrays[0], (b, h, d), None, dev)
        views[out_name] = _view(out, kind)
    if lse is None:
        lse = _empty(kind, outs.arrays[0], (b, h), np.float32, dev)
        views[lse_name] = _view(lse, kind)
    ov, lv = views[out_name], views[lse_name]
    if b * h == 0:
        return out, lse
    params = build_params(outs, lses, ov, lv)
    from fdpp.launch import launch, stream_for

    cfg = merge_config(dt.name, d)
    launch(cfg, cfg.grid(b * h), (params[()],), dev, stream_for(kind, dev))
    return out, lse


def build_params(outs: _Parts, lses: _Parts, ov: _View, lv: _View) -> np.ndarray:
    """The kernel's MergeParams (a 0-d MERGE_PARAMS array) for checked parts and outputs."""
    b, h = ov.shape[:2]
    params = np.zeros((), dtype=MERGE_PARAMS)
    _fill_parts(params, outs, "out_part", "o_sb", "o_sh", "o_ss")
    _fill_parts(params, lses, "lse_part", "l_sb", "l_sh", "l_ss")
    params["out"], params["lse"] = ov.ptr, lv.ptr
    params["out_sb"], params["out_sh"] = ov.strides[0], ov.strides[1]
    params["lse_sb"], params["lse_sh"] = lv.strides[0], lv.strides[1]
    params["num_parts"], params["num_heads"], params["rows"] = outs.count, h, b * h
    params["stacked"] = int(outs.stacked) | (2 * int(lses.stacked))
    return params


def _fill_parts(params: np.ndarray, p: _Parts, ptr: str, sb: str, sh: str, ss: str) -> None:
    if p.stacked:
        v = p.views[0]
        params[ptr][0] = v.ptr
        params[ss], params[sb][0], params[sh][0] = v.strides[0], v.strides[1], v.strides[2]
        return
    for i, v in enumerate(p.views):
        params[ptr][i] = v.ptr
        params[sb][i], params[sh][i] = v.strides[0], v.strides[1]


def _empty(kind: str, like: Any, shape: tuple[int, ...], np_dtype: Any, dev: int) -> Any:
    if kind == "torch":
        import torch

        return torch.empty(shape, dtype=like.dtype if np_dtype is None else torch.float32, device=like.device)
    import cupy

    with cupy.cuda.Device(dev):
        return cupy.empty(shape, dtype=like.dtype if np_dtype is None else np_dtype)


# ---- public API --------------------------------------------------------------------------------
def merge_states(outs: Any, lses: Any, *, out: Any = None, lse_out: Any = None) -> tuple[Any, Any]:
    """Merge S partial attention states of the same queries over disjoint sets of keys.

    Parameters
    ----------
    outs : array [S, B, H, D], or a list/tuple of S arrays [B, H, D]
        Partial outputs, each normalised by its own softmax sum (what ``decode_attention``
        returns). fp16, bf16 or fp32, one dtype; NumPy, CuPy or torch (CUDA), one array type and
        device for every argument. D a multiple of 8, at most 1024. Device arrays need a unit
        stride in D and 16-byte aligned pointers and S/B/H strides (any such strides are honoured,
        e.g. a slice of a bigger buffer); a sequence holds at most 16 arrays on the device.
    lses : float32 array [S, B, H], or a list/tuple of S arrays [B, H]
        Natural-log log-sum-exp of each part's scaled scores (``return_lse=True``). Any strides.
        -inf marks an empty part (weight 0; its output is not read). NaN or +inf is invalid: that
        (b, h) row's output and lse are NaN, other rows are unaffected.
    out : array [B, H, D], optional
        outs' dtype and array type, same layout rules as outs; written and returned. Must not
        overlap an input.
    lse_out : float32 array [B, H], optional
        Written and returned; any strides; must not overlap an input.

    Returns
    -------
    out : array [B, H, D], outs' dtype and array type
        sum_s exp(lse_s - lse) * out_s, accumulated in fp32 (NumPy: float64); zeros where every
        part is empty.
    lse : float32 array [B, H]
        log sum_s exp(lse_s); -inf where every part is empty.

    Notes
    -----
    NumPy inputs are merged by NumPy (float64, then cast); CuPy/torch by one kernel launch on the
    current CuPy / torch stream: no host synchronisation, no allocation besides the outputs, so it
    can be captured in a CUDA graph (for CuPy, make one call first so the kernel is compiled, and
    pass ``out``/``lse_out``). Nothing the caller passed is modified except ``out``/``lse_out``.
    Bad arguments raise ValueError/TypeError naming the argument.
    """
    return _merge(outs, lses, out, lse_out, "out", "lse_out")


def merge_state_(out: Any, lse: Any, out_other: Any, lse_other: Any) -> tuple[Any, Any]:
    """Merge the partial state (``out_other``, ``lse_other``) into (``out``, ``lse``) in place.

    Parameters
    ----------
    out : array [B, H, D]
        fp16, bf16 or fp32; overwritten with the merged output (same rules as
        :func:`merge_states`' outs).
    lse : float32 array [B, H]
        Overwritten with the merged lse (natural log).
    out_other : array [B, H, D]
        out's dtype, array type and device; not modified; must not overlap out or lse.
    lse_other : float32 array [B, H]
        Not modified; must not overlap out or lse.

    Returns
    -------
    (out, lse), the same objects, for chaining.
    """
    if lse is None:
        raise TypeError("lse must be a float32 array [B, H], got None")
    return _merge([out, out_other], [lse, lse_other], None, None, "out", "lse", in_place=True)


def _merge(outs: Any, lses: Any, out: Any, lse_out: Any, out_name: str, lse_name: str,
           in_place: bool = False) -> tuple[Any, Any]:
    if in_place:
        op = _Parts("outs", outs, 3)
        op.names = ["out", "out_other"]
        lp = _Parts("lses", lses, 2)
        lp.names = ["lse", "lse_other"]
    else:
        op, lp = _Parts("outs", outs, 3), _Parts("lses", lses, 2)
    kind, views = _gather([op, lp], {} if in_place else {out_name: out, lse_name: lse_out})
    s, b, h, d, dt = _check_parts(op, lp)
    if in_place:
        out, lse_out = op.arrays[0], lp.arrays[0]
        _check_outputs(kind, views, out, lse_out, "out", "lse", b, h, d, dt, ["out_other", "lse_other"])
        if _overlaps(views["out"], views["lse"]):
            raise ValueError("out must not overlap lse")
    else:
        _check_outputs(kind, views, out, lse_out, out_name, lse_name, b, h, d, dt, op.names + lp.names)
    if kind == "numpy":
        o64, l64 = _merge_numpy(_stack_np(op), _stack_np(lp))
        res_o = o64.astype(dt.np_dtype)
        res_l = l64.astype(np.float32)
        if out is not None:
            out[...] = res_o
            res_o = out
        if lse_out is not None:
            lse_out[...] = res_l
            res_l = lse_out
        return res_o, res_l
    return _device_merge(kind, op, lp, views, out, lse_out, out_name if not in_place else "out",
                         lse_name if not in_place else "lse", b, h, d, dt)
