"""Public entry points: argument validation, array normalisation, output allocation, launch."""

from __future__ import annotations

import logging
import math
import os
import warnings
from dataclasses import replace
from functools import cache
from typing import Any, NamedTuple

import numpy as np

from fdpp import plan as _plan
from fdpp.configs import (
    BATCH_INVARIANT,
    HEAD_DIMS,
    MAX_SPLITS,
    MMA_DTYPES,
    PAGE_SIZES,
    QUANT_HEAD_DIMS,
    DecodeProblem,
    LaunchPlan,
    nosplit_config,
)
from fdpp.dtypes import INT4_FORMATS, KV_FORMATS, get_dtype, get_kv_format, int4_format

log = logging.getLogger("fdpp")

LOG2E = 1.4426950408889634
_F32_MAX = float(np.finfo(np.float32).max)
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


def _byte_range(v: _View) -> tuple[int, int]:
    """[lo, hi) of the bytes ``v`` touches (negative strides reach below its pointer); lo == hi when empty."""
    lo = hi = 0
    for n, s in zip(v.shape, v.strides, strict=True):
        if n == 0:
            return v.ptr, v.ptr
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return v.ptr + lo * v.itemsize, v.ptr + (hi + 1) * v.itemsize


def _overlaps(a: _View, b: _View) -> bool:
    alo, ahi = _byte_range(a)
    blo, bhi = _byte_range(b)
    return alo < ahi and blo < bhi and alo < bhi and blo < ahi


def gather_views(first_name: str, first: Any, others: dict[str, Any],
                 required: tuple[str, ...] = ()) -> tuple[str, dict[str, _View]]:
    """Check that ``first`` and every non-None array in ``others`` share one array type and device;
    return that type ("numpy" | "cupy" | "torch") and a _View of each (None entries skipped; an
    entry named in ``required`` may not be None)."""
    kind = _kind(first)
    if kind == "other":
        raise TypeError(f"{first_name} must be a NumPy array, CuPy array or torch tensor, got "
                        f"{type(first).__name__}")
    for name in required:
        if others.get(name) is None:
            raise TypeError(f"{name} must be a NumPy array, CuPy array or torch tensor, got None")
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


_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the calling function name the first
    frame outside fdpp: the user's line, whichever public function it went through."""
    import sys

    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PKG_DIR):
        frame, level = frame.f_back, level + 1
    return level


@cache
def _warn_emulator() -> None:
    warnings.warn("fdpp: no GPU found (CuPy sees no CUDA device); attention calls on NumPy arrays run the NumPy "
                  "split-KV emulator on the CPU", RuntimeWarning, stacklevel=user_stacklevel())


# ---- checking mode --------------------------------------------------------------------------
def _env_flag(name: str) -> bool:
    """An on/off environment variable: unset, "", 0, false, no or off is off; 1, true, yes or on
    is on; anything else is on, with a warning (a typo should not silently drop the checks)."""
    text = os.environ.get(name, "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text not in ("1", "true", "yes", "on"):
        warnings.warn(f"fdpp: {name}={os.environ[name]!r} is not one of 0/1, false/true, no/yes, off/on; "
                      f"taken as on", RuntimeWarning, stacklevel=2)
    return True


_checks = _env_flag("FDPP_CHECKS")


def set_checks(enabled: bool) -> None:
    """Validate device-side values (cache lengths, block tables) on the host before each call.

    Off by default: the check copies ``cache_seqlens`` and ``block_table`` to the host, which
    synchronises the stream (so it cannot run inside a CUDA graph capture). When off, the kernels
    still never read outside the cache: a request whose length is outside [0, N_max] or whose
    block table names a page outside the pool gets NaN output and lse. ``FDPP_CHECKS=1`` (or
    true / yes / on) in the environment turns it on at import. NumPy inputs are always checked.
    """
    global _checks
    check_flag("enabled", enabled)
    _checks = bool(enabled)


def checks_enabled() -> bool:
    return _checks


# ---- validation -----------------------------------------------------------------------------
class _Cache(NamedTuple):
    """How the kernels find K/V: pointers and element strides in DecodeParams' terms."""

    k: int
    v: int
    k_strides: tuple[int, int, int]  # contiguous: request, token, head; paged: page, slot, head
    v_strides: tuple[int, int, int]
    block_table: int = 0
    bt_sb: int = 0
    num_pages: int = 0
    descale: tuple[tuple[str, Any], ...] = ()  # DecodeParams' dequantisation fields (quantised K/V)


def _check_scalar_args(softmax_scale: Any, num_splits: Any, kv_layout: Any) -> None:
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, np.floating, np.integer)):
            raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        try:
            fs = float(softmax_scale)
        except OverflowError:  # an int past float64's range
            raise ValueError(f"softmax_scale must be at most {_F32_MAX / LOG2E:.3g} in magnitude, got an "
                             f"integer of {len(str(abs(int(softmax_scale))))} digits") from None
        if not math.isfinite(fs):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
        if abs(fs) * LOG2E > _F32_MAX:  # the kernels use scale * log2(e) in float32
            raise ValueError(f"softmax_scale must be at most {_F32_MAX / LOG2E:.3g} in magnitude, got {softmax_scale}")
    if num_splits is not None and num_splits is not BATCH_INVARIANT:
        if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
            raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")


#: ``softmax_mode`` values: "exact" (each chunk's own max) and "unified_max" (FlashDecoding++'s
#: asynchronized softmax: the tensor-core kernels start from a given max, see decode_attention).
SOFTMAX_MODES = ("exact", "unified_max")
#: |unified_max| bound: phi * log2(e) and phi +- 8 stay exact in float32 scores.
UNIFIED_MAX_LIMIT = 1e6


def softmax_arg(softmax_mode: Any, unified_max: Any) -> float | None:
    """The unified max a call runs with (natural log, the scaled scores' units), or None (exact);
    raises for a bad pair."""
    if not isinstance(softmax_mode, str):
        raise TypeError(f"softmax_mode must be a str, got {type(softmax_mode).__name__}")
    if softmax_mode not in SOFTMAX_MODES:
        raise ValueError(f"softmax_mode must be one of {SOFTMAX_MODES}, got {softmax_mode!r}")
    if softmax_mode == "exact":
        if unified_max is not None:
            raise ValueError("unified_max is given but softmax_mode is 'exact': pass softmax_mode='unified_max'")
        return None
    if unified_max is None:
        raise ValueError("softmax_mode='unified_max' needs unified_max=phi (fdpp.calibrate_unified_max makes one)")
    if isinstance(unified_max, bool) or not isinstance(unified_max, (int, float, np.floating, np.integer)):
        raise TypeError(f"unified_max must be a float, got {type(unified_max).__name__}")
    phi = float(unified_max)
    if not math.isfinite(phi) or abs(phi) > UNIFIED_MAX_LIMIT:
        raise ValueError(f"unified_max must be finite and at most {UNIFIED_MAX_LIMIT:g} in magnitude, got {unified_max}")
    return phi


#: Tokens per block of the tensor-core kernels' softmax (one warp's MMA block): the unit
#: ``calibrate_unified_max`` takes maxima over.
UMAX_BLOCK = 16


