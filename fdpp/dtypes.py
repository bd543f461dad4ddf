"""The dtype table: one entry per element type fdpp understands.

Adding a dtype means one entry here (C type name, tag, tolerances), one load/convert
specialisation in ``kernels_cu/common.cuh`` and, for quantised caches, one dequant in
``fdpp.reference``.

:data:`DTYPES` are the compute types (q, out, and K/V of an unquantised cache). Quantised K/V
formats are :data:`KV_FORMATS`: K/V only, never q or out; :data:`ELEMENT_TYPES` holds both, for
the kernel configs' ``kv_dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class DType:
    """An element type.

    ``rtol``/``atol`` are the tolerances of a kernel's output against the float64 reference
    computed from the same (already rounded) inputs: they measure kernel error, not input
    rounding.
    """

    name: str  # user-facing name: "fp16", "bf16", "fp32"
    np_dtype: np.dtype
    ctype: str  # C++ type in kernels_cu
    tag: str  # short tag used in variant keys
    rtol: float
    atol: float

    @property
    def itemsize(self) -> int:
        return self.np_dtype.itemsize


DTYPES: dict[str, DType] = {
    "fp16": DType("fp16", np.dtype(np.float16), "fdpp::half_t", "f16", 4e-3, 4e-3),
    "bf16": DType("bf16", np.dtype(ml_dtypes.bfloat16), "fdpp::bfloat16_t", "bf16", 2.5e-2, 2.5e-2),
    "fp32": DType("fp32", np.dtype(np.float32), "float", "f32", 2e-5, 2e-5),
}

_ALIASES = {
    "float16": "fp16", "half": "fp16", "fp16": "fp16",
    "bfloat16": "bf16", "bf16": "bf16",
    "float32": "fp32", "float": "fp32", "fp32": "fp32",
}


_RESOLVED: dict[object, DType] = {}  # dtype objects and names already resolved (a handful)


def get_dtype(x: object) -> DType:
    """Return the table entry for a dtype given as a name, NumPy/CuPy dtype or torch dtype.

    Raises
    ------
    TypeError
        If the dtype is not one fdpp supports.
    """
    if isinstance(x, DType):
        return x
    try:
        return _RESOLVED[x]  # every call validates 3-5 arrays: str(dtype) costs ~2 us each
    except (KeyError, TypeError):
        pass
    name = str(x).removeprefix("torch.")
    if name in _ALIASES:
        dt = DTYPES[_ALIASES[name]]
    else:
        try:
            np_name = np.dtype(x).name  # type: ignore[arg-type]
        except TypeError:
            np_name = None
        if np_name not in _ALIASES:
            raise TypeError(f"unsupported dtype {x!r}; expected one of {sorted(DTYPES)}")
        dt = DTYPES[_ALIASES[np_name]]
    try:
        _RESOLVED[x] = dt
    except TypeError:  # unhashable stand-in: resolved, not remembered
        pass
    return dt


@dataclass(frozen=True)
class KVFormat:
    """A quantised K/V element format (K/V only; also a kernel element type, ``ELEMENT_TYPES``).

    ``max`` is the largest finite magnitude, the quantisers' amax target.
    """

    name: str  # "fp8_e4m3", "fp8_e5m2"
    np_dtype: np.dtype  # ml_dtypes' type of the codes (NumPy arrays)
    torch_name: str  # torch's dtype attribute
    ctype: str  # the kernels' element type
    max: float

    @property
    def itemsize(self) -> int:
        return self.np_dtype.itemsize

    @property
    def tag(self) -> str:
        return self.name.removeprefix("fp8_")


KV_FORMATS: dict[str, KVFormat] = {
    "fp8_e4m3": KVFormat("fp8_e4m3", np.dtype(ml_dtypes.float8_e4m3fn), "float8_e4m3fn", "fdpp::fp8_e4m3_t", 448.0),
    "fp8_e5m2": KVFormat("fp8_e5m2", np.dtype(ml_dtypes.float8_e5m2), "float8_e5m2", "fdpp::fp8_e5m2_t", 57344.0),
}

@dataclass(frozen=True)
class Int4Format:
    """An INT4 K/V element type of the kernels: two 4-bit codes a byte (element 2i in the low
    nibble of byte i), an fp16 scale and zero per ``group_size`` elements of D (fdpp.quant's
    "int4" format). The user-facing format is "int4"; the group size, inferred from the scale
    arrays' shape, is part of the kernels' element type ("int4_g64": ``fdpp::int4_t<64>``)."""

    group_size: int

    @property
    def name(self) -> str:
        return f"int4_g{self.group_size}"

    @property
    def ctype(self) -> str:
        return f"fdpp::int4_t<{self.group_size}>"

    @property
    def tag(self) -> str:
        return f"i4g{self.group_size}"

    def row_bytes(self, head_dim: int) -> int:
        """Bytes one (token, KV head) row of K (or V) takes: packed codes, fp16 scales and zeros."""
        return head_dim // 2 + 4 * (head_dim // self.group_size)


INT4_GROUP_SIZES = (32, 64, 128)
#: The INT4 element types, by kernel name ("int4_g32", "int4_g64", "int4_g128").
INT4_FORMATS: dict[str, Int4Format] = {f.name: f for f in (Int4Format(g) for g in INT4_GROUP_SIZES)}


def int4_format(group_size: int) -> Int4Format:
    """The INT4 element type of ``group_size`` (ValueError outside 32, 64, 128)."""
    f = INT4_FORMATS.get(f"int4_g{group_size}")
    if f is None:
        raise ValueError(f"INT4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    return f


#: Every element type a kernel config may name: the compute types and the quantised formats
#: (INT4 as one-byte code pairs).
ELEMENT_TYPES: dict[str, DType] = {
    **DTYPES,
    **{f.name: DType(f.name, f.np_dtype, f.ctype, f.tag, 0.0, 0.0) for f in KV_FORMATS.values()},
    **{f.name: DType(f.name, np.dtype(np.uint8), f.ctype, f.tag, 0.0, 0.0) for f in INT4_FORMATS.values()},
}


def is_quantized(kv_dtype: str) -> bool:
    """An FP8 or INT4 element type (a kernel config's or problem's ``kv_dtype``)."""
    return kv_dtype in KV_FORMATS or kv_dtype in INT4_FORMATS


def kv_row_bytes(kv_dtype: str, head_dim: int) -> int:
    """Bytes a (token, KV head) row of K (or V) takes in memory, INT4 scales and zeros included."""
    f = INT4_FORMATS.get(kv_dtype)
    return f.row_bytes(head_dim) if f is not None else head_dim * kv_itemsize(kv_dtype)

_KV_ALIASES = {"float8_e4m3fn": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "e4m3": "fp8_e4m3",
               "float8_e5m2": "fp8_e5m2", "fp8_e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2"}


def kv_itemsize(kv_dtype: str) -> int:
    f = KV_FORMATS.get(kv_dtype)
    return f.itemsize if f is not None else ELEMENT_TYPES[kv_dtype].itemsize


def get_kv_format(x: object) -> KVFormat | None:
    """The KV format of a dtype (ml_dtypes / torch float8) or a format name; None for anything
    else (a compute type, uint8, an unknown name)."""
    if isinstance(x, KVFormat):
        return x
    name = str(x).removeprefix("torch.")
    if name in _KV_ALIASES:
        return KV_FORMATS[_KV_ALIASES[name]]
    return None
