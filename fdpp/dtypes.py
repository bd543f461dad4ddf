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

#: Every element type a kernel config may name: the compute types and the quantised formats.
ELEMENT_TYPES: dict[str, DType] = {
    **DTYPES,
    **{f.name: DType(f.name, f.np_dtype, f.ctype, f.tag, 0.0, 0.0) for f in KV_FORMATS.values()},
}

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