def calibrate_unified_max(q: Any, k: Any, *, softmax_scale: float | None = None, kv_layout: str = "NHD",
                          cache_seqlens: Any = None) -> float:
    """A unified max phi for ``softmax_mode="unified_max"`` from sample queries and keys of a layer.

    ``q`` [B, Hq, D] and ``k`` ([B, N, Hkv, D] for "NHD", [B, Hkv, N, D] for "HND"; dequantised for
    a quantised cache) in any dtype, NumPy, CuPy or torch; ``cache_seqlens`` [B] (default N).
    Returns the median, over every (request, query head) and every block of 16 tokens
    (``UMAX_BLOCK``: where the kernels' warps start), of the block's largest scaled score
    softmax_scale * q.k (float64, on the host): the value that puts most first blocks inside
    the window phi +- 5.5 that skips the max. Any phi gives the exact result (see
    :func:`decode_attention`); a poor one only costs the rescales exact mode does anyway."""
    _check_scalar_args(softmax_scale, None, kv_layout)
    for name, x in (("q", q), ("k", k), ("cache_seqlens", cache_seqlens)):
        if x is not None and _kind(x) == "other":
            raise TypeError(f"{name} must be a NumPy, CuPy or torch array, got {type(x).__name__}")
    qh, kh = (_to_host(_kind(x), x.float() if _kind(x) == "torch" else x) for x in (q, k))
    qh, kh = np.asarray(qh, dtype=np.float64), np.asarray(kh, dtype=np.float64)
    if qh.ndim != 3 or kh.ndim != 4:
        raise ValueError(f"q must be [B, Hq, D] and k 4-D, got shapes {qh.shape} and {kh.shape}")
    if kv_layout == "NHD":
        kh = kh.transpose(0, 2, 1, 3)  # [B, Hkv, N, D]
    b, hq, d = qh.shape
    if d < 1:
        raise ValueError(f"head_dim (q.shape[2]) must be >= 1, got {d}")
    if kh.shape[0] != b or kh.shape[3] != d or kh.shape[1] == 0 or hq % kh.shape[1]:
        raise ValueError(f"k of shape {kh.shape} ({kv_layout}) does not match q of shape {qh.shape}")
    n = kh.shape[2]
    lens = np.full(b, n) if cache_seqlens is None else np.asarray(_to_host(_kind(cache_seqlens), cache_seqlens))
    if lens.dtype == np.bool_ or not np.issubdtype(lens.dtype, np.integer):
        raise TypeError(f"cache_seqlens must hold integers, got {lens.dtype}")
    if lens.shape != (b,) or (lens < 0).any() or (lens > n).any():
        raise ValueError(f"cache_seqlens must be [B] = [{b}] lengths in [0, {n}]")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    ratio = hq // kh.shape[1]
    s = scale * np.einsum("bgrd,bgnd->bgrn", qh.reshape(b, kh.shape[1], ratio, d), kh)  # [B, Hkv, ratio, N]
    maxima = []
    for r in range(b):
        for t in range(0, int(lens[r]), UMAX_BLOCK):
            maxima.append(s[r, :, :, t:min(t + UMAX_BLOCK, int(lens[r]))].max(axis=-1).ravel())
    if not maxima:
        raise ValueError("calibrate_unified_max needs at least one token (every cache_seqlens is 0)")
    phi = float(np.median(np.concatenate(maxima)))
    if not math.isfinite(phi):
        raise ValueError("the sample scores are not finite")
    return phi


def _check_q(qv: _View) -> tuple[int, int, int]:
    if len(qv.shape) != 3:
        raise ValueError(f"q must have shape [batch, num_q_heads, head_dim], got {qv.shape}")
    b, hq, d = qv.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {d}")
    if b < 1:
        raise ValueError(f"batch must be >= 1, got {b}")
    if b > MAX_GRID_YZ:
        raise ValueError(f"batch must be <= {MAX_GRID_YZ}, got {b}")
    return b, hq, d


def _check_kv_pair(views: dict[str, _View], names: tuple[str, str], kv_layout: str, want: str) -> tuple[int, ...]:
    kv, vv = views[names[0]], views[names[1]]
    for name, v in zip(names, (kv, vv), strict=True):
        if len(v.shape) != 4:
            raise ValueError(f"{name} must have shape {want} for kv_layout={kv_layout!r}, got {v.shape}")
    if kv.shape != vv.shape:
        raise ValueError(f"{names[0]} and {names[1]} must have the same shape, got {kv.shape} and {vv.shape}")
    return kv.shape


def check_problem_sizes(batch: Any, num_q_heads: Any, num_kv_heads: Any, head_dim: Any, seqlen: Any,
                        page_size: Any, prefix: str = "") -> tuple[int, int, int, int, int, int]:
    """The sizes of a planned call (``DecodePlan``, ``explain``'s problem), as ints: batch, heads and
    head_dim >= 1, seqlen and page_size >= 0, heads grouped evenly, a supported head_dim and page size
    (TypeError / ValueError naming the argument, ``prefix`` before its name)."""
    out = []
    for name, x, low in (("batch", batch, 1), ("num_q_heads", num_q_heads, 1), ("num_kv_heads", num_kv_heads, 1),
                         ("head_dim", head_dim, 1), ("seqlen", seqlen, 0), ("page_size", page_size, 0)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"{prefix}{name} must be an int, got {type(x).__name__}")
        if x < low:
            raise ValueError(f"{prefix}{name} must be >= {low}, got {x}")
        out.append(int(x))
    b, hq, hkv, d, n, page = out
    _check_heads(hq, hkv, d, d, f"{prefix}head_dim")
    if d not in HEAD_DIMS:
        raise ValueError(f"{prefix}head_dim must be one of {HEAD_DIMS}, got {d}")
    if page and page not in PAGE_SIZES:
        raise ValueError(f"{prefix}page_size must be 0 (contiguous) or a power of two in 1..256, got {page}")
    return b, hq, hkv, d, n, page


def _check_heads(hq: int, hkv: int, d: int, kd: int, name: str, packed: bool = False) -> None:
    if packed and 2 * kd != d:
        raise ValueError(f"{name} last axis {kd} must be head_dim // 2 = {d // 2} (INT4: two codes a byte)")
    if kd != d and not packed:
        raise ValueError(f"{name} head_dim {kd} != q head_dim {d}")
    if hkv < 1 or hq < 1 or hq % hkv:
        raise ValueError(f"num_q_heads ({hq}) must be a positive multiple of num_kv_heads ({hkv})")


def _dtype_of(views: dict[str, _View], name: str) -> Any:
    """The dtype table entry of argument ``name``; an unsupported dtype's error names it."""
    try:
        return get_dtype(views[name].dtype)
    except TypeError as e:
        raise TypeError(f"{name}: {e}") from None


class _Quant(NamedTuple):
    """A call's quantised-cache arguments, as given (validated by _check_kv)."""

    kv_dtype: Any = None
    k_descale: Any = None
    v_descale: Any = None
    k_zero: Any = None  # INT4 only
    v_zero: Any = None

    @classmethod
    def of(cls, kv_dtype: Any, k_descale: Any, v_descale: Any, k_zero: Any = None, v_zero: Any = None) -> _Quant:
        """The call's arguments; the shared empty one for an unquantised call (the eager path's
        common case does no work here)."""
        if kv_dtype is None and k_descale is None and v_descale is None and k_zero is None and v_zero is None:
            return _NO_QUANT
        return cls(kv_dtype, k_descale, v_descale, k_zero, v_zero)

    @property
    def int4(self) -> bool:
        return self.kv_dtype == "int4"

    def arrays(self) -> tuple[Any, Any, Any, Any]:
        """The descale (INT4: scale) and zero arguments that are arrays (their pointers go into
        DecodeParams, in its order), else None."""
        if self is _NO_QUANT:
            return _NO_ARRAYS
        return (None if _is_scalar(self.k_descale) else self.k_descale,
                None if _is_scalar(self.v_descale) else self.v_descale,
                None if _is_scalar(self.k_zero) else self.k_zero,
                None if _is_scalar(self.v_zero) else self.v_zero)

    def key(self) -> tuple:
        """What of the arguments a launch record's key needs beyond the arrays' signatures."""
        if self is _NO_QUANT:
            return _NO_QUANT_KEY
        return (self.kv_dtype, self.k_descale if _is_scalar(self.k_descale) else None,
                self.v_descale if _is_scalar(self.v_descale) else None)


