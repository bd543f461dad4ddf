"""Quantized KV caches: formats, quantizers and dequantizers (NumPy, CuPy, torch).

Formats (``fmt``, a string)
---------------------------
``"fp8_e4m3"``
    One byte per element, OCP FP8 E4M3FN (``ml_dtypes.float8_e4m3fn`` / ``torch.float8_e4m3fn``):
    bias 7, max 448, no infinities, NaN = 0x7f / 0xff.
``"fp8_e5m2"``
    One byte per element, ``ml_dtypes.float8_e5m2`` / ``torch.float8_e5m2``: bias 15, max 57344.

    FP8 scales are float32 *descales*, separate for K and V (``k_descale``, ``v_descale``, the
    flash-attn names): shape ``[B, Hkv]`` (``scale="per_head"``, default: one per request and KV
    head) or ``[]`` (a 0-d array, ``scale="per_tensor"``). The dequantized value of code c is
    ``float32(fp8 value of c) * descale``, one float32 rounding.

    Quantization: ``descale = amax / FP8_MAX`` in float32 (IEEE division), amax = max |x| over
    the scale's domain (per head: every token and every element of head_dim of that request and
    KV head; only the first ``cache_seqlens[b]`` tokens when lengths are given); ``descale = 1``
    where amax == 0, and at least the smallest positive float32 (2^-149) elsewhere (a float32 amax
    below 448 * 2^-149 would otherwise give descale 0 and NaN codes); a non-finite amax raises
    ValueError. The code of x is the round-to-nearest-
    even FP8 value of ``clip(float32(x) / descale, -FP8_MAX, FP8_MAX)`` (IEEE float32 division;
    fp16/bf16 convert to float32 exactly). Tokens past ``cache_seqlens[b]`` are quantized with the
    same descale (saturating).
``"int4"``
    Two elements a byte along head_dim (uint8 ``[..., D // 2]``): element 2i in the LOW nibble of
    byte i, element 2i + 1 in the high nibble. Asymmetric, one fp16 ``scale`` and one fp16 ``zero``
    per (request, token, KV head, group of ``group_size`` consecutive elements of head_dim),
    ``group_size`` in {32, 64, 128}, arrays ``[B, N, Hkv, D // g]`` (NHD) or ``[B, Hkv, N, D // g]``
    (HND), the cache's layout with D // g in the last axis.

    Quantization of a group with max ``mx`` and min ``mn`` (float32): ``scale = fp16((mx - mn) /
    15)`` (float32 subtraction and division, then round to nearest even fp16; 1.0 if that is 0),
    ``zero = fp16(mn)`` (KIVI's choice: the group minimum; +0 for a zero minimum); code ``n = clip(rint((x - zero) /
    scale), 0, 15)`` computed in float32 with the fp16-rounded scale and zero (NaN -> 0).

    Dequantization (the bits every kernel must reproduce): ``float16(n * scale + zero)`` with the
    product and the sum exact and one final rounding to fp16 -- what ``hfma2`` / ``fma.rn.f16``
    computes; NumPy computes it in float64 (exact there) and rounds once with ``astype(float16)``.

Array types
-----------
``quantize_kv`` returns arrays of its input's type: NumPy FP8 codes are ``ml_dtypes`` float8
arrays, torch FP8 codes torch float8 tensors, CuPy FP8 codes uint8 arrays (CuPy has no fp8 dtype);
INT4 codes are uint8 everywhere; scales float32 (FP8) / float16 (INT4). Device inputs are
quantized by ``kernels_cu/quantize_kv.cu`` on the array type's current stream, with no host
synchronisation (unless ``fdpp.set_checks(True)``, which validates ``cache_seqlens`` and the
descales on the host).

The NumPy bit-level mirror of the kernels' float32 -> FP8 conversion is :func:`fp8_encode_bits`
(integer operations only; ``tests/test_quant_cpu.py`` checks it against ml_dtypes); the CUDA code in
``kernels_cu/quant.cuh`` is a line-by-line transcription of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fdpp.dtypes import DTYPES, KV_FORMATS, get_dtype
from fdpp.launch import ParamStruct

SOURCE = "quantize_kv.cu"
FORMATS = ("fp8_e4m3", "fp8_e5m2", "int4")
FP8_FORMATS = tuple(KV_FORMATS)
#: Format ids of the kernels' FMT template parameter (kernels_cu/quant.cuh: KV_FP8_E4M3, ...).
FORMAT_IDS = {"fp8_e4m3": 1, "fp8_e5m2": 2, "int4": 3}
SCALE_MODES = ("per_head", "per_tensor")
GROUP_SIZES = (32, 64, 128)
KV_LAYOUTS = ("NHD", "HND")
AMAX_THREADS = 256  # kernels_cu/quantize_kv.cu
QUANT_THREADS = 128
AMAX_MAX_SPLITS = 64  # token chunks per (request, KV head) of the fp8 amax pass (grid.z)
AMAX_VECS_PER_THREAD = 16  # at least this many 8-element vectors per amax thread


def amax_splits(seqlen: int, head_dim: int) -> int:
    """Token chunks per (request, KV head) of ``kv_amax``: enough blocks to fill the GPU at B = 1
    (each thread reading >= AMAX_VECS_PER_THREAD vectors), at most AMAX_MAX_SPLITS."""
    vecs = seqlen * (head_dim // 8)
    return max(1, min(AMAX_MAX_SPLITS, vecs // (AMAX_THREADS * AMAX_VECS_PER_THREAD), seqlen))


@dataclass(frozen=True)
class Fp8Format:
    """Constants of one FP8 format (mirrors ``Fp8Traits`` in kernels_cu/quant.cuh)."""

    name: str
    np_dtype: np.dtype  # the ml_dtypes float8 dtype
    mant: int  # mantissa bits
    bias: int
    max: float
    max_code: int  # code of +max
    nan_code: int  # code of +NaN (what ml_dtypes produces)

    @property
    def max_bits(self) -> int:
        """float32 bits of ``max``."""
        return int(np.float32(self.max).view(np.uint32))


#: The bit-level constants of each format; its dtype and max come from fdpp.dtypes.KV_FORMATS,
#: the one table of K/V formats (the attention kernels' element types).
FP8: dict[str, Fp8Format] = {
    name: Fp8Format(name, KV_FORMATS[name].np_dtype, mant, bias, KV_FORMATS[name].max, max_code, nan_code)
    for name, mant, bias, max_code, nan_code in (("fp8_e4m3", 3, 7, 0x7E, 0x7F), ("fp8_e5m2", 2, 15, 0x7B, 0x7E))
}


def _fp8(fmt: Any) -> Fp8Format:
    if not isinstance(fmt, str) or fmt not in FP8:
        raise ValueError(f"fmt must be one of {FP8_FORMATS} for an fp8 operation, got {fmt!r}")
    return FP8[fmt]


# ---- bit-level mirrors of kernels_cu/quant.cuh ------------------------------------------------
def fp8_encode_bits(x: np.ndarray, fmt: str) -> np.ndarray:
    """float32 -> FP8 codes with integer bit operations: the algorithm of ``f32_to_fp8``.

    Round to nearest even; ``|x| >= FP8_MAX`` (infinities included) saturates to +-FP8_MAX, so the
    result equals ``ml_dtypes`` ``astype`` of ``clip(x, -FP8_MAX, FP8_MAX)``; NaN gives
    ``sign | nan_code`` (ml_dtypes' NaN); the sign of zero is kept.

    Parameters
    ----------
    x : array of float32, any shape
    fmt : {"fp8_e4m3", "fp8_e5m2"}

    Returns
    -------
    uint8 array, the shape of ``x``.
    """
    t = _fp8(fmt)
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    sign = (u >> 24) & np.uint32(0x80)
    a = u & np.uint32(0x7FFFFFFF)
    out = np.empty(u.shape, dtype=np.uint32)
    is_nan = a > 0x7F800000
    sat = ~is_nan & (a >= t.max_bits)
    e32 = (a >> 23).astype(np.int32)
    normal = ~is_nan & ~sat & (e32 >= 127 + 1 - t.bias)
    sub = ~is_nan & ~sat & ~normal
    out[is_nan] = sign[is_nan] | t.nan_code
    out[sat] = sign[sat] | t.max_code
    # normal: drop 23 - MANT mantissa bits, rounding half to even, then rebias the exponent
    an = a[normal]
    lsb = (an >> (23 - t.mant)) & np.uint32(1)
    r = (an + np.uint32((1 << (22 - t.mant)) - 1) + lsb) >> (23 - t.mant)
    out[normal] = sign[normal] | (r - np.uint32((127 - t.bias) << t.mant))
    # subnormal (or zero) in FP8: code = m / 2^shift, rounded half to even
    shift = (151 - t.bias - t.mant) - e32[sub]
    tiny = shift > 24
    shift = np.minimum(shift, 24).astype(np.uint32)
    m = (a[sub] & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
    q = m >> shift
    rem = m & ((np.uint32(1) << shift) - np.uint32(1))
    half = np.uint32(1) << (shift - np.uint32(1))
    q = q + ((rem > half) | ((rem == half) & ((q & np.uint32(1)) == 1))).astype(np.uint32)
    out[sub] = sign[sub] | np.where(tiny, np.uint32(0), q)
    return out.astype(np.uint8)


def fp8_decode_bits(codes: np.ndarray, fmt: str) -> np.ndarray:
    """FP8 codes -> float32 with bit operations: the algorithm of ``fp8_to_f32`` (quant.cuh).

    Parameters
    ----------
    codes : uint8 array, any shape
    fmt : {"fp8_e4m3", "fp8_e5m2"}

    Returns
    -------
    float32 array, the shape of ``codes`` (NaN codes give the quiet NaN 0x7fc00000 with the sign).
    """
    t = _fp8(fmt)
    c = np.asarray(codes, dtype=np.uint8).astype(np.uint32)
    sign = (c & np.uint32(0x80)) << 24
    emax = (0x80 >> t.mant) - 1
    e = (c >> t.mant) & np.uint32(emax)
    m = c & np.uint32((1 << t.mant) - 1)
    normal = (sign | ((e + np.uint32(127 - t.bias)) << 23) | (m << (23 - t.mant))).view(np.float32)
    sub_mag = m.astype(np.float32) * np.float32(2.0 ** (1 - t.bias - t.mant))
    sub = np.where(sign != 0, -sub_mag, sub_mag)
    out = np.where(e == 0, sub, normal).astype(np.float32)
    if fmt == "fp8_e4m3":
        nan = (e == emax) & (m == (1 << t.mant) - 1)
        special = (sign | np.uint32(0x7FC00000)).view(np.float32)
    else:
        nan = e == emax
        special = (sign | np.where(m != 0, np.uint32(0x7FC00000), np.uint32(0x7F800000))).view(np.float32)
    return np.where(nan, special, out)


def _int4_params(mx: np.ndarray, mn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Group max / min (float32) -> (scale, zero) fp16: the algorithm of ``int4_params``."""
    with np.errstate(invalid="ignore", over="ignore"):
        d = (mx.astype(np.float32) - mn.astype(np.float32)).astype(np.float32)
        s = (d / np.float32(15.0)).astype(np.float16)
    s = np.where(s == 0, np.float16(1.0), s)
    return s, (mn.astype(np.float32) + np.float32(0)).astype(np.float16)  # -0 -> +0, as the kernels


def _int4_codes(x: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """float32 x, float32 (fp16-valued) scale / zero broadcast to x -> uint8 codes 0..15:
    ``clip(rint((x - zero) / scale), 0, 15)`` in float32, NaN -> 0 (``int4_code``)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        t = np.rint((x - zero) / scale)
        n = np.where(t >= 15, np.float32(15), np.where(t >= 0, t, np.float32(0)))
    return n.astype(np.uint8)


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """uint8 codes 0..15 ``[..., D]`` (D even) -> packed uint8 ``[..., D // 2]``: element 2i in the
    low nibble of byte i, 2i + 1 in the high nibble."""
    c = np.asarray(codes, dtype=np.uint8)
    if c.shape[-1] % 2:
        raise ValueError(f"the last axis of codes must be even, got {c.shape}")
    return (c[..., 0::2] & np.uint8(0xF)) | ((c[..., 1::2] & np.uint8(0xF)) << np.uint8(4))


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """Packed uint8 ``[..., D // 2]`` -> uint8 codes ``[..., D]`` (inverse of :func:`pack_int4`)."""
    p = np.asarray(packed, dtype=np.uint8)
    out = np.empty((*p.shape[:-1], 2 * p.shape[-1]), dtype=np.uint8)
    out[..., 0::2] = p & np.uint8(0xF)
    out[..., 1::2] = p >> np.uint8(4)
    return out


# ---- element-level dequantizers (NumPy) --------------------------------------------------------
def dequant_fp8(codes: np.ndarray, fmt: str, descale: Any) -> np.ndarray:
    """FP8 codes -> float32 values ``float32(fp8(code)) * descale`` (one float32 rounding).

    Parameters
    ----------
    codes : uint8 array or ml_dtypes float8 array (of ``fmt``), any shape
    fmt : {"fp8_e4m3", "fp8_e5m2"}
    descale : float or float32 array broadcastable to ``codes``

    Returns
    -------
    float32 array of the broadcast shape.
    """
    t = _fp8(fmt)
    c = np.asarray(codes)
    if c.dtype == np.uint8:
        c = c.view(t.np_dtype)
    elif c.dtype != t.np_dtype:
        raise TypeError(f"codes must be uint8 or {t.np_dtype} for fmt={fmt!r}, got {c.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):
        return c.astype(np.float32) * np.asarray(descale, dtype=np.float32)


def dequant_int4(packed: np.ndarray, scale: np.ndarray, zero: np.ndarray, group_size: int) -> np.ndarray:
    """Packed INT4 -> float32 values ``float32(float16(n * scale + zero))``.

    Parameters
    ----------
    packed : uint8 array ``[..., D // 2]``
    scale, zero : float16 arrays ``[..., D // group_size]`` (same leading axes)
    group_size : int, dividing D

    Returns
    -------
    float32 array ``[..., D]``: n * scale + zero computed in float64 (exact) and rounded once to
    float16, as ``hfma2`` does.
    """
    n = unpack_int4(packed)
    d = n.shape[-1]
    g = int(group_size)
    sc, zp = np.asarray(scale), np.asarray(zero)
    if d % g or sc.shape != (*n.shape[:-1], d // g) or zp.shape != sc.shape:
        raise ValueError(f"scale and zero must have shape {(*n.shape[:-1], d // g if d % g == 0 else '?')} "
                         f"for packed {np.shape(packed)} and group_size {g} (D = {d}), got {sc.shape}, {zp.shape}")
    s64 = np.repeat(sc.astype(np.float16).astype(np.float64), g, axis=-1)
    z64 = np.repeat(zp.astype(np.float16).astype(np.float64), g, axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        return (n.astype(np.float64) * s64 + z64).astype(np.float16).astype(np.float32)


# ---- the quantized cache -----------------------------------------------------------------------
@dataclass(frozen=True)
class QuantizedKV:
    """A quantized contiguous KV cache (what :func:`quantize_kv` returns).

    Attributes
    ----------
    fmt : {"fp8_e4m3", "fp8_e5m2", "int4"}
    k, v : array
        fp8: ``[B, N, Hkv, D]`` (NHD) / ``[B, Hkv, N, D]`` (HND) codes -- ml_dtypes float8 (NumPy),
        torch float8 (torch), uint8 (CuPy). int4: uint8 ``[..., D // 2]`` packed (low nibble first).
    k_descale, v_descale : float32 array ``[B, Hkv]`` or ``[]`` (fp8 only; else None)
    k_scale, k_zero, v_scale, v_zero : float16 array ``[B, N, Hkv, D // g]`` / ``[B, Hkv, N, D // g]``
        (int4 only; else None)
    group_size : int or None (int4)
    kv_layout : {"NHD", "HND"}
    """

    fmt: str
    k: Any
    v: Any
    k_descale: Any = None
    v_descale: Any = None
    k_scale: Any = None
    k_zero: Any = None
    v_scale: Any = None
    v_zero: Any = None
    group_size: int | None = None
    kv_layout: str = "NHD"

    @property
    def head_dim(self) -> int:
        d = int(self.k.shape[-1])
        return 2 * d if self.fmt == "int4" else d


# ---- argument checks ---------------------------------------------------------------------------
def _kind(x: Any) -> str:
    from fdpp.api import _kind as kind

    return kind(x)


def _check_fmt(fmt: Any) -> str:
    if not isinstance(fmt, str):
        raise TypeError(f"fmt must be a string, one of {FORMATS}, got {type(fmt).__name__}")
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    return fmt


def check_group_size(group_size: Any, head_dim: int) -> int:
    """``group_size`` is one of GROUP_SIZES and divides ``head_dim``; returns it as an int."""
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
        raise TypeError(f"group_size must be an int, one of {GROUP_SIZES}, got {type(group_size).__name__}")
    g = int(group_size)
    if g not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {g}")
    if head_dim % g:
        raise ValueError(f"group_size {g} does not divide head_dim {head_dim}")
    return g


def _np_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _check_inputs(k: Any, v: Any, fmt: str, scale: Any, group_size: Any, kv_layout: Any) -> tuple[str, Any, int | None]:
    """-> (array kind, fdpp dtype entry, group size or None)."""
    if not isinstance(scale, str) or scale not in SCALE_MODES:
        raise ValueError(f"scale must be one of {SCALE_MODES}, got {scale!r}")
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    kind = _kind(k)
    if kind == "other":
        raise TypeError(f"k must be a NumPy array, CuPy array or torch tensor, got {type(k).__name__}")
    kv = _kind(v)
    if kv == "other":
        raise TypeError(f"v must be a NumPy array, CuPy array or torch tensor, got {type(v).__name__}")
    if kv != kind:
        raise TypeError(f"v must be the same array type as k ({kind}), got {type(v).__module__}.{type(v).__name__}")
    if kind == "torch":
        for name, x in (("k", k), ("v", v)):
            if not x.is_cuda:
                raise TypeError(f"{name}: torch tensors must be on a CUDA device (got a CPU tensor); "
                                "pass NumPy arrays for host data")
        if k.device != v.device:
            raise ValueError(f"k and v must be on one device, got {k.device} and {v.device}")
    elif kind == "cupy" and k.device.id != v.device.id:
        raise ValueError(f"k and v must be on one device, got {k.device.id} and {v.device.id}")
    try:
        dt = get_dtype(k.dtype)
    except TypeError:
        raise TypeError(f"k dtype must be one of {sorted(DTYPES)}, got {k.dtype}") from None
    try:
        dv = get_dtype(v.dtype)
    except TypeError:
        raise TypeError(f"v dtype must be one of {sorted(DTYPES)}, got {v.dtype}") from None
    if dv != dt:
        raise TypeError(f"v dtype {v.dtype} must match k dtype {k.dtype}")
    want = "[B, N, Hkv, D]" if kv_layout == "NHD" else "[B, Hkv, N, D]"
    ks, vs = tuple(k.shape), tuple(v.shape)
    if len(ks) != 4:
        raise ValueError(f"k must have shape {want} (kv_layout={kv_layout!r}), got {ks}")
    if len(vs) != 4:
        raise ValueError(f"v must have shape {want} (kv_layout={kv_layout!r}), got {vs}")
    if ks != vs:
        raise ValueError(f"k and v must have the same shape, got {ks} and {vs}")
    if min(ks) < 1:
        raise ValueError(f"k must have no empty axis, got shape {ks}")
    d = ks[3]
    if fmt == "int4":
        return kind, dt, check_group_size(group_size, d)
    if d % 8:
        raise ValueError(f"head_dim (last axis of k) must be a multiple of 8, got {d}")
    return kind, dt, None


def _dims(shape: Sequence[int], kv_layout: str) -> tuple[int, int, int, int]:
    """(B, N, Hkv, D) of a cache shape."""
    if kv_layout == "NHD":
        b, n, h, d = shape
    else:
        b, h, n, d = shape
    return int(b), int(n), int(h), int(d)


def _host_lengths(cache_seqlens: Any, b: int, n: int) -> np.ndarray | None:
    if cache_seqlens is None:
        return None
    if _kind(cache_seqlens) in ("cupy", "torch"):
        raise TypeError("cache_seqlens must be a NumPy array or sequence of ints for NumPy k/v, got a "
                        f"{type(cache_seqlens).__module__} array")
    lens = np.asarray(cache_seqlens)
    if lens.dtype.kind not in "iu":
        raise TypeError(f"cache_seqlens must be an integer array, got dtype {lens.dtype}")
    if lens.shape != (b,):
        raise ValueError(f"cache_seqlens must have shape [B] = ({b},), got {lens.shape}")
    if lens.size and (int(lens.min()) < 0 or int(lens.max()) > n):
        raise ValueError(f"cache_seqlens values must be in [0, N] = [0, {n}], got {lens.min()}..{lens.max()}")
    return lens.astype(np.int64)


def _valid_tokens(lens: np.ndarray | None, b: int, n: int, kv_layout: str) -> np.ndarray:
    """bool mask broadcastable to the cache: token n of request b is below cache_seqlens[b]."""
    if lens is None:
        m = np.ones((b, n), dtype=bool)
    else:
        m = np.arange(n)[None, :] < lens[:, None]
    return m[:, :, None, None] if kv_layout == "NHD" else m[:, None, :, None]


# ---- NumPy quantization ------------------------------------------------------------------------
def _to_f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def fp8_quantize(x: np.ndarray, fmt: str, descale: Any) -> np.ndarray:
    """Elements -> FP8 codes ``fp8(clip(float32(x) / descale, -FP8_MAX, FP8_MAX))`` (IEEE float32
    division, round to nearest even, via ml_dtypes; equal to the kernels' ``f32_to_fp8``).

    Parameters
    ----------
    x : fp16 / bf16 / fp32 array, any shape
    fmt : {"fp8_e4m3", "fp8_e5m2"}
    descale : float32 array broadcastable to ``x`` (or a float)

    Returns
    -------
    ml_dtypes float8 array of ``fmt``, the broadcast shape.
    """
    t = _fp8(fmt)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        y = np.clip(_to_f32(x) / np.asarray(descale, dtype=np.float32), np.float32(-t.max), np.float32(t.max))
    return y.astype(t.np_dtype)


def int4_quantize(x: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Elements -> INT4 (packed, scale, zero), asymmetric per group of ``group_size`` along the
    last axis (the rounding of the module docstring; equal to the kernels' bits).

    Parameters
    ----------
    x : fp16 / bf16 / fp32 array ``[..., D]``, D a multiple of ``group_size``
    group_size : int

    Returns
    -------
    packed : uint8 ``[..., D // 2]`` (element 2i in the low nibble of byte i)
    scale, zero : float16 ``[..., D // group_size]``
    """
    x32 = _to_f32(x)
    d, g = x32.shape[-1], int(group_size)
    if d % g:
        raise ValueError(f"group_size {g} does not divide head_dim {d}")
    xg = x32.reshape(*x32.shape[:-1], d // g, g)
    scale, zero = _int4_params(xg.max(axis=-1), xg.min(axis=-1))
    codes = _int4_codes(xg, scale[..., None].astype(np.float32), zero[..., None].astype(np.float32))
    return pack_int4(codes.reshape(x32.shape)), scale, zero


def _nonfinite_fp8(name: str, what: str) -> str:
    """The error for inf / NaN where an FP8 scale is computed: a KV tensor's (per head or tensor),
    or quantize_weight's w (one scale per row)."""
    if name == "w":
        return "w holds non-finite values (inf or NaN) in a row: no finite fp8 w_scale exists for it"
    return (f"{name} holds non-finite values (inf or NaN) among the tokens its {what} scale covers: "
            "no finite fp8 descale exists")


def _fp8_quantize_np(x: np.ndarray, name: str, t: Fp8Format, per_tensor: bool, valid: np.ndarray,
                     kv_layout: str) -> tuple[np.ndarray, np.ndarray]:
    x32 = _to_f32(x)
    with np.errstate(invalid="ignore"):
        mag = np.where(valid, np.abs(x32), np.float32(0))
    axes = (1, 3) if kv_layout == "NHD" else (2, 3)
    amax = mag.max(axis=axes, initial=np.float32(0)).astype(np.float32)  # [B, Hkv]
    if per_tensor:
        amax = np.asarray(amax.max(initial=np.float32(0)), dtype=np.float32)
    if not np.all(np.isfinite(amax)):
        raise ValueError(_nonfinite_fp8(name, "per-tensor" if per_tensor else "per-head"))
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)  # 2^-149: never a zero descale
    descale = np.where(amax == 0, np.float32(1), np.maximum(amax / np.float32(t.max), tiny)).astype(np.float32)
    if per_tensor:
        d = descale.reshape(1, 1, 1, 1)
    else:
        d = descale[:, None, :, None] if kv_layout == "NHD" else descale[:, :, None, None]
    return fp8_quantize(x32, t.name, d), np.asarray(descale, dtype=np.float32)


def int4_groups_bad(scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """Groups whose dequantised levels are not all finite: a non-finite scale or zero, or a top level
    float16(15 * scale + zero) past float16's range (values near +-65504 round the scale up)."""
    s, z = np.asarray(scale, np.float64), np.asarray(zero, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        top = (15.0 * s + z).astype(np.float16)  # exact in float64, then the kernels' one rounding
    return ~(np.isfinite(s) & np.isfinite(z) & np.isfinite(top))


INT4_RANGE = "values whose int4 scale, zero or top level overflows float16 (|x| near or past 65504)"


def _int4_quantize_np(x: np.ndarray, name: str, g: int, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    packed, scale, zero = int4_quantize(x, g)
    bad = int4_groups_bad(scale, zero) & valid
    if bad.any():
        raise ValueError(f"{name} holds non-finite values, or {INT4_RANGE}, in {int(bad.sum())} groups")
    return packed, scale, zero


def _quantize_numpy(k: Any, v: Any, fmt: str, scale: str, g: int | None, kv_layout: str,
                    cache_seqlens: Any, names: tuple[str, str] = ("k", "v")) -> QuantizedKV:
    b, n, _, _ = _dims(k.shape, kv_layout)
    lens = _host_lengths(cache_seqlens, b, n)
    valid = _valid_tokens(lens, b, n, kv_layout)
    if fmt == "int4":
        assert g is not None
        kq, ks, kz = _int4_quantize_np(k, names[0], g, valid)
        vq, vs, vz = _int4_quantize_np(v, names[1], g, valid)
        return QuantizedKV(fmt, kq, vq, k_scale=ks, k_zero=kz, v_scale=vs, v_zero=vz, group_size=g,
                           kv_layout=kv_layout)
    t = FP8[fmt]
    kq, kd = _fp8_quantize_np(k, names[0], t, scale == "per_tensor", valid, kv_layout)
    vq, vd = _fp8_quantize_np(v, names[1], t, scale == "per_tensor", valid, kv_layout)
    return QuantizedKV(fmt, kq, vq, k_descale=kd, v_descale=vd, kv_layout=kv_layout)


# ---- public API --------------------------------------------------------------------------------
def quantize_kv(k: Any, v: Any, fmt: str = "fp8_e4m3", *, scale: str = "per_head", group_size: int = 64,
                kv_layout: str = "NHD", cache_seqlens: Any = None) -> QuantizedKV:
    """Quantize a contiguous KV cache to FP8 or INT4.

    Parameters
    ----------
    k, v : array ``[B, N, Hkv, D]`` (``kv_layout="NHD"``) or ``[B, Hkv, N, D]`` (``"HND"``)
        fp16, bf16 or fp32, one dtype and shape; NumPy arrays, CuPy arrays or torch CUDA tensors
        (one array type and device). Not modified. fp8: D a multiple of 8. Device arrays need a
        unit stride in D (others are copied first).
    fmt : {"fp8_e4m3", "fp8_e5m2", "int4"}
    scale : {"per_head", "per_tensor"}
        fp8 descale granularity: one per (request, KV head), ``[B, Hkv]``, or one per tensor,
        ``[]``; separate for K and V. int4 does not use it (it must still be one of the two).
    group_size : {32, 64, 128}
        int4: elements of head_dim per scale / zero (must divide D). Ignored by fp8.
    kv_layout : {"NHD", "HND"}
    cache_seqlens : int array ``[B]``, optional
        Valid tokens per request, in [0, N]: fp8 amax is taken over tokens ``< cache_seqlens[b]``
        only (all N when None); tokens past it are still quantized (with that descale,
        saturating). int4 scales are per token, so it only limits the non-finite check. NumPy
        (or a sequence) for NumPy k/v; a device int array (or NumPy, uploaded) for device k/v.

    Returns
    -------
    QuantizedKV
        Arrays of the input's array type and layout (see the module docstring for dtypes and the
        exact rounding).

    Raises
    ------
    TypeError, ValueError
        Naming the argument: bad fmt, scale mode, group size (or one not dividing head_dim),
        dtype, shapes, k/v mismatch, array types; ValueError when an fp8 scale's domain holds a
        non-finite value or an int4 group's scale / zero is not finite (NumPy always; device
        arrays only with ``fdpp.set_checks(True)``: without it, no host synchronisation happens
        and a non-finite amax gives a non-finite descale).
    """
    fmt = _check_fmt(fmt)
    kind, dt, g = _check_inputs(k, v, fmt, scale, group_size, kv_layout)
    if kind == "numpy":
        return _quantize_numpy(k, v, fmt, scale, g, kv_layout, cache_seqlens)
    return _quantize_device(kind, k, v, fmt, scale, g, kv_layout, cache_seqlens, dt)


#: Largest order :func:`hadamard` builds (64 MiB of float32; heads are 64-256).
HADAMARD_MAX = 1 << 12


def hadamard(head_dim: int, like: Any = None) -> Any:
    """The orthonormal Hadamard matrix of order ``head_dim`` (Sylvester's construction), float32.

    A rotation for quantized K caches: ``q @ H`` and ``k @ H`` have the same dot products as q and
    k (``H @ H.T = I``; this H is symmetric, so ``H @ H = I`` too), and K's outlier channels (the
    few channels of large magnitude real models' K has) are spread over every channel, so the
    per-token FP8 / INT4 scales no longer fit a handful of channels at the cost of the rest.
    Rotate K before :func:`quantize_kv` (or before ``PagedKVCache.append``) and q before every
    attention call that reads that cache; V and the output are not rotated. No kernel changes: the
    kernels see an ordinary cache. Multiply in float32 and round once to the cache's dtype (an fp16
    H would scale every score by its rounding of ``head_dim ** -0.5``). ``results/kv_accuracy/``
    measures what it does to the attention output (INT4 and FP8, Gaussian and outlier-channel K).

    Parameters
    ----------
    head_dim : int, a power of two up to :data:`HADAMARD_MAX` (64, 128 and 256 are the heads of
        current models).
    like : optional NumPy / CuPy array or torch tensor: the result is of its array type, on its
        device (float32 whatever its dtype); None: NumPy.

    Returns
    -------
    H : float32 ``[head_dim, head_dim]``, entries ``+-head_dim ** -0.5``.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)):
        raise TypeError(f"head_dim must be an int, got {type(head_dim).__name__}")
    d = int(head_dim)
    if d < 1 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two (Sylvester's Hadamard matrices), got {d}")
    if d > HADAMARD_MAX:
        raise ValueError(f"head_dim must be at most {HADAMARD_MAX} (a head, not a hidden size), got {d}")
    kind = "numpy" if like is None else _kind(like)
    if kind not in ("numpy", "cupy", "torch"):
        raise TypeError(f"like must be a NumPy, CuPy or torch array (or None), got {type(like).__name__}")
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    h = (h / np.sqrt(d)).astype(np.float32)
    if kind == "numpy":
        return h
    if kind == "cupy":
        import cupy as cp

        with cp.cuda.Device(like.device.id):
            return cp.asarray(h)
    if kind == "torch":
        import torch

        return torch.from_numpy(h).to(like.device)


def quantize_weight(w: Any, fmt: str = "fp8_e4m3") -> tuple[Any, Any]:
    """FP8 weights for :func:`fdpp.flat_gemm` (W8A16): a Linear weight ``[N, K]`` to E4M3 codes
    with one float32 scale per row (output channel).

    ``w_scale[n] = amax(|w[n, :]|) / 448`` (1.0 for an all-zero row, at least 2^-149 otherwise), ``code = fp8(clip(float32(w)
    / w_scale[n], +-448))`` rounded to nearest even: the FP8 rounding of :func:`quantize_kv` with
    ``scale="per_head"`` on ``w`` seen as ``[N, 1, 1, K]``, bit for bit.

    Parameters
    ----------
    w : array [N, K], fp16, bf16 or fp32 (NumPy, CuPy or torch CUDA); not modified.
    fmt : "fp8_e4m3"

    Returns
    -------
    (codes, w_scale): codes ``[N, K]`` (ml_dtypes float8_e4m3fn for NumPy, torch.float8_e4m3fn for
    torch, uint8 for CuPy), w_scale float32 ``[N]``, of ``w``'s array type.
    """
    if fmt != "fp8_e4m3":
        raise ValueError(f"fmt must be 'fp8_e4m3' (flat_gemm's FP8 weights), got {fmt!r}")
    if _kind(w) == "other":
        raise TypeError(f"w must be a NumPy array, CuPy array or torch tensor, got {type(w).__name__}")
    shape = tuple(w.shape)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"w must have shape [N, K] with N, K >= 1, got {shape}")
    try:
        get_dtype(w.dtype)
    except TypeError:
        raise TypeError(f"w dtype must be one of {sorted(DTYPES)}, got {w.dtype}") from None
    n, k = shape
    if k % 16:  # flat_gemm's FP8-weight kernels step through K 16 codes at a time
        raise ValueError(f"K (w's last axis) must be a multiple of 16 (flat_gemm's FP8 weights), got {k}")
    if _kind(w) == "torch" and not w.is_cuda:
        raise TypeError("w: torch tensors must be on a CUDA device (got a CPU tensor); pass NumPy arrays for host data")
    w4 = w.reshape(n, 1, 1, k)
    kind, dt, _ = _check_inputs(w4, w4, fmt, "per_head", None, "NHD")  # w's checks above leave none to fail
    if kind == "numpy":  # v is the same array: its result is dropped; errors name w
        q = _quantize_numpy(w4, w4, fmt, "per_head", None, "NHD", None, names=("w", "w"))
    else:
        q = _quantize_device(kind, w4, w4, fmt, "per_head", None, "NHD", None, dt, names=("w", "w"))
    return q.k.reshape(n, k), q.k_descale.reshape(n)


def _check_quantized(q: QuantizedKV, fmt: str, kind: str) -> None:
    """A QuantizedKV's fields agree (one may be built by hand): codes of one 4-D shape and a code
    dtype, fp8 descales float32 [B, Hkv] or [], int4 a group size and fp16 scales / zeros shaped as
    the codes with D // group_size last; TypeError / ValueError naming the field."""
    ks, vs = tuple(q.k.shape), tuple(q.v.shape)
    if len(ks) != 4 or ks != vs:
        raise ValueError(f"qkv.k and qkv.v must be 4-D codes of one shape, got {ks} and {vs}")
    b, _, h, _ = _dims(ks, q.kv_layout)
    codes = ("uint8",) if fmt == "int4" or kind == "cupy" else ("uint8", "float8_e4m3fn", "float8_e5m2")
    for name, x in (("k", q.k), ("v", q.v)):
        if _np_name(x.dtype) not in codes:
            raise TypeError(f"qkv.{name} must hold {fmt} codes ({' or '.join(codes)}), got {x.dtype}")
    if fmt != "int4":
        for name in ("k_descale", "v_descale"):
            x = getattr(q, name)
            if x is None or _kind(x) != kind:
                raise TypeError(f"qkv.{name} must be a float32 array of qkv.k's type for {fmt}, got "
                                f"{type(x).__name__}")
            if _np_name(x.dtype) != "float32":
                raise TypeError(f"qkv.{name} must be float32, got {x.dtype}")
            if tuple(x.shape) not in ((b, h), ()):
                raise ValueError(f"qkv.{name} must have shape {(b, h)} or (), got {tuple(x.shape)}")
        return
    g = check_group_size(q.group_size, 2 * ks[3])
    want = (*ks[:3], 2 * ks[3] // g)
    for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
        x = getattr(q, name)
        if x is None or _kind(x) != kind:
            raise TypeError(f"qkv.{name} must be a float16 array of qkv.k's type for int4, got {type(x).__name__}")
        if _np_name(x.dtype) != "float16":
            raise TypeError(f"qkv.{name} must be float16, got {x.dtype}")
        if tuple(x.shape) != want:
            raise ValueError(f"qkv.{name} must have shape {want} (the codes' with D // group_size last), "
                             f"got {tuple(x.shape)}")


def dequantize_kv(qkv: QuantizedKV) -> tuple[Any, Any]:
    """Dequantize a :class:`QuantizedKV` to float32 (k, v), bit for bit what the kernels compute.

    fp8: ``float32(code) * descale`` (one float32 rounding); int4: ``float32(float16(n * scale +
    zero))`` (one fp16 rounding). NumPy in, NumPy out; CuPy / torch in, the same array type out
    (one kernel launch per tensor on the current stream).

    Returns
    -------
    (k, v) : float32 arrays of the cache shape ``[B, N, Hkv, D]`` / ``[B, Hkv, N, D]``.
    """
    if not isinstance(qkv, QuantizedKV):
        raise TypeError(f"qkv must be a QuantizedKV (from fdpp.quantize_kv), got {type(qkv).__name__}")
    fmt = _check_fmt(qkv.fmt)
    if qkv.kv_layout not in KV_LAYOUTS:
        raise ValueError(f"qkv.kv_layout must be one of {KV_LAYOUTS}, got {qkv.kv_layout!r}")
    kind = _kind(qkv.k)
    if kind == "other" or _kind(qkv.v) != kind:
        raise TypeError(f"qkv.k and qkv.v must be arrays of one type, got {type(qkv.k).__name__} and "
                        f"{type(qkv.v).__name__}")
    _check_quantized(qkv, fmt, kind)
    if kind != "numpy":
        return _dequantize_device(kind, qkv)
    if fmt == "int4":
        return (dequant_int4(qkv.k, qkv.k_scale, qkv.k_zero, qkv.group_size),
                dequant_int4(qkv.v, qkv.v_scale, qkv.v_zero, qkv.group_size))
    out = []
    for codes, ds in ((qkv.k, qkv.k_descale), (qkv.v, qkv.v_descale)):
        d = np.asarray(ds, dtype=np.float32)  # [B, Hkv] or [] (_check_quantized)
        if d.ndim == 2:
            d = d[:, None, :, None] if qkv.kv_layout == "NHD" else d[:, :, None, None]
        out.append(dequant_fp8(codes, fmt, d))
    return out[0], out[1]


# ---- device kernels ----------------------------------------------------------------------------
#: Python mirror of ``fdpp::QuantKVParams`` (kernels_cu/quantize_kv.cu); strides in elements.
QUANT_PARAMS = ParamStruct("fdpp::QuantKVParams", [
    ("k_src", "ptr"), ("v_src", "ptr"), ("k_out", "ptr"), ("v_out", "ptr"),
    ("k_descale", "ptr"), ("v_descale", "ptr"), ("k_scale", "ptr"), ("v_scale", "ptr"),
    ("k_zero", "ptr"), ("v_zero", "ptr"), ("amax", "ptr"), ("seqlens", "ptr"),
    ("k_sb", "i64"), ("k_sn", "i64"), ("k_sh", "i64"), ("v_sb", "i64"), ("v_sn", "i64"), ("v_sh", "i64"),
    ("rows", "i64"), ("batch", "i32"), ("seqlen", "i32"), ("heads", "i32"), ("head_dim", "i32"),
    ("hnd", "i32"), ("per_tensor", "i32"), ("splits", "i32"), ("pad_", "i32"),
])

#: Python mirror of ``fdpp::DequantKVParams``.
DEQUANT_PARAMS = ParamStruct("fdpp::DequantKVParams", [
    ("codes", "ptr"), ("out", "ptr"), ("descale", "ptr"), ("scale", "ptr"), ("zero", "ptr"),
    ("rows", "i64"), ("seqlen", "i32"), ("heads", "i32"), ("head_dim", "i32"), ("hnd", "i32"),
    ("per_tensor", "i32"), ("pad_", "i32"),
])

@dataclass(frozen=True)
class QuantKernelConfig:
    """One kernel of kernels_cu/quantize_kv.cu (the registry's KernelConfig protocol).

    ``kernel``: kv_amax (dtype), kv_descale (fmt), quantize_fp8 (dtype, fmt), quantize_int4
    (dtype, group_size), dequant_fp8 (fmt), dequant_int4 (group_size)."""

    kernel: str
    dtype: str | None = None
    fmt: str | None = None
    group_size: int | None = None

    @property
    def source(self) -> str:
        return SOURCE

    @property
    def threads(self) -> int:
        return AMAX_THREADS if self.kernel in ("kv_amax", "kv_descale") else QUANT_THREADS

    @property
    def key(self) -> str:
        parts = [self.kernel]
        if self.dtype is not None:
            parts.append(DTYPES[self.dtype].tag)
        if self.fmt is not None:
            parts.append(self.fmt)
        if self.group_size is not None:
            parts.append(f"g{self.group_size}")
        return ".".join(parts)

    def name_expression(self) -> str:
        args = []
        if self.dtype is not None:
            args.append(DTYPES[self.dtype].ctype)
        if self.fmt is not None:
            args.append(str(FORMAT_IDS[self.fmt]))
        if self.group_size is not None:
            args.append(str(self.group_size))
        return f"fdpp::{self.kernel}<{','.join(args)}>"

    def smem_bytes(self) -> int:
        return 0


def quant_compile_space() -> list[QuantKernelConfig]:
    """Every variant of kernels_cu/quantize_kv.cu (what the CI compile check covers: 25)."""
    dts = list(DTYPES)
    out = [QuantKernelConfig("kv_amax", dtype=dt) for dt in dts]
    out += [QuantKernelConfig("kv_descale", fmt=f) for f in FP8_FORMATS]
    out += [QuantKernelConfig("quantize_fp8", dtype=dt, fmt=f) for dt in dts for f in FP8_FORMATS]
    out += [QuantKernelConfig("quantize_int4", dtype=dt, group_size=g) for dt in dts for g in GROUP_SIZES]
    out += [QuantKernelConfig("dequant_fp8", fmt=f) for f in FP8_FORMATS]
    out += [QuantKernelConfig("dequant_int4", group_size=g) for g in GROUP_SIZES]
    return out


class _Dev:
    """Allocation and inspection for one device array type ("cupy" or "torch")."""

    def __init__(self, kind: str, like: Any):
        self.kind = kind
        if kind == "torch":
            import torch

            self.torch = torch
            self.tdev = like.device
            self.device = like.device.index if like.device.index is not None else torch.cuda.current_device()
        else:
            import cupy

            self.cp = cupy
            self.device = like.device.id

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        """dtype: "uint8", "float32", "float16", "int32", or an fp8 format name."""
        if self.kind == "torch":
            t = self.torch
            if dtype in FP8:
                tdt = t.float8_e4m3fn if dtype == "fp8_e4m3" else t.float8_e5m2
                return t.empty(shape, dtype=t.uint8, device=self.tdev).view(tdt)
            return t.empty(shape, dtype=getattr(t, dtype), device=self.tdev)
        with self.cp.cuda.Device(self.device):
            return self.cp.empty(shape, dtype="uint8" if dtype in FP8 else dtype)

    def ptr(self, x: Any) -> int:
        return int(x.data_ptr()) if self.kind == "torch" else int(x.data.ptr)

    def strides(self, x: Any) -> tuple[int, ...]:
        if self.kind == "torch":
            return tuple(x.stride())
        return tuple(s // x.itemsize for s in x.strides)

    def readable(self, x: Any) -> Any:
        """``x`` when the kernels can read it in place (unit stride in D, 16-byte aligned pointer
        and strides), else a contiguous copy."""
        st = self.strides(x)
        isz = x.element_size() if self.kind == "torch" else x.itemsize
        ok = (x.shape[-1] == 1 or st[-1] == 1) and self.ptr(x) % 16 == 0 and all(
            n == 1 or (s * isz) % 16 == 0 for n, s in zip(x.shape[:-1], st[:-1], strict=True))
        if ok:
            return x
        if self.kind == "torch":
            return x.clone(memory_format=self.torch.contiguous_format)
        return self.copy(x)

    def copy(self, x: Any) -> Any:
        """A fresh contiguous CuPy copy, made of the raw bits (CuPy has no bfloat16 kernels)."""
        with self.cp.cuda.Device(self.device):
            return self.cp.ascontiguousarray(x.view(f"u{x.itemsize}")).copy().view(x.dtype)

    def stream(self) -> Any:
        from fdpp.launch import stream_for

        return stream_for(self.kind, self.device, self.tdev if self.kind == "torch" else None)

    def to_host(self, x: Any) -> np.ndarray:
        if self.kind == "torch":
            return x.detach().cpu().numpy()
        return self.cp.asnumpy(x)

    def lengths(self, cache_seqlens: Any, b: int) -> Any:
        """A contiguous int32 device array [B] of ``cache_seqlens`` (converted or uploaded)."""
        kind = _kind(cache_seqlens)
        if kind in ("cupy", "torch") and kind != self.kind:
            raise TypeError(f"cache_seqlens must be a {self.kind} array (k's type) or NumPy, got {kind}")
        if kind == "torch":
            t = self.torch
            if cache_seqlens.dtype not in (t.int32, t.int64, t.int16, t.uint8, t.int8):
                raise TypeError(f"cache_seqlens must be an integer tensor, got {cache_seqlens.dtype}")
            lens = cache_seqlens.to(device=self.tdev, dtype=t.int32).contiguous()
        elif kind == "cupy":
            if cache_seqlens.dtype.kind not in "iu":
                raise TypeError(f"cache_seqlens must be an integer array, got dtype {cache_seqlens.dtype}")
            with self.cp.cuda.Device(self.device):
                lens = self.cp.ascontiguousarray(cache_seqlens.astype(self.cp.int32))
        else:
            host = np.asarray(cache_seqlens)
            if host.dtype.kind not in "iu":
                raise TypeError(f"cache_seqlens must be an integer array, got dtype {host.dtype}")
            host = host.astype(np.int32)
            if self.kind == "torch":
                lens = self.torch.from_numpy(host).to(self.tdev)
            else:
                with self.cp.cuda.Device(self.device):
                    lens = self.cp.asarray(host)
        if tuple(lens.shape) != (b,):
            raise ValueError(f"cache_seqlens must have shape [B] = ({b},), got {tuple(lens.shape)}")
        return lens


def _launch(dev: _Dev, cfg: QuantKernelConfig, grid: tuple[int, int, int], params: np.void) -> None:
    from fdpp.launch import launch

    if grid[0] > 0:
        launch(cfg, grid, (params,), dev.device, dev.stream())


def _quantize_device(kind: str, k: Any, v: Any, fmt: str, scale: str, g: int | None, kv_layout: str,
                     cache_seqlens: Any, dt: Any, names: tuple[str, str] = ("k", "v")) -> QuantizedKV:
    from fdpp.api import checks_enabled

    dev = _Dev(kind, k)
    b, n, h, d = _dims(tuple(k.shape), kv_layout)
    k, v = dev.readable(k), dev.readable(v)
    ks, vs = dev.strides(k), dev.strides(v)
    order = (0, 1, 2) if kv_layout == "NHD" else (0, 2, 1)  # (request, token, head) axes
    lens = None if cache_seqlens is None else dev.lengths(cache_seqlens, b)
    if lens is not None and checks_enabled():
        host = dev.to_host(lens)
        if host.size and (int(host.min()) < 0 or int(host.max()) > n):
            raise ValueError(f"cache_seqlens values must be in [0, N] = [0, {n}], got {host.min()}..{host.max()}")
    rows = b * n * h
    shape = tuple(int(s) for s in k.shape)
    fields: dict[str, Any] = dict(
        k_src=dev.ptr(k), v_src=dev.ptr(v), seqlens=0 if lens is None else dev.ptr(lens),
        k_sb=ks[order[0]], k_sn=ks[order[1]], k_sh=ks[order[2]],
        v_sb=vs[order[0]], v_sn=vs[order[1]], v_sh=vs[order[2]],
        rows=rows, batch=b, seqlen=n, heads=h, head_dim=d, hnd=int(kv_layout == "HND"),
        per_tensor=int(scale == "per_tensor"))
    vec_grid = (-(-rows * (d // 8) // QUANT_THREADS), 2, 1)
    if fmt == "int4":
        assert g is not None
        kq, vq = dev.empty((*shape[:3], d // 2), "uint8"), dev.empty((*shape[:3], d // 2), "uint8")
        sshape = (*shape[:3], d // g)
        kS, kZ, vS, vZ = (dev.empty(sshape, "float16") for _ in range(4))
        fields.update(k_out=dev.ptr(kq), v_out=dev.ptr(vq), k_scale=dev.ptr(kS), k_zero=dev.ptr(kZ),
                      v_scale=dev.ptr(vS), v_zero=dev.ptr(vZ))
        params = QUANT_PARAMS.pack(**fields)
        _launch(dev, QuantKernelConfig("quantize_int4", dtype=dt.name, group_size=g), vec_grid, params)
        res = QuantizedKV(fmt, kq, vq, k_scale=kS, k_zero=kZ, v_scale=vS, v_zero=vZ, group_size=g,
                          kv_layout=kv_layout)
        if checks_enabled():
            _check_int4_device(dev, res, lens, b, n, kv_layout)
        return res
    kq, vq = dev.empty(shape, fmt), dev.empty(shape, fmt)
    dshape = (b, h) if scale == "per_head" else ()
    kd, vd = dev.empty(dshape, "float32"), dev.empty(dshape, "float32")
    splits = amax_splits(n, d)
    amax = dev.empty((2 * b * h * splits,), "float32")
    fields.update(k_out=dev.ptr(kq), v_out=dev.ptr(vq), k_descale=dev.ptr(kd), v_descale=dev.ptr(vd),
                  amax=dev.ptr(amax), splits=splits)
    params = QUANT_PARAMS.pack(**fields)
    _launch(dev, QuantKernelConfig("kv_amax", dtype=dt.name), (b * h, 2, splits), params)
    _launch(dev, QuantKernelConfig("kv_descale", fmt=fmt), (1, 2, 1), params)
    _launch(dev, QuantKernelConfig("quantize_fp8", dtype=dt.name, fmt=fmt), vec_grid, params)
    if checks_enabled():
        for name, x in zip(names, (kd, vd), strict=True):
            if not np.all(np.isfinite(dev.to_host(x))):
                raise ValueError(_nonfinite_fp8(name, scale.replace('_', '-')))
    # amax is freed when this returns: CuPy's and torch's allocators hand a freed block only to
    # work queued later on the same stream, so the kernels above still see it
    return QuantizedKV(fmt, kq, vq, k_descale=kd, v_descale=vd, kv_layout=kv_layout)


def _check_int4_device(dev: _Dev, q: QuantizedKV, lens: Any, b: int, n: int, kv_layout: str) -> None:
    hl = None if lens is None else dev.to_host(lens).astype(np.int64)
    valid = _valid_tokens(hl, b, n, kv_layout)
    for name, s, z in (("k", q.k_scale, q.k_zero), ("v", q.v_scale, q.v_zero)):
        hs, hz = dev.to_host(s), dev.to_host(z)
        if (int4_groups_bad(hs, hz) & valid).any():
            raise ValueError(f"{name} holds non-finite values, or {INT4_RANGE}")


def _dequantize_device(kind: str, q: QuantizedKV) -> tuple[Any, Any]:
    dev = _Dev(kind, q.k)
    fmt = q.fmt
    d = q.head_dim
    shape = (*tuple(int(s) for s in q.k.shape[:3]), d)
    b, n, h, _ = _dims(shape, q.kv_layout)
    rows = b * n * h
    outs = []
    for codes, ds, sc, zp in ((q.k, q.k_descale, q.k_scale, q.k_zero), (q.v, q.v_descale, q.v_scale, q.v_zero)):
        codes = _contig(dev, codes)
        out = dev.empty(shape, "float32")
        fields: dict[str, Any] = dict(codes=dev.ptr(codes), out=dev.ptr(out), rows=rows, seqlen=n, heads=h,
                                      head_dim=d, hnd=int(q.kv_layout == "HND"))
        if fmt == "int4":
            g = check_group_size(q.group_size, d)
            sc, zp = _contig(dev, sc), _contig(dev, zp)
            fields.update(scale=dev.ptr(sc), zero=dev.ptr(zp))
            cfg = QuantKernelConfig("dequant_int4", group_size=g)
        else:
            ds = _contig(dev, ds)  # [B, Hkv] or [] (_check_quantized)
            fields.update(descale=dev.ptr(ds), per_tensor=int(tuple(ds.shape) == ()))
            cfg = QuantKernelConfig("dequant_fp8", fmt=fmt)
        _launch(dev, cfg, (-(-rows * (d // 8) // QUANT_THREADS), 1, 1), DEQUANT_PARAMS.pack(**fields))
        outs.append(out)
    return outs[0], outs[1]


def _contig(dev: _Dev, x: Any) -> Any:
    if dev.kind == "torch":
        return x.contiguous()
    want, acc = [], 1
    for n in reversed(x.shape):
        want.append(acc)
        acc *= max(int(n), 1)
    return x if dev.strides(x) == tuple(reversed(want)) else dev.copy(x)