_NO_QUANT = _Quant()
_NO_QUANT_KEY = (None, None, None)
_NO_ARRAYS = (None, None, None, None)
#: The pointer arguments of DecodeParams after q, k, v, seqlens, block_table (fdpp.plan.PTR_FIELDS).
_QUANT_NAMES = ("k_descale", "v_descale", "k_zero", "v_zero")


def _is_scalar(x: Any) -> bool:
    return x is None or (isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, (bool, np.bool_)))


def _check_kv(views: dict[str, _View], names: tuple[str, str], dt_q: Any, d: int, quant: _Quant) -> str:
    """The problem's ``kv_dtype``: q's dtype name for an unquantised cache (K/V of q's dtype), or
    the FP8 format of the codes (from their dtype, or ``kv_dtype`` for uint8 arrays)."""
    if quant.int4:
        return _check_int4_codes(views, names, dt_q, d)
    for which in ("k_zero", "v_zero"):
        if getattr(quant, which) is not None:
            raise ValueError(f"{which} applies to INT4 caches only (kv_dtype='int4'), got kv_dtype={quant.kv_dtype!r}")
    fmt = None
    if quant.kv_dtype is not None:
        fmt = get_kv_format(quant.kv_dtype) if isinstance(quant.kv_dtype, str) else None
        if fmt is None:
            raise ValueError(f"kv_dtype must be None or one of {[*sorted(KV_FORMATS), 'int4']}, got {quant.kv_dtype!r}")
    found = []
    for name in names:
        v = views[name]
        f = get_kv_format(v.dtype)
        if f is None and str(v.dtype).removeprefix("torch.") == "uint8":
            if fmt is None:
                raise TypeError(f"{name} holds uint8 codes: say their format with kv_dtype='fp8_e4m3' or "
                                "'fp8_e5m2'")
            f = fmt
        elif f is None:
            if _dtype_of(views, name) != dt_q:
                raise TypeError(f"{name} dtype {v.dtype} must match q dtype {views['q'].dtype} (or be an FP8 "
                                f"format: {sorted(KV_FORMATS)})")
            if fmt is not None:
                raise TypeError(f"kv_dtype={quant.kv_dtype!r} names a quantised format, but {name} is {v.dtype}")
        elif fmt is not None and f is not fmt:
            raise TypeError(f"{name} is {f.name} but kv_dtype={quant.kv_dtype!r}")
        found.append(f)
    if found[0] is not found[1]:
        said = [f.name if f else str(views[n].dtype) for f, n in zip(found, names, strict=True)]
        raise TypeError(f"{names[0]} and {names[1]} must have one element type, got {said[0]} and {said[1]}")
    if found[0] is None:
        for which, x in (("k_descale", quant.k_descale), ("v_descale", quant.v_descale)):
            if x is not None:
                raise ValueError(f"{which} applies to FP8 caches only ({names[0]} is {views[names[0]].dtype})")
        return dt_q.name
    if dt_q.name not in MMA_DTYPES:
        raise TypeError(f"FP8 K/V take fp16 or bf16 q, got q of {dt_q.name}")
    if d not in QUANT_HEAD_DIMS:
        raise ValueError(f"FP8 K/V take head_dim in {QUANT_HEAD_DIMS}, got {d}")
    return found[0].name


def _check_int4_codes(views: dict[str, _View], names: tuple[str, str], dt_q: Any, d: int) -> str:
    """kv_dtype='int4': K and V are uint8 code pairs (checked here; their shape by the caller)."""
    for name in names:
        dt = str(views[name].dtype).removeprefix("torch.")
        if dt != "uint8":
            raise TypeError(f"{name} must hold uint8 INT4 code pairs ([..., head_dim // 2]) for kv_dtype='int4', "
                            f"got {views[name].dtype}")
    if dt_q.name not in MMA_DTYPES:
        raise TypeError(f"INT4 K/V take fp16 or bf16 q, got q of {dt_q.name}")
    if d not in QUANT_HEAD_DIMS:
        raise ValueError(f"INT4 K/V take head_dim in {QUANT_HEAD_DIMS}, got {d}")
    return "int4"  # the group size comes from the scales (_check_int4_params)


def _check_int4_params(kind: str, views: dict[str, _View], quant: _Quant, code_shape: tuple[int, ...],
                       d: int, order: tuple[int, int, int]) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """kv_dtype='int4': the fp16 scale (``k_descale`` / ``v_descale``) and zero arrays, shaped as
    the codes with D // group_size in the last axis; returns the kernels' element type
    ("int4_g64") and DecodeParams' fields (strides in (request or page, token or slot, head)
    order, ``order`` mapping the layout's axes to those)."""
    for name in _QUANT_NAMES:
        x = getattr(quant, name)
        if x is None:
            raise TypeError(f"{name} is required for kv_dtype='int4' (fp16 array of shape {code_shape[:-1]} + "
                            "(head_dim // group_size,))")
        if _is_scalar(x):
            raise TypeError(f"{name} must be an fp16 array for kv_dtype='int4', got {type(x).__name__}")
    kv = views["k_descale"]
    if len(kv.shape) != 4 or kv.shape[:-1] != tuple(code_shape[:-1]) or kv.shape[-1] < 1 or d % kv.shape[-1]:
        raise ValueError(f"k_descale must have shape {tuple(code_shape[:-1])} + (head_dim // group_size,) for "
                         f"kv_dtype='int4', got {kv.shape}")
    g = d // kv.shape[-1]
    try:
        fmt = int4_format(g)
    except ValueError:
        raise ValueError(f"k_descale's last axis ({kv.shape[-1]}) gives group_size {g} = head_dim {d} // "
                         f"{kv.shape[-1]}; INT4 groups are 32, 64 or 128 elements of head_dim") from None
    fields: list[tuple[str, Any]] = [("k_scale", 1.0), ("v_scale", 1.0)]
    for name, tag in zip(_QUANT_NAMES, ("kd", "vd", "kz", "vz"), strict=True):
        v = views[name]
        if v.shape != kv.shape:
            raise ValueError(f"{name} must have the shape of k_descale {kv.shape} (one group size for K and V), "
                             f"got {v.shape}")
        if _np_dtype(v) != np.float16:
            raise TypeError(f"{name} must be float16 for kv_dtype='int4', got {v.dtype}")
        if kind != "numpy" and all(v.shape):  # NumPy: finite where read (_int4_params_finite)
            if v.shape[-1] > 1 and v.strides[-1] != 1:
                raise ValueError(f"{name} must be contiguous in its last axis, got element strides {v.strides}")
            if any(s < 0 for s in v.strides):
                raise ValueError(f"{name} has negative strides {v.strides}")
            if v.shape[-1] > 1 and (v.ptr % 4 or any(s % 2 for s in v.strides[:3])):
                raise ValueError(f"{name} rows must be 4-byte aligned (pointer {v.ptr:#x}, element strides "
                                 f"{v.strides}); copy it to a contiguous array")
        st = v.strides
        fields += [(f"{tag}_sb", st[order[0]]), (f"{tag}_sn", st[order[1]]), (f"{tag}_sh", st[order[2]])]
    return fmt.name, tuple(fields)


def _check_descales(kind: str, views: dict[str, _View], quant: _Quant, b: int, hkv: int,
                    kv_dtype: str) -> tuple[tuple[str, Any], ...]:
    """DecodeParams' dequantisation fields: the descale arrays' strides ([B, Hkv] float32, or one
    value: shape () or (1,)) and the scalar factors (a Python float, else 1)."""
    fields: list[tuple[str, Any]] = []
    for which, x in (("k", quant.k_descale), ("v", quant.v_descale)):
        name, sb, sh, scalar = f"{which}_descale", 0, 0, 1.0
        if _is_scalar(x) and x is not None:
            scalar = float(x)
            if not math.isfinite(scalar) or abs(scalar) > _F32_MAX:
                raise ValueError(f"{name} must be a finite float32 value, got {x}")
        elif x is not None:
            v = views[name]
            if _np_dtype(v) != np.float32:
                raise TypeError(f"{name} must be float32, got {v.dtype}")
            if v.shape == (b, hkv):
                sb, sh = v.strides
            elif v.shape == (hkv,) and hkv > 1:  # per KV head, every request (a cache's static scales)
                sh = v.strides[0]
            elif v.shape not in ((), (1,)):
                raise ValueError(f"{name} must have shape [batch, num_kv_heads] = {(b, hkv)}, [num_kv_heads], () "
                                 f"or (1,), got {v.shape}")
            if kind == "numpy" and not np.isfinite(np.asarray(x)).all():
                raise ValueError(f"{name} must be finite")
        fields += [(f"{which}d_sb", sb), (f"{which}d_sh", sh), (f"{which}_scale", scalar)]
    return tuple(fields)


def _np_dtype(v: _View) -> np.dtype:
    return np.dtype(str(v.dtype).removeprefix("torch."))


def _check_index_array(kind: str, v: _View, name: str, shape: tuple[int, ...]) -> None:
    """An int32 index array of ``shape`` (NumPy: any integer type), contiguous in its last axis."""
    if v.shape != shape:
        dims = "[batch]" if len(shape) == 1 else "[batch, max_pages_per_seq]"
        raise ValueError(f"{name} must have shape {dims} = {shape}, got {v.shape}")
    sdt = _np_dtype(v)
    if kind == "numpy":
        if sdt.kind not in "iu":
            raise TypeError(f"{name} must be an integer array, got {sdt}")
    elif sdt != np.int32:
        raise TypeError(f"{name} must be int32 on the device, got {sdt}")
    elif shape[-1] > 1 and v.strides[-1] != 1:
        raise ValueError(f"{name} must be contiguous in its last axis, got element strides {v.strides}")


def _check_out(views: dict[str, _View], b: int, hq: int, d: int, dt_q: Any, inputs: tuple[str, ...]) -> None:
    ov = views.get("out")
    if ov is None:
        return
    if ov.shape != (b, hq, d):
        raise ValueError(f"out must have shape {(b, hq, d)}, got {ov.shape}")
    if _dtype_of(views, "out") != dt_q:
        raise TypeError(f"out dtype {ov.dtype} must match q dtype {views['q'].dtype}")
    if any(s != want for s, want, n in zip(ov.strides, (hq * d, d, 1), ov.shape, strict=True) if n > 1):
        raise ValueError(f"out must be C-contiguous, got element strides {ov.strides}")  # size-1 dims: any
    for name in inputs:
        if name in views and _overlaps(ov, views[name]):
            raise ValueError(f"out must not overlap {name}")


def _check_writable(kind: str, out: Any, name: str = "out") -> None:
    """An array a call writes into (out=, lse=) must not be a read-only NumPy array."""
    if kind == "numpy" and out is not None and not out.flags.writeable:
        raise ValueError(f"{name} must be a writable array (got a read-only NumPy array)")


def _check_device_layout(views: dict[str, _View], names: tuple[str, ...], isz: int) -> None:
    """Device kernels read q rows and K/V rows with 16-byte vectors."""
    if views["q"].strides[2] != 1:
        raise ValueError(f"q must be contiguous in head_dim (last stride 1), got strides {views['q'].strides}")
    for name in names:
        v = views[name]
        if not all(v.shape):  # empty (N_max = 0): nothing is read, and frameworks report 0 strides
            continue
        if v.strides[3] != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (last stride 1), got strides {v.strides}")
        if any(s < 0 for s in v.strides):
            raise ValueError(f"{name} has negative strides {v.strides}")
        if v.ptr % 16 or any((s * isz) % 16 for s in v.strides[:3]):
            raise ValueError(f"{name} must be 16-byte aligned with strides that are multiples of 16 "
                             f"bytes (got pointer {v.ptr:#x}, element strides {v.strides}); "
                             "copy it to a contiguous array")


def _host_lengths(kind: str, lens: Any, n_max: int, name: str = "cache_seqlens") -> np.ndarray:
    """``lens`` on the host (a device copy when checks are on), checked against [0, n_max]."""
    raw = _to_host(kind, lens)  # compared before the int64 cast: a uint64 past 2^63 must not wrap
    if raw.min(initial=0) < 0 or raw.max(initial=0) > n_max:
        bad = int(np.flatnonzero((raw < 0) | (raw > n_max))[0])
        raise ValueError(f"{name} values must be in [0, {n_max}] (N_max), got {int(raw[bad])} for "
                         f"request {bad} (min {int(raw.min())} max {int(raw.max())})")
    return raw.astype(np.int64)


def _to_host(kind: str, x: Any) -> np.ndarray:
    if kind == "numpy":
        return np.asarray(x)
    if kind == "torch":
        return x.cpu().numpy()
    import cupy

    return cupy.asnumpy(x)


def _check_contiguous(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, softmax_scale: Any,
                      kv_layout: Any, num_splits: Any, out: Any,
                      quant: _Quant = _NO_QUANT) -> tuple[str, DecodeProblem, dict[str, _View], _Cache]:
    kd_arr, vd_arr, kz_arr, vz_arr = quant.arrays()
    kind, views = gather_views("q", q, {"k_cache": k_cache, "v_cache": v_cache,
                                        "cache_seqlens": cache_seqlens, "out": out,
                                        "k_descale": kd_arr, "v_descale": vd_arr, "k_zero": kz_arr, "v_zero": vz_arr},
                               required=("k_cache", "v_cache"))
    _check_writable(kind, out)
    _check_scalar_args(softmax_scale, num_splits, kv_layout)
    b, hq, d = _check_q(views["q"])
    want = "[batch, seqlen, kv_heads, head_dim]" if kv_layout == "NHD" else "[batch, kv_heads, seqlen, head_dim]"
    shape = _check_kv_pair(views, ("k_cache", "v_cache"), kv_layout, want)
    kb, n_max, hkv, kd = shape if kv_layout == "NHD" else (shape[0], shape[2], shape[1], shape[3])
    if kb != b:
        raise ValueError(f"k_cache batch {kb} != q batch {b}")
    _check_heads(hq, hkv, d, kd, "k_cache", quant.int4)
    dt_q = _dtype_of(views, "q")
    kv_dtype = _check_kv(views, ("k_cache", "v_cache"), dt_q, d, quant)
    order = (0, 1, 2) if kv_layout == "NHD" else (0, 2, 1)  # (request, token, head)
    if quant.int4:
        kv_dtype, descale = _check_int4_params(kind, views, quant, shape, d, order)
    else:
        descale = _check_descales(kind, views, quant, b, hkv, kv_dtype)
    if cache_seqlens is not None:
        _check_index_array(kind, views["cache_seqlens"], "cache_seqlens", (b,))
        if kind == "numpy" or _checks:
            _host_lengths(kind, cache_seqlens, n_max)
    _check_out(views, b, hq, d, dt_q, ("q", "k_cache", "v_cache", "cache_seqlens", *_QUANT_NAMES))
    if kind != "numpy":
        _check_device_layout(views, ("k_cache", "v_cache"), views["k_cache"].itemsize)
    ks, vs = views["k_cache"].strides, views["v_cache"].strides
    cache = _Cache(views["k_cache"].ptr, views["v_cache"].ptr, tuple(ks[i] for i in order),
                   tuple(vs[i] for i in order), descale=descale)
    return kind, DecodeProblem(b, hq, hkv, d, n_max, dt_q.name, kv_dtype), views, cache


def _check_paged(q: Any, k_pages: Any, v_pages: Any, block_table: Any, cache_seqlens: Any,
                 softmax_scale: Any, kv_layout: Any, num_splits: Any, out: Any,
                 quant: _Quant = _NO_QUANT) -> tuple[str, DecodeProblem, dict[str, _View], _Cache]:
    if block_table is None:
        raise TypeError("block_table must be an int32 array [batch, max_pages_per_seq], got None")
    if cache_seqlens is None:
        raise TypeError("cache_seqlens must be an int32 array [batch], got None")
    kd_arr, vd_arr, kz_arr, vz_arr = quant.arrays()
    kind, views = gather_views("q", q, {"k_pages": k_pages, "v_pages": v_pages, "block_table": block_table,
                                        "cache_seqlens": cache_seqlens, "out": out,
                                        "k_descale": kd_arr, "v_descale": vd_arr, "k_zero": kz_arr, "v_zero": vz_arr},
                               required=("k_pages", "v_pages"))
    _check_writable(kind, out)
    _check_scalar_args(softmax_scale, num_splits, kv_layout)
    b, hq, d = _check_q(views["q"])
    want = ("[num_pages, page_size, kv_heads, head_dim]" if kv_layout == "NHD"
            else "[num_pages, kv_heads, page_size, head_dim]")
    shape = _check_kv_pair(views, ("k_pages", "v_pages"), kv_layout, want)
    num_pages, page, hkv, kd = shape if kv_layout == "NHD" else (shape[0], shape[2], shape[1], shape[3])
    if page not in PAGE_SIZES:
        raise ValueError(f"page_size (k_pages dim {1 if kv_layout == 'NHD' else 2}) must be a power of two "
                         f"in 1..256, got {page}")
    if not 1 <= num_pages < 2**31:
        raise ValueError(f"k_pages must hold between 1 and 2**31 - 1 pages, got {num_pages}")
    _check_heads(hq, hkv, d, kd, "k_pages", quant.int4)
    dt_q = _dtype_of(views, "q")
    kv_dtype = _check_kv(views, ("k_pages", "v_pages"), dt_q, d, quant)
    order = (0, 1, 2) if kv_layout == "NHD" else (0, 2, 1)  # (page, slot, head)
    if quant.int4:
        kv_dtype, descale = _check_int4_params(kind, views, quant, shape, d, order)
    else:
        descale = _check_descales(kind, views, quant, b, hkv, kv_dtype)
    bv = views["block_table"]
    if len(bv.shape) != 2:
        raise ValueError(f"block_table must have shape [batch, max_pages_per_seq], got {bv.shape}")
    _check_index_array(kind, bv, "block_table", (b, bv.shape[1]))
    n_max = bv.shape[1] * page
    if n_max >= 2**31:
        raise ValueError(f"block_table addresses {n_max} tokens per request (max 2**31 - 1)")
    _check_index_array(kind, views["cache_seqlens"], "cache_seqlens", (b,))
    if kind == "numpy" or _checks:
        lens = _host_lengths(kind, cache_seqlens, n_max)
        _check_pages(_to_host(kind, block_table), lens, page, num_pages)
    _check_out(views, b, hq, d, dt_q, ("q", "k_pages", "v_pages", "block_table", "cache_seqlens", *_QUANT_NAMES))
    if kind != "numpy":
        _check_device_layout(views, ("k_pages", "v_pages"), views["k_pages"].itemsize)
    ks, vs = views["k_pages"].strides, views["v_pages"].strides
    cache = _Cache(views["k_pages"].ptr, views["v_pages"].ptr, tuple(ks[i] for i in order),
                   tuple(vs[i] for i in order), bv.ptr, bv.strides[0], num_pages, descale)
    return kind, DecodeProblem(b, hq, hkv, d, n_max, dt_q.name, kv_dtype, page), views, cache


def _check_pages(table: np.ndarray, lens: np.ndarray, page: int, num_pages: int) -> None:
    """Every page a request uses (the first ceil(len / page) entries of its row) is in the pool."""
    used = np.arange(table.shape[1])[None, :] < -(-lens[:, None] // page)
    bad = used & ((table < 0) | (table >= num_pages))
    if bad.any():
        r, c = (int(x[0]) for x in np.nonzero(bad))
        raise ValueError(f"block_table[{r}, {c}] = {int(table[r, c])} is outside the pool [0, {num_pages}) "
                         f"(request {r} uses {int(-(-lens[r] // page))} pages)")


# ---- public API -----------------------------------------------------------------------------
def decode_attention(q: Any, k_cache: Any, v_cache: Any, *, cache_seqlens: Any = None,
                     softmax_scale: float | None = None, kv_layout: str = "NHD",
                     num_splits: int | None = None, return_lse: bool = False,
                     out: Any = None, batch_invariant: bool = False, kv_dtype: str | None = None,
                     k_descale: Any = None, v_descale: Any = None, k_zero: Any = None, v_zero: Any = None,
                     softmax_mode: str = "exact", unified_max: float | None = None,
                     _expect: DecodeProblem | None = None) -> Any:
    """Exact single-query ("decode") attention over a KV cache, split along the sequence.

    The cache is cut into ``num_splits`` chunks; one CTA per (request, KV head, chunk) computes a
    partial softmax for every query head sharing that KV head (GQA packing: KV is read once), and
    the partials are rescaled by exp(m_i - m_max) and merged, either by the last CTA of each group
    in the same launch (fused plans) or by a second kernel (two-launch plans); the tuned table
    picks per problem, always in a fixed order (bitwise reproducible).

    Parameters
    ----------
    q : array [B, Hq, D]
        The new token's queries. fp16, bf16 or fp32. NumPy, CuPy or torch (CUDA).
    k_cache, v_cache : array [B, N_max, Hkv, D] for ``kv_layout="NHD"`` (flash-attn/FlashInfer
        convention) or [B, Hkv, N_max, D] for ``"HND"``
        q's dtype and array type, or FP8 codes (quantised caches: ``kv_dtype``). Hq must be a
        multiple of Hkv (MHA, GQA, MQA). D in {64, 96, 128, 256}. Device arrays need a unit
        stride in D and 16-byte aligned pointers and strides (any other strides are read as
        given).
    cache_seqlens : int32 array [B] or None
        (NumPy: any integer dtype; CuPy / torch: int32; not a list.) Valid length of each
        request (0 <= len <= N_max); ``None`` means N_max for all. A request of length 0 yields
        zeros and lse = -inf. NumPy lengths (and device lengths under
        :func:`set_checks`) are checked on the host and a bad one raises ValueError; device
        lengths are otherwise not synchronised to the host: a request whose length is outside
        [0, N_max] gets NaN output and lse, and the cache is never read out of bounds.
    softmax_scale : float, optional
        Defaults to 1/sqrt(D).
    kv_layout : {"NHD", "HND"}
    num_splits : int, optional
        Number of KV chunks per request (1..1024). ``None``: the tuned table for this GPU and
        problem, else a heuristic (about one CTA per SM, chunks >= 64 tokens, no split once
        batch x head groups (at most 8 query heads of a KV head per CTA) reach half the SM
        count). 1: one pass, no combine launch. The chunk is ceil(N_max / num_splits) tokens, so
        fewer splits than asked run when N_max is small.
    return_lse : bool
        Also return the log-sum-exp of the scores (natural log) so partial results can be merged.
    out : array [B, Hq, D], optional
        C-contiguous, q's dtype and array type; written in place and returned.
    batch_invariant : bool
        Results of a request bitwise identical whatever batch it is in, whatever its position
        and whatever N_max (for reproducible sampling in serving stacks): splits of a fixed 1,024
        tokens (``fdpp.configs.BATCH_INVARIANT_CHUNK``, whole pages), a kernel fixed per head
        configuration and a merge in a fixed order (:func:`fdpp.configs.batch_invariant_plan`).
        Excludes ``num_splits``. Not tuned: it may be slower than the default plan.
    kv_dtype : {None, "fp8_e4m3", "fp8_e5m2", "int4"}
        FP8 caches (q fp16 or bf16, D 64 or 128): K/V hold one-byte codes, as torch
        ``float8_e4m3fn``/``float8_e5m2`` tensors or ml_dtypes arrays (the format is read from
        the dtype) or as uint8 arrays (CuPy has no FP8 dtype), whose format ``kv_dtype`` names.
        ``"int4"`` (q fp16 or bf16, D 64 or 128): K/V are uint8 arrays of the cache's shape with
        D // 2 in the last axis, two codes a byte (element 2i in the low nibble of byte i),
        dequantised with ``k_descale``/``k_zero`` (V alike) in groups of g = D // scale.shape[-1]
        elements (g in {32, 64, 128}). :func:`fdpp.quantize_kv` makes both kinds. None: from the
        arrays' dtype.
    k_descale, v_descale : float, or float32 array [B, Hkv], [Hkv] or of one element, optional
        FP8 caches: the dequantisation scales (flash-attn's names): K[b, t, h, :] is
        ``float32(code) * k_descale[b, h]`` (V alike; [Hkv]: the same for every request). Default 1.
        Applied to the scores and the output, not per element.
        INT4 caches (required): the fp16 group scales, [B, N_max, Hkv, D // g] (NHD) or
        [B, Hkv, N_max, D // g] (HND), K[b, t, h, d] = ``float16(n * k_descale[b, t, h, d // g] +
        k_zero[b, t, h, d // g])`` with one rounding (``fdpp.quant.dequant_int4``). Unit stride in
        the last axis, 4-byte aligned rows when D // g > 1 (device arrays).
    k_zero, v_zero : fp16 array, optional
        INT4 caches (required): the group zero points, the shape of ``k_descale``. Not for FP8.
    softmax_mode : {"exact", "unified_max"}
        ``"unified_max"`` (FlashDecoding++'s unified max) starts every warp's softmax state from
        a reference fixed by the given ``unified_max`` phi, phi - 7 / log2(e) (about phi - 4.85),
        instead of from its first scores; the kernels' lazy rescale (in this mode the state moves
        only when a score passes the reference by 15 / log2(e)) then leaves it there while scores
        stay within phi +- 5.5 (8 / log2(e)). The result is the exact softmax
        either way, to rounding: the tensor-core kernels detect on the device, per warp and head,
        a score above the window (the state moves to the new max, as in exact mode) and a head
        whose first 16 scores all lie below it (the state restarts from their max), with no host
        synchronisation (graph-capturable). The CUDA-core kernels (fp32, some fp16/bf16 plans),
        the tensor-core kernels of head dim 256 (at 255 registers already) and the NumPy emulator
        compute the exact softmax and ignore phi (``fdpp.explain`` says which applies). A call runs
        the unified-max twin of the plan's tensor-core kernel (``decode_split_mma_umax``; the
        tables' exact kernels are unchanged). On the H200 it measured within run-to-run spread
        of exact mode (run R3, results/device_runR1/README.md), so nothing selects it by itself.
    unified_max : float, optional
        phi, in the scaled scores' units (softmax_scale * q.k, natural log; with a quantised cache
        the dequantised scores): required with ``softmax_mode="unified_max"``, e.g. from
        :func:`fdpp.calibrate_unified_max` on sample queries and keys of the layer. Keep it fixed
        per layer: phi is part of the launch-record key, so a new value on every call misses the
        record cache (the slower full path, and a new record each time).

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
    return _contiguous_call(decode_attention, "contiguous", q, k_cache, v_cache, cache_seqlens, softmax_scale,
                            kv_layout, _splits_arg(num_splits, batch_invariant), return_lse, out, _expect,
                            _Quant.of(kv_dtype, k_descale, v_descale, k_zero, v_zero),
                            softmax_arg(softmax_mode, unified_max))


def check_flag(name: str, value: Any) -> None:
    """A flag argument must be a bool (NumPy's too): a truthy string or array would be a silent guess."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _splits_arg(num_splits: Any, batch_invariant: Any) -> Any:
    """num_splits as the call's plan request (``BATCH_INVARIANT`` for a batch-invariant call)."""
    check_flag("batch_invariant", batch_invariant)
    if not batch_invariant:
        return num_splits
    if num_splits is not None:
        raise ValueError("num_splits and batch_invariant=True exclude each other (the batch-invariant "
                         "plan fixes the split size)")
    return BATCH_INVARIANT


def paged_decode_attention(q: Any, k_pages: Any, v_pages: Any, block_table: Any, cache_seqlens: Any, *,
                           softmax_scale: float | None = None, num_splits: int | None = None,
                           return_lse: bool = False, out: Any = None, kv_layout: str = "NHD",
                           batch_invariant: bool = False, kv_dtype: str | None = None, k_descale: Any = None,
                           v_descale: Any = None, k_zero: Any = None, v_zero: Any = None,
                           softmax_mode: str = "exact", unified_max: float | None = None,
                           _expect: DecodeProblem | None = None) -> Any:
    """Decode attention over a paged KV cache (vLLM / flash-attn ``block_table`` convention).

    Parameters
    ----------
    q : array [B, Hq, D]
        fp16, bf16 or fp32; NumPy, CuPy or torch (CUDA).
    k_pages, v_pages : array [num_pages, page_size, Hkv, D] for ``kv_layout="NHD"`` or
        [num_pages, Hkv, page_size, D] for ``"HND"`` (FlashInfer's HND)
        The page pool, q's dtype or FP8 codes (``kv_dtype``), or INT4 code pairs (uint8, D // 2
        in the last axis; the scale / zero pools ``k_descale``, ``k_zero``, ``v_descale``,
        ``v_zero`` are [num_pages, page_size, Hkv, D // g] / [num_pages, Hkv, page_size, D // g],
        as ``PagedKVCache.k_scale_pages`` etc.). page_size is any power of two
        from 1 to 256. Strides are
        honoured (unit stride in D, 16-byte aligned), so the K and V halves of a combined
        ``[num_pages, 2, page_size, Hkv, D]`` tensor can be passed as views.
    block_table : int32 array [B, max_pages_per_seq]
        (NumPy: any integer dtype; CuPy / torch: int32.) Row b lists the pages of request b in
        order: token t lives in page ``block_table[b, t // page_size]`` at slot
        ``t % page_size``. Only the first ceil(len_b / page_size) entries of a row are read.
    cache_seqlens : int32 array [B]
        Tokens of each request, 0 <= len <= N_max = max_pages_per_seq * page_size.
    softmax_scale, num_splits, return_lse, out, batch_invariant, kv_dtype, k_descale, v_descale, k_zero, v_zero, softmax_mode, unified_max
        As in :func:`decode_attention`. Splits cover whole pages; the chunk follows N_max, so size
        the block table to the batch's longest request.

    Returns
    -------
    out : array [B, Hq, D] (and lse float32 [B, Hq] with ``return_lse=True``)

    Notes
    -----
    Device values are not synchronised to the host: a block-table entry outside
    [0, num_pages) among the pages a request uses, or a length outside [0, N_max], never reads
    outside the pool; that request's output and lse are NaN. :func:`set_checks` (or
    ``FDPP_CHECKS=1``) validates both on the host first and raises ValueError naming the
    request (this synchronises, so not inside a graph capture). NumPy inputs are always checked
    and run on the GPU when there is one, else in the NumPy emulator.
    """
    quant = _Quant.of(kv_dtype, k_descale, v_descale, k_zero, v_zero)
    arrays = (q, k_pages, v_pages, cache_seqlens, block_table, *quant.arrays())  # DecodeParams' pointer order
    num_splits = _splits_arg(num_splits, batch_invariant)
    umax = softmax_arg(softmax_mode, unified_max)
    key = ("paged", softmax_scale, kv_layout, num_splits, return_lse, _expect, quant.key(), umax)
    res = _fast(key, arrays, out)
    if res is not _MISS:
        return res
    check_flag("return_lse", return_lse)  # past the fast path: a key it matched held a checked value
    kind, prob, views, cache = _check_paged(q, k_pages, v_pages, block_table, cache_seqlens, softmax_scale,
                                            kv_layout, num_splits, out, quant)
    _check_plan(_expect, prob)
    if kind == "numpy":
        return _numpy_call(paged_decode_attention, (q, k_pages, v_pages, block_table, cache_seqlens),
                           dict(kv_layout=kv_layout), softmax_scale, num_splits, return_lse, out, prob, False,
                           quant, umax)
    return _run(key, arrays, kind, views, cache, prob, softmax_scale, num_splits, return_lse, out, _expect, umax)


def decode_attention_nosplit(q: Any, k_cache: Any, v_cache: Any, *, cache_seqlens: Any = None,
                             softmax_scale: float | None = None, kv_layout: str = "NHD",
                             return_lse: bool = False, out: Any = None) -> Any:
    """Baseline: the same attention with grid B x Hq and no sequence split (FlashAttention-2-style
    decode). One CTA per query head reads its KV head's whole cache, so at small batch most SMs
    idle. Takes q, k_cache, v_cache, cache_seqlens, softmax_scale, kv_layout, return_lse and out
    as :func:`decode_attention` and returns what it returns; unquantised caches only, no
    num_splits / batch_invariant / softmax_mode. GPU only: without one it raises RuntimeError."""
    return _contiguous_call(decode_attention_nosplit, "nosplit", q, k_cache, v_cache, cache_seqlens,
                            softmax_scale, kv_layout, None, return_lse, out, None)


def _contiguous_call(fn: Any, tag: str, q: Any, k: Any, v: Any, lens: Any, softmax_scale: Any, kv_layout: Any,
                     num_splits: Any, return_lse: bool, out: Any, expect: DecodeProblem | None,
                     quant: _Quant = _NO_QUANT, umax: float | None = None) -> Any:
    """decode_attention (``tag`` "contiguous") and its no-split baseline ("nosplit")."""
    arrays = (q, k, v, lens, None, *quant.arrays())
    key = (tag, softmax_scale, kv_layout, num_splits, return_lse, expect, quant.key(), umax)
    res = _fast(key, arrays, out)
    if res is not _MISS:
        return res
    check_flag("return_lse", return_lse)  # past the fast path: a key it matched held a checked value
    kind, prob, views, cache = _check_contiguous(q, k, v, lens, softmax_scale, kv_layout, num_splits, out, quant)
    _check_plan(expect, prob)
    if tag == "nosplit" and prob.quantized:
        raise TypeError("decode_attention_nosplit (the baseline) reads unquantised caches only")
    if kind == "numpy":
        return _numpy_call(fn, (q, k, v), dict(cache_seqlens=lens, kv_layout=kv_layout), softmax_scale,
                           num_splits, return_lse, out, prob, tag == "nosplit", quant, umax)
    return _run(key, arrays, kind, views, cache, prob, softmax_scale, num_splits, return_lse, out, expect, umax)


def _check_plan(expect: DecodeProblem | None, prob: DecodeProblem) -> None:
    """A DecodePlan's run: the arrays must give the problem it was planned for."""
    if expect is not None and expect != prob:
        raise ValueError(f"the arrays do not match the plan: the plan is for {expect}, the arrays give {prob}")


def _scale(prob: DecodeProblem, softmax_scale: Any) -> float:
    return 1.0 / math.sqrt(prob.head_dim) if softmax_scale is None else float(softmax_scale)


# ---- device calls: launch records (fdpp.plan) --------------------------------------------
_MISS = object()
_KINDS: dict[type, str] = {}


def _record_key(key: tuple, kind: str, arrays: tuple, out: Any) -> tuple | None:
    try:
        sig = _plan.signature(kind, (*arrays, out))
    except AttributeError:  # mixed array types: the full path says which argument
        return None
    return (key, sig, *_plan.launch_env())


def _fast(key: tuple, arrays: tuple, out: Any) -> Any:
    """A call whose signature has a launch record: the pointer checks, then the launch; else
    _MISS (the full validation runs, and builds the record)."""
    q = arrays[0]
    kind = _KINDS.get(type(q))
    if kind is None:
        kind = _KINDS[type(q)] = _kind(q)
    if (kind != "cupy" and kind != "torch") or _checks:
        return _MISS
    try:
        sig, ptrs = _plan.probe(kind, (*arrays, out))  # ptrs[N_IN]: out's, or 0
    except AttributeError:  # mixed array types: the full path says which argument
        return _MISS
    rec = _plan.lookup((key, sig, *_plan.launch_env()))
    if rec is None or not rec.pointers_ok(ptrs, ptrs[_plan.N_IN]):
        return _MISS  # no record; or misaligned or overlapping: the full path raises the precise error
    return rec.run(ptrs, q, out)


def _run(key: tuple, arrays: tuple, kind: str, views: dict[str, _View], cache: _Cache, prob: DecodeProblem,
         softmax_scale: Any, num_splits: Any, return_lse: bool, out: Any, expect: DecodeProblem | None,
         umax: float | None = None) -> Any:
    """The full path's launch: choose the plan, build and remember the record, run it."""
    from fdpp import dispatch, registry

    plan = _plan
    dev = views["q"].device
    if key[0] == "nosplit":
        lp = LaunchPlan((nosplit_config(prob.dtype, prob.head_dim, prob.page_size),), 1, source="baseline")
    else:
        lp = dispatch.select_plan(prob, registry.device_limits(dev), num_splits)
        if umax is not None:
            lp = lp.unified_max()  # the tensor-core kernel's unified-max twin (else exact: phi unread)
    qv = views["q"]
    strides = dict(q_sb=qv.strides[0], q_sh=qv.strides[1], k_sb=cache.k_strides[0], k_sn=cache.k_strides[1],
                   k_sh=cache.k_strides[2], v_sb=cache.v_strides[0], v_sn=cache.v_strides[1],
                   v_sh=cache.v_strides[2], bt_sb=cache.bt_sb, num_pages=cache.num_pages, **dict(cache.descale))
    paged = "k_pages" in views
    names = ("q", "k_pages" if paged else "k_cache", "v_pages" if paged else "v_cache", "", "block_table",
             *_QUANT_NAMES)
    spans = tuple(views[n].nbytes_span if n in views else 0 for n in names)  # as the pointers
    out_span = views["out"].nbytes_span if "out" in views else 0
    rec = plan.LaunchRecord(kind, prob, lp, strides, _scale(prob, softmax_scale), return_lse, dev, qv.dtype,
                            spans, out_span, umax=umax)
    rkey = _record_key(key, kind, arrays, out)
    if rkey is not None:
        plan.remember(rkey, rec)
    return rec.run(plan.pointers(kind, arrays), arrays[0], out)


def _numpy_call(fn: Any, arrays: tuple, kwargs: dict[str, Any], softmax_scale: Any, num_splits: Any,
                return_lse: bool, out: Any, prob: DecodeProblem, nosplit: bool, quant: _Quant = _NO_QUANT,
                umax: float | None = None) -> Any:
    """NumPy in, NumPy out: the same call on the GPU (through CuPy) when there is one, else the
    split-KV emulator (exact softmax: ``umax`` changes only the kernels' arithmetic)."""
    if quant.int4:
        _int4_params_finite(arrays, kwargs, prob, quant)
    if gpu_available():
        import cupy

        def dev(x: np.ndarray) -> Any:
            if prob.quantized and (get_kv_format(x.dtype) is not None or x.dtype == np.uint8):
                return cupy.asarray(np.ascontiguousarray(x).view(np.uint8))  # FP8 codes: CuPy has no FP8 type
            return cupy.asarray(np.ascontiguousarray(x, dtype=np.int32) if x.dtype.kind in "iu" else x)

        dev_arrays = [dev(np.asarray(x)) if i > 0 else cupy.asarray(x) for i, x in enumerate(arrays)]
        dev_kwargs = {k: (cupy.asarray(np.ascontiguousarray(v, dtype=np.int32)) if isinstance(v, np.ndarray) else v)
                      for k, v in kwargs.items()}
        extra = {} if nosplit else ({"batch_invariant": True} if num_splits is BATCH_INVARIANT
                                    else {"num_splits": num_splits})
        if umax is not None:
            extra.update(softmax_mode="unified_max", unified_max=umax)
        if prob.quantized:
            names = _QUANT_NAMES if quant.int4 else _QUANT_NAMES[:2]
            extra.update(kv_dtype="int4" if quant.int4 else prob.kv_dtype,
                         **{n: getattr(quant, n) if _is_scalar(getattr(quant, n)) else cupy.asarray(getattr(quant, n))
                            for n in names})
        res = fn(*dev_arrays, **dev_kwargs, softmax_scale=softmax_scale, return_lse=return_lse, **extra)
        o, lse = (res if return_lse else (res, None))
        o = cupy.asnumpy(o)
        lse = None if lse is None else cupy.asnumpy(lse)
    else:
        if nosplit:
            raise RuntimeError("decode_attention_nosplit needs a GPU (it is a GPU baseline)")
        o, lse = _emulate(arrays, kwargs, _scale(prob, softmax_scale), num_splits, prob, quant)
    if out is not None:
        out[...] = o
        o = out
    return (o, lse) if return_lse else o


def _int4_params_finite(arrays: tuple, kwargs: dict[str, Any], prob: DecodeProblem, quant: _Quant) -> None:
    """NumPy INT4 calls: the scales and zeros of every token a request reads (t < its length; [B, N,
    Hkv, G] or [B, Hkv, N, G], paged ones gathered) are finite; slots past a length may hold anything."""
    from fdpp.reference import gather_pages

    layout = kwargs["kv_layout"]
    params = tuple(np.asarray(getattr(quant, n)) for n in _QUANT_NAMES)
    if prob.paged:
        table, lens = arrays[3], arrays[4]
        params = tuple(gather_pages(x, table, lens, layout) for x in params)
    else:
        lens = kwargs["cache_seqlens"]
    for name, x in zip(_QUANT_NAMES, params, strict=True):
        tok = x if layout == "NHD" else x.swapaxes(1, 2)  # [B, N, Hkv, G]
        n = tok.shape[1]
        have = np.full(tok.shape[0], n) if lens is None else np.minimum(np.asarray(lens, dtype=np.int64), n)
        used = tok[np.arange(n)[None, :] < have[:, None]]
        if not np.isfinite(used).all():
            raise ValueError(f"{name} must be finite at the tokens a request reads (t < cache_seqlens)")


def _emulate(arrays: tuple, kwargs: dict[str, Any], scale: float, num_splits: Any,
             prob: DecodeProblem, quant: _Quant = _NO_QUANT) -> tuple[np.ndarray, np.ndarray]:
    _warn_emulator()
    from fdpp.configs import SM90, batch_invariant_plan, default_config
    from fdpp.quant import dequant_int4
    from fdpp.reference import dequant_fp8_cache, gather_pages, split_kv_emulator

    layout = kwargs["kv_layout"]
    ks, vs, kz, vz = quant.k_descale, quant.v_descale, quant.k_zero, quant.v_zero
    # Only the tokens below the longest length are read: the emulator's bits do not depend on N_max
    # (split_kv_emulator; the chunk stays the one of prob.seqlen), and a wide block table (a cache's
    # max_pages_per_seq) or a long N_max would otherwise cost time in proportion to it.
    if prob.paged:
        q, k_pages, v_pages, table, lens = arrays
        page = k_pages.shape[1] if layout == "NHD" else k_pages.shape[2]
        top = int(np.max(lens, initial=0))
        table = np.asarray(table)[:, :max(1, -(-top // page))]
        k, v = gather_pages(k_pages, table, lens, layout), gather_pages(v_pages, table, lens, layout)
        if prob.kv_dtype in INT4_FORMATS:  # the scale / zero pools are paged as the codes
            ks, vs, kz, vz = (gather_pages(np.asarray(x), table, lens, layout) for x in (ks, vs, kz, vz))
    else:
        (q, k, v), lens = arrays, kwargs["cache_seqlens"]
        if lens is not None:
            top = min(int(np.max(lens, initial=0)), prob.seqlen)
            cut = (slice(None), slice(0, top)) if layout == "NHD" else (slice(None), slice(None), slice(0, top))
            k, v = k[cut], v[cut]
            if prob.kv_dtype in INT4_FORMATS:
                ks, vs, kz, vz = (np.asarray(x)[cut] for x in (ks, vs, kz, vz))
    if prob.kv_dtype in INT4_FORMATS:  # the kernels' dequantisation (fp16 values), then the same algorithm
        g = INT4_FORMATS[prob.kv_dtype].group_size
        k, v = dequant_int4(np.asarray(k), ks, kz, g), dequant_int4(np.asarray(v), vs, vz, g)
    elif prob.quantized:  # the kernels' dequantisation, then the same split-KV algorithm
        k = dequant_fp8_cache(k, prob.kv_dtype, quant.k_descale, layout)
        v = dequant_fp8_cache(v, prob.kv_dtype, quant.v_descale, layout)
    plan = default_config(prob, SM90)
    if num_splits is BATCH_INVARIANT:
        plan = batch_invariant_plan(prob, SM90)
    elif num_splits is not None:
        plan = LaunchPlan.split_kv(replace(plan.split, cluster=1), int(num_splits), source="user")
    o32, lse32 = split_kv_emulator(q, k, v, lens, scale, layout, chunk=plan.chunk(prob.seqlen))
    return o32.astype(q.dtype), lse32.astype(np.float32)
