"""A page-pool KV cache that an inference loop owns: sequences, copy-on-write forks, an active
batch with its block table, and the GPU kernel that writes each step's K/V into the pages.

Layout (what ``fdpp.paged_decode_attention`` reads):

- K and V pools, all layers in one array each: ``[num_layers, num_pages, page_size, num_kv_heads,
  head_dim]`` (``kv_layout="NHD"``) or ``[num_layers, num_pages, num_kv_heads, page_size,
  head_dim]`` (``"HND"``); ``k_pages(layer)`` / ``v_pages(layer)`` are views of one layer.
- ``block_table``: int32 ``[B, max_pages_per_seq]``: row b lists the pages of the b-th sequence
  of the active batch in order, 0 beyond its pages. ``seqlens``: int32 ``[B]`` tokens stored.

A decode step::

    cache.set_batch(seqs)            # when the batch changes
    cache.reserve(1)                 # host: pages for one more token per sequence, copy-on-write
    for layer in range(num_layers):
        cache.append(layer, k_new, v_new)            # one kernel launch, reads the device tables
        o = fdpp.paged_decode_attention(q, cache.k_pages(layer), cache.v_pages(layer),
                                        cache.block_table, cache.seqlens, kv_layout=cache.kv_layout)

A prefill of T tokens of one sequence: ``cache.extend_reserve(seq, T)`` once, then
``cache.extend(layer, seq, k, v)`` per layer (k, v ``[T, num_kv_heads, head_dim]``).

``append`` reads ``block_table`` and ``seqlens`` from device memory and never synchronises, so a
CUDA graph captured after ``reserve`` replays it correctly: ``reserve`` / ``set_batch`` rewrite
those device arrays in place (``seqlens`` and only the block-table entries that changed: one
host-to-device copy and one ``paged_table_update`` launch), on the current stream. Copy-on-write
page copies run on that stream too, so work queued after ``reserve`` sees them.

Kernels (kernels_cu/paged_append.cu): :class:`PagedAppendConfig` (``paged_append``, the K/V
writes of ``append`` and ``extend``) and :class:`TableUpdateConfig` (``paged_table_update``); their
single struct arguments are mirrored by :data:`PAGED_APPEND_PARAMS` / :data:`TABLE_UPDATE_PARAMS`.

Quantized caches (``kv_format="fp8_e4m3" | "fp8_e5m2" | "int4"``, fdpp.quant's formats): the
pools hold codes (fp8: one byte per element; int4: ``head_dim // 2`` bytes per (token, head)),
``append`` / ``extend`` take fp16 / bf16 / fp32 K/V and quantize them on the way in (kernel
``paged_append_quant``, :class:`PagedAppendQuantConfig`, struct :data:`PAGED_APPEND_Q_PARAMS`) with
``fdpp.quantize_kv``'s rounding: fp8 with a fixed descale per (layer, KV head)
(``k_descale(layer)``, ``set_descale``), int4 with per-(token, head, group) fp16 scale / zero pools
(``k_scale_pages(layer)`` ...), copied with their pages on copy-on-write.

A decode step whose QKV projection is one GEMM can hand its rows to ``append_rope(layer, qkv, cos,
sin, q_out)``: q and k rotated (RoPE, rotate-half), q written to ``q_out``, k and v appended as
``append`` writes them, in one launch (``paged_rope_append``, :class:`PagedRopeAppendConfig`, structs
:data:`PAGED_APPEND_Q_PARAMS` and :data:`ROPE_APPEND_PARAMS`) instead of a RoPE kernel and an append.

Backends: "numpy" (host arrays, NumPy scatter; what CPU tests use), "cupy" (CuPy arrays, the
kernel through CuPy's current stream) and "torch" (torch CUDA tensors, the kernel on torch's current
stream). Page allocation is deterministic (same calls, same pages on every backend).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np

from fdpp import quant
from fdpp.dtypes import DTYPES, get_dtype
from fdpp.launch import ParamStruct

log = logging.getLogger("fdpp.cache")

KV_LAYOUTS = ("NHD", "HND")
BACKENDS = ("numpy", "cupy", "torch")
SOURCE = "paged_append.cu"
APPEND_THREADS = 128  # mirrors APPEND_THREADS in kernels_cu/paged_append.cu
_I32_MAX = 2**31 - 1

#: Python mirror of ``PagedAppendParams`` (kernels_cu/paged_append.cu); strides in elements.
PAGED_APPEND_PARAMS = ParamStruct("PagedAppendParams", [
    ("k_src", "ptr"), ("v_src", "ptr"), ("k_pool", "ptr"), ("v_pool", "ptr"),
    ("block_table", "ptr"), ("seqlens", "ptr"),
    ("k_src_row", "i64"), ("k_src_head", "i64"), ("v_src_row", "i64"), ("v_src_head", "i64"),
    ("k_page", "i64"), ("k_s1", "i64"), ("k_s2", "i64"),
    ("v_page", "i64"), ("v_s1", "i64"), ("v_s2", "i64"),
    ("bt_row_stride", "i64"), ("rows", "i64"),
    ("num_heads", "i32"), ("num_pages", "i32"), ("max_pages", "i32"), ("pos0", "i32"),
])
_PARAM_NAMES = tuple(n for n, _ in PAGED_APPEND_PARAMS.fields)

#: Python mirror of ``PagedAppendQParams`` (the quantized append): PAGED_APPEND_PARAMS' fields (pool
#: strides in bytes), then the scale pointers and the int4 scale-pool strides (elements).
PAGED_APPEND_Q_PARAMS = ParamStruct("PagedAppendQParams", [
    *PAGED_APPEND_PARAMS.fields, ("k_sc", "ptr"), ("v_sc", "ptr"), ("k_zp", "ptr"), ("v_zp", "ptr"),
    ("sc_page", "i64"), ("sc_s1", "i64"), ("sc_s2", "i64"),
])
_Q_PARAM_NAMES = tuple(n for n, _ in PAGED_APPEND_Q_PARAMS.fields)
KV_FORMATS = quant.FORMATS

#: Python mirror of ``RopeAppendParams`` (the q side of ``paged_rope_append``); strides in elements.
ROPE_APPEND_PARAMS = ParamStruct("RopeAppendParams", [
    ("q_src", "ptr"), ("q_out", "ptr"), ("cos_t", "ptr"), ("sin_t", "ptr"),
    ("q_src_row", "i64"), ("q_src_head", "i64"), ("q_out_row", "i64"), ("q_out_head", "i64"),
    ("num_q_heads", "i32"), ("n_pos", "i32"),
])

#: Python mirror of ``PagedTableUpdateParams`` (the device side of reserve / set_batch uploads).
TABLE_UPDATE_PARAMS = ParamStruct("PagedTableUpdateParams", [
    ("src", "ptr"), ("block_table", "ptr"), ("seqlens", "ptr"), ("table_size", "i64"),
    ("num_lens", "i32"), ("num_entries", "i32"),
])


class OutOfPagesError(RuntimeError):
    """The page pool cannot satisfy a reservation; nothing was changed.

    ``needed`` and ``free`` are page counts."""

    def __init__(self, needed: int, free: int, what: str):
        super().__init__(f"{what} needs {needed} free pages, only {free} are free "
                         f"(free or preempt a sequence, or build the cache with more pages)")
        self.needed, self.free = needed, free


# ---- kernel config --------------------------------------------------------------------------
@dataclass(frozen=True)
class PagedAppendConfig:
    """Compile-time parameters of ``fdpp::paged_append`` (kernels_cu/paged_append.cu)."""

    dtype: str
    head_dim: int
    page_size: int
    hnd: bool = False
    threads: ClassVar[int] = APPEND_THREADS

    @property
    def source(self) -> str:
        return SOURCE

    @property
    def vec_bytes(self) -> int:
        """Bytes per copy: mirrors VecBytes in the kernel (16 when a head's row allows)."""
        row = self.head_dim * DTYPES[self.dtype].itemsize
        return next(b for b in (16, 8, 4, 2) if row % b == 0)

    def name_expression(self) -> str:
        return (f"fdpp::paged_append<{DTYPES[self.dtype].ctype},{self.head_dim},{self.page_size},"
                f"{'true' if self.hnd else 'false'}>")

    @property
    def key(self) -> str:
        return (f"paged_append.{DTYPES[self.dtype].tag}.d{self.head_dim}.p{self.page_size}"
                f".{'hnd' if self.hnd else 'nhd'}")

    def smem_bytes(self) -> int:
        return 0


@dataclass(frozen=True)
class PagedAppendQuantConfig:
    """Compile-time parameters of ``fdpp::paged_append_quant`` (a quantized cache's writes)."""

    dtype: str  # the input K/V dtype
    kv_format: str  # "fp8_e4m3" | "fp8_e5m2" | "int4"
    group_size: int  # int4 group (0 for fp8)
    head_dim: int
    page_size: int
    hnd: bool = False
    threads: ClassVar[int] = APPEND_THREADS
    vec_bytes: ClassVar[int] = 16  # input rows are read 8 elements at a time, 16-byte aligned

    @property
    def source(self) -> str:
        return SOURCE

    def name_expression(self) -> str:
        return (f"fdpp::paged_append_quant<{DTYPES[self.dtype].ctype},{quant.FORMAT_IDS[self.kv_format]},"
                f"{self.group_size},{self.head_dim},{self.page_size},{'true' if self.hnd else 'false'}>")

    @property
    def key(self) -> str:
        g = f".g{self.group_size}" if self.kv_format == "int4" else ""
        return (f"paged_append_q.{DTYPES[self.dtype].tag}.{self.kv_format}{g}.d{self.head_dim}"
                f".p{self.page_size}.{'hnd' if self.hnd else 'nhd'}")

    def smem_bytes(self) -> int:
        return 0


@dataclass(frozen=True)
class PagedRopeAppendConfig:
    """Compile-time parameters of ``fdpp::paged_rope_append`` (``PagedKVCache.append_rope``): the
    model dtype, the cache's format (None: pools of the model dtype) and its geometry."""

    dtype: str
    kv_format: str | None
    group_size: int  # int4 group (0 otherwise)
    head_dim: int
    page_size: int
    hnd: bool = False
    threads: ClassVar[int] = APPEND_THREADS

    @property
    def source(self) -> str:
        return SOURCE

    def name_expression(self) -> str:
        fmt = 0 if self.kv_format is None else quant.FORMAT_IDS[self.kv_format]
        return (f"fdpp::paged_rope_append<{DTYPES[self.dtype].ctype},{fmt},{self.group_size},{self.head_dim},"
                f"{self.page_size},{'true' if self.hnd else 'false'}>")

    @property
    def key(self) -> str:
        fmt = "kv" if self.kv_format is None else self.kv_format
        g = f".g{self.group_size}" if self.kv_format == "int4" else ""
        return (f"paged_rope_append.{DTYPES[self.dtype].tag}.{fmt}{g}.d{self.head_dim}.p{self.page_size}"
                f".{'hnd' if self.hnd else 'nhd'}")

    def smem_bytes(self) -> int:
        return 0


def rope_append_compile_space() -> list[PagedRopeAppendConfig]:
    """Fused RoPE-append variants CI compiles: every model dtype x cache format (int4: each group)
    at head_dim 128, pages of 16, both layouts; fp16 at head_dim 64 with pages of 1 and 256."""
    fmts = [(None, 0), ("fp8_e4m3", 0), ("fp8_e5m2", 0)] + [("int4", g) for g in quant.GROUP_SIZES]
    out = [PagedRopeAppendConfig(dt, f, g, 128, 16, hnd) for dt in DTYPES for f, g in fmts for hnd in (False, True)]
    out += [PagedRopeAppendConfig("fp16", f, g, 64, p, False) for f, g in fmts for p in (1, 256) if not (f == "int4" and 64 % g)]
    return out


def append_quant_compile_space() -> list[PagedAppendQuantConfig]:
    """Quantized-append variants CI compiles: every input dtype x format (int4: each group size)
    at head_dim 128, pages of 16, both layouts; plus head_dim 64 / 256 and pages of 1 / 256 for fp16."""
    fmts = [("fp8_e4m3", 0), ("fp8_e5m2", 0)] + [("int4", g) for g in quant.GROUP_SIZES]
    out = [PagedAppendQuantConfig(dt, f, g, 128, 16, hnd) for dt in DTYPES for f, g in fmts for hnd in (False, True)]
    out += [PagedAppendQuantConfig("fp16", f, g, d, p, hnd) for f, g in fmts for d in (64, 256) for p in (1, 256)
            for hnd in (False, True) if not (f == "int4" and d % g)]
    return out


@dataclass(frozen=True)
class TableUpdateConfig:
    """Compile-time parameters of ``fdpp::paged_table_update`` (kernels_cu/paged_append.cu)."""

    threads: int = 256

    @property
    def source(self) -> str:
        return SOURCE

    def name_expression(self) -> str:
        return f"fdpp::paged_table_update<{self.threads}>"

    @property
    def key(self) -> str:
        return f"paged_table_update.t{self.threads}"

    def smem_bytes(self) -> int:
        return 0


def append_compile_space(head_dims: Iterable[int] = (64, 96, 128, 256),
                         page_sizes: Iterable[int] = (1, 16, 64, 256)) -> list[PagedAppendConfig]:
    """Variants CI compiles: every dtype x ``head_dims`` x ``page_sizes`` x both layouts."""
    return [PagedAppendConfig(dt, d, p, hnd) for dt in DTYPES for d in head_dims
            for p in page_sizes for hnd in (False, True)]


# ---- argument checks ------------------------------------------------------------------------
def _check_int(name: str, x: Any, lo: int = 1, hi: int = _I32_MAX) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if not lo <= int(x) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {x}")
    return int(x)


def _check_page_size(x: Any) -> int:
    ps = _check_int("page_size", x, 1, 256)
    if ps & (ps - 1):
        raise ValueError(f"page_size must be a power of two in 1..256, got {ps}")
    return ps


def _resolve_backend(backend: Any) -> str:
    if backend is None:
        from fdpp.api import gpu_available

        return "cupy" if gpu_available() else "numpy"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    return backend


# ---- backends: allocation, uploads, device copies, array inspection ------------------------
class _ArrayInfo(NamedTuple):
    """What a write needs of an array: shape, element strides, pointer, device (-1: host)."""

    shape: tuple
    strides: tuple
    ptr: int
    device: int


def _byte_range(info: _ArrayInfo, itemsize: int) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` spanned by the elements of ``info`` (element strides of either sign:
    ``x[::-1]``'s ptr is its first element, the last in memory); empty (lo == hi) without elements."""
    lo = hi = info.ptr
    if not all(info.shape):
        return lo, hi
    for n, s in zip(info.shape, info.strides, strict=True):
        if s < 0:
            lo += (n - 1) * s * itemsize
        else:
            hi += (n - 1) * s * itemsize
    return lo, hi + itemsize


def _host_dtype(dtype: str | type) -> np.dtype:
    return DTYPES[dtype].np_dtype if isinstance(dtype, str) else np.dtype(dtype)


class _NumpyBackend:
    name = "numpy"
    device = -1
    array_type = "numpy.ndarray"

    def dtype_of(self, name: str) -> Any:
        """The array-library dtype of an fdpp dtype name (compared with ``x.dtype``)."""
        return DTYPES[name].np_dtype

    def zeros(self, shape: tuple, dtype: str | type) -> Any:
        return np.zeros(shape, dtype=_host_dtype(dtype))

    def raw_zeros(self, shape: tuple, kind: str) -> Any:
        """Zeros of a quantized cache's arrays: kind "uint8", "float16", "float32" or an fp8
        format name (ml_dtypes float8 on numpy, uint8 on cupy, torch float8 on torch)."""
        dt = quant.FP8[kind].np_dtype if kind in quant.FP8 else np.dtype(kind)
        return np.zeros(shape, dtype=dt)

    def to_device(self, a: np.ndarray) -> Any:
        return a.copy()

    def h2d_into(self, dst: Any, src: np.ndarray) -> None:
        dst[:src.size] = src

    def copy_pages(self, pool: Any, src: np.ndarray, dst: np.ndarray) -> None:
        pool[:, dst] = pool[:, src]

    def is_array(self, x: Any) -> bool:
        return isinstance(x, np.ndarray)

    def info(self, x: Any) -> _ArrayInfo:
        isz = x.itemsize
        return _ArrayInfo(x.shape, tuple(s // isz for s in x.strides), x.ctypes.data, -1)

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)


class _CupyBackend(_NumpyBackend):
    name = "cupy"
    array_type = "cupy.ndarray"

    def __init__(self, device: int | None):
        import cupy

        self.cp = cupy
        self.device = cupy.cuda.Device().id if device is None else int(device)

    def zeros(self, shape: tuple, dtype: str | type) -> Any:
        dt = _host_dtype(dtype)
        with self.cp.cuda.Device(self.device):  # bits as uints: CuPy has no bfloat16 kernels
            return self.cp.zeros(shape, dtype=f"u{dt.itemsize}").view(dt)

    def raw_zeros(self, shape: tuple, kind: str) -> Any:
        with self.cp.cuda.Device(self.device):
            return self.cp.zeros(shape, dtype="uint8" if kind in quant.FP8 else kind)

    def to_device(self, a: np.ndarray) -> Any:
        with self.cp.cuda.Device(self.device):
            return self.cp.asarray(a)

    def h2d_into(self, dst: Any, src: np.ndarray) -> None:
        with self.cp.cuda.Device(self.device):
            dst[:src.size].set(src)  # on the current stream

    def copy_pages(self, pool: Any, src: np.ndarray, dst: np.ndarray) -> None:
        with self.cp.cuda.Device(self.device):
            raw = pool.view(f"u{pool.dtype.itemsize}")
            raw[:, self.cp.asarray(dst)] = raw[:, self.cp.asarray(src)]

    def is_array(self, x: Any) -> bool:
        return isinstance(x, self.cp.ndarray)

    def info(self, x: Any) -> _ArrayInfo:
        isz = x.itemsize
        return _ArrayInfo(x.shape, tuple(s // isz for s in x.strides), x.data.ptr, x.device.id)

    def copy(self, x: Any) -> Any:
        with self.cp.cuda.Device(self.device):
            return x.copy()

    def to_numpy(self, x: Any) -> np.ndarray:
        return self.cp.asnumpy(x)

    def stream(self) -> Any:
        from fdpp.launch import stream_for

        return stream_for("cupy", self.device)


class _TorchBackend:
    name = "torch"
    array_type = "torch.Tensor (CUDA)"
    _DT = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}

    def __init__(self, device: int | None):
        import torch

        self.torch = torch
        self.device = torch.cuda.current_device() if device is None else int(device)
        self.tdev = torch.device("cuda", self.device)

    def dtype_of(self, name: str) -> Any:
        return getattr(self.torch, self._DT[name])

    def zeros(self, shape: tuple, dtype: str | type) -> Any:
        dt = self.dtype_of(dtype) if isinstance(dtype, str) else {np.int32: self.torch.int32}[dtype]
        return self.torch.zeros(shape, dtype=dt, device=self.tdev)

    def raw_zeros(self, shape: tuple, kind: str) -> Any:
        t = self.torch
        if kind in quant.FP8:
            fp8 = t.float8_e4m3fn if kind == "fp8_e4m3" else t.float8_e5m2
            return t.zeros(shape, dtype=t.uint8, device=self.tdev).view(fp8)
        return t.zeros(shape, dtype=getattr(t, kind), device=self.tdev)

    def _host_tensor(self, a: np.ndarray) -> Any:
        # torch.from_numpy warns on a read-only array (a broadcast view, a user's frozen array):
        # hand it a writable contiguous copy instead; the tensor is only read, then copied over.
        a = np.ascontiguousarray(a)
        return self.torch.from_numpy(a if a.flags.writeable else a.copy())

    def to_device(self, a: np.ndarray) -> Any:
        return self._host_tensor(a).to(self.tdev)

    def h2d_into(self, dst: Any, src: np.ndarray) -> None:
        dst[:src.size].copy_(self._host_tensor(src))  # on torch's current stream

    def copy_pages(self, pool: Any, src: np.ndarray, dst: np.ndarray) -> None:
        if pool.element_size() == 1:  # float8 pools: copy their bytes (no float8 index_put in torch)
            pool = pool.view(self.torch.uint8)
        pool[:, self.to_device(dst.astype(np.int64))] = pool[:, self.to_device(src.astype(np.int64))]

    def is_array(self, x: Any) -> bool:
        return isinstance(x, self.torch.Tensor)

    def info(self, x: Any) -> _ArrayInfo:
        return _ArrayInfo(tuple(x.shape), tuple(x.stride()), x.data_ptr(), x.device.index if x.is_cuda else -1)

    def copy(self, x: Any) -> Any:
        return x.clone(memory_format=self.torch.contiguous_format)

    def to_numpy(self, x: Any) -> np.ndarray:
        t = x.detach().cpu()
        if t.dtype == self.torch.bfloat16:
            return t.view(self.torch.int16).numpy().view(DTYPES["bf16"].np_dtype)
        fp8 = {self.torch.float8_e4m3fn: "fp8_e4m3", self.torch.float8_e5m2: "fp8_e5m2"}.get(t.dtype)
        if fp8 is not None:
            return t.view(self.torch.uint8).numpy().view(quant.FP8[fp8].np_dtype)
        return t.numpy()

    def stream(self) -> Any:
        from fdpp.launch import stream_for

        return stream_for("torch", self.device, self.tdev)


def _make_backend(name: str, device: int | None) -> Any:
    if name == "numpy":
        if device is not None:
            raise ValueError("device must be None for backend='numpy'")
        return _NumpyBackend()
    try:
        return _CupyBackend(device) if name == "cupy" else _TorchBackend(device)
    except Exception as e:  # noqa: BLE001 - no package, no driver, no device
        raise ValueError(f"backend={name!r} needs {name} with a CUDA device: {e}") from e


# ---- the cache ------------------------------------------------------------------------------
class _Seq:
    __slots__ = ("pages", "length")

    def __init__(self, pages: list[int], length: int):
        self.pages, self.length = pages, length


class PagedKVCache:
    """A KV cache of ``num_layers`` layers in a pool of ``num_pages`` pages of ``page_size`` tokens.

    Parameters
    ----------
    num_layers, num_pages, num_kv_heads, head_dim : int
        Positive sizes. Pools: K and V, each ``[num_layers, num_pages, page_size, num_kv_heads,
        head_dim]`` (NHD) or ``[num_layers, num_pages, num_kv_heads, page_size, head_dim]`` (HND),
        of ``dtype``, zero-filled.
    page_size : int
        Tokens per page, a power of two in 1..256.
    dtype : str or dtype
        "fp16", "bf16" or "fp32" (or anything ``fdpp.dtypes.get_dtype`` resolves).
    kv_layout : {"NHD", "HND"}
    max_batch : int
        Rows of the block table: the largest active batch.
    max_pages_per_seq : int, optional
        Columns of the block table: the most pages one sequence may hold (default ``num_pages``).
    backend : {"numpy", "cupy", "torch"}, optional
        Array type of the pools and tables; default "cupy" when ``fdpp.gpu_available()`` else
        "numpy". "torch" allocates torch CUDA tensors.
    device : int, optional
        CUDA device index (cupy/torch; default the current device).
    kv_format : {None, "fp8_e4m3", "fp8_e5m2", "int4"}
        None: pools of ``dtype`` (above). Otherwise a quantized cache (byte layouts: fdpp.quant and
        the README's "Quantized KV caches"): ``append`` / ``extend`` take K/V of ``dtype`` (fp16,
        bf16 or fp32) and store them quantized with ``fdpp.quantize_kv``'s rounding.
        fp8: pools ``[..., head_dim]`` of one byte per element (ml_dtypes float8 on numpy, uint8
        on cupy, torch float8 on torch); code = fp8(clip(x / descale)) with the fixed per-(layer,
        KV head) descales ``k_descale(layer)`` / ``v_descale(layer)`` (append cannot change the
        scale of tokens already stored). head_dim a multiple of 8.
        int4: uint8 pools ``[..., head_dim // 2]`` (low nibble first) and fp16 scale / zero pools
        ``[..., head_dim // group_size]`` (``k_scale_pages(layer)`` etc.), per (token, head, group).
    group_size : {32, 64, 128}
        int4 group along head_dim (must divide it); ignored otherwise.
    k_descale, v_descale : float or float32 array ``[num_kv_heads]`` or ``[num_layers, num_kv_heads]``,
        optional
        fp8 descales (finite, > 0; default 1.0); see also :meth:`set_descale`. fp8 caches only.

    Raises
    ------
    TypeError, ValueError
        Naming the bad argument.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, *, dtype: Any = "fp16", kv_layout: str = "NHD", max_batch: int = 256,
                 max_pages_per_seq: int | None = None, backend: str | None = None,
                 device: int | None = None, kv_format: str | None = None, group_size: int = 64,
                 k_descale: Any = None, v_descale: Any = None):
        self.num_layers = _check_int("num_layers", num_layers)
        self.num_pages = _check_int("num_pages", num_pages)
        self.page_size = _check_page_size(page_size)
        self.num_kv_heads = _check_int("num_kv_heads", num_kv_heads)
        self.head_dim = _check_int("head_dim", head_dim, 1, 1 << 16)
        self.dtype = self._check_dtype(dtype)
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
        self.kv_layout = kv_layout
        self.kv_format, self.group_size = self._check_format(kv_format, group_size, k_descale, v_descale)
        self.max_batch = _check_int("max_batch", max_batch)
        mp = num_pages if max_pages_per_seq is None else max_pages_per_seq
        self.max_pages_per_seq = _check_int("max_pages_per_seq", mp, 1, _I32_MAX // self.page_size)
        if self.max_batch * self.max_pages_per_seq > _I32_MAX:
            raise ValueError(f"max_batch * max_pages_per_seq must be < 2**31 (int32 block-table "
                             f"indices), got {self.max_batch} * {self.max_pages_per_seq}")
        self.backend = _resolve_backend(backend)
        self._be = _make_backend(self.backend, device)
        self.device = self._be.device
        self._alloc()
        if self.kv_format in quant.FP8:
            descales = [self._descale_values(n, x, True) for n, x in (("k_descale", k_descale), ("v_descale", v_descale))]
            self._kd[...] = self._be.to_device(descales[0])
            self._vd[...] = self._be.to_device(descales[1])

    def _check_format(self, kv_format: Any, group_size: Any, k_descale: Any, v_descale: Any) -> tuple[str | None, int | None]:
        if kv_format is None:
            bad = [n for n, x in (("k_descale", k_descale), ("v_descale", v_descale)) if x is not None]
            if bad:
                raise ValueError(f"{bad[0]} is for fp8 caches (kv_format='fp8_e4m3' or 'fp8_e5m2'), got kv_format=None")
            return None, None
        if not isinstance(kv_format, str) or kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be None or one of {KV_FORMATS}, got {kv_format!r}")
        if self.head_dim % 8:
            raise ValueError(f"head_dim must be a multiple of 8 for kv_format={kv_format!r}, got {self.head_dim}")
        if kv_format == "int4":
            for n, x in (("k_descale", k_descale), ("v_descale", v_descale)):
                if x is not None:
                    raise ValueError(f"{n} is for fp8 caches; an int4 cache has per-group scales")
            return kv_format, quant.check_group_size(group_size, self.head_dim)
        return kv_format, None

    def _descale_values(self, name: str, x: Any, per_layer: bool) -> np.ndarray:
        """``x`` (None, a float, [Hkv] or, with ``per_layer``, [L, Hkv]) as float32 [L, Hkv] / [Hkv]."""
        h, nl = self.num_kv_heads, self.num_layers
        want = (nl, h) if per_layer else (h,)
        if x is None:
            return np.ones(want, dtype=np.float32)
        if self._be.is_array(x) and not isinstance(x, np.ndarray):
            x = self._be.to_numpy(x)
        try:
            raw = np.asarray(x)
            if raw.dtype.kind in "bSUO":  # bools, strings, objects: not a scale
                raise TypeError
            a = raw.astype(np.float64)
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be a float or a float array, got {type(x).__name__}") from None
        shapes = [(), (h,)] + ([(nl, h)] if per_layer else [])
        if a.shape not in shapes:
            raise ValueError(f"{name} must have shape [] or [num_kv_heads] = ({h},)"
                             f"{f' or [num_layers, num_kv_heads] = {(nl, h)}' if per_layer else ''}, got {a.shape}")
        a32 = a.astype(np.float32)
        if not (np.all(np.isfinite(a32)) and np.all(a32 > 0)):
            raise ValueError(f"{name} must be finite and > 0 in float32, got {a.reshape(-1)[:8]}")
        return np.ascontiguousarray(np.broadcast_to(a32, want))

    @staticmethod
    def _check_dtype(dtype: Any) -> str:
        try:
            return get_dtype(dtype).name
        except TypeError as e:
            raise TypeError(f"dtype: {e}") from None

    def _alloc(self) -> None:
        be, ps, h, d = self._be, self.page_size, self.num_kv_heads, self.head_dim
        page = (ps, h, d) if self.kv_layout == "NHD" else (h, ps, d)
        shape = (self.num_layers, self.num_pages, *page)
        fmt = self.kv_format
        self._scale_pools: list[Any] = []  # int4: k scale, k zero, v scale, v zero
        if fmt is None:
            self._k, self._v = be.zeros(shape, self.dtype), be.zeros(shape, self.dtype)
        elif fmt in quant.FP8:
            self._k, self._v = be.raw_zeros(shape, fmt), be.raw_zeros(shape, fmt)
            self._kd = be.raw_zeros((self.num_layers, h), "float32")
            self._vd = be.raw_zeros((self.num_layers, h), "float32")
        else:
            packed = (*shape[:-1], d // 2)
            self._k, self._v = be.raw_zeros(packed, "uint8"), be.raw_zeros(packed, "uint8")
            assert self.group_size is not None
            self._scale_pools = [be.raw_zeros((*shape[:-1], d // self.group_size), "float16") for _ in range(4)]
        self._k_ptr, self._v_ptr = be.info(self._k).ptr, be.info(self._v).ptr
        self._xp_dtype = be.dtype_of(self.dtype)
        mb, mp = self.max_batch, self.max_pages_per_seq
        self._bt_host = np.zeros((mb, mp), dtype=np.int32)
        self._len_host = np.zeros(mb, dtype=np.int32)
        self._bt_dev, self._len_dev = be.zeros((mb, mp), np.int32), be.zeros(mb, np.int32)
        self._bt_ptr, self._len_ptr = be.info(self._bt_dev).ptr, be.info(self._len_dev).ptr
        self._stage: Any = None  # int32 device staging buffer of uploads (grown on demand)
        self._refcnt = np.zeros(self.num_pages, dtype=np.int32)
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))  # a stack: page 0 first
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        self._active: list[_Seq] = []
        self._row: dict[int, int] = {}  # id(_Seq) -> row of the active batch
        self._dirty: list[np.ndarray] = []  # flat block-table indices to upload
        self._append_ok: str | None = None  # cached check of the batch for append ("" = ok)
        self._ext_pages: tuple[Any, Any] = (None, None)  # (key, device page list) of extend
        hnd = self.kv_layout == "HND"
        self._cfg: Any = (PagedAppendConfig(self.dtype, self.head_dim, self.page_size, hnd) if fmt is None else
                          PagedAppendQuantConfig(self.dtype, fmt, self.group_size or 0, self.head_dim,
                                                 self.page_size, hnd))
        self._written = np.zeros(self.num_layers, dtype=bool)  # layers append / extend wrote to

    # ---- views ----------------------------------------------------------------------------
    def k_pages(self, layer: int) -> Any:
        """K pool of ``layer``: ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD) or
        ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND), of the cache dtype (a view).
        A quantized cache's pool holds its codes: FP8 one byte an element (ml_dtypes / torch
        float8 arrays, CuPy uint8), INT4 uint8 with ``head_dim // 2`` in the last axis."""
        return self._k[self._check_layer(layer)]

    def v_pages(self, layer: int) -> Any:
        """V pool of ``layer``, shaped like :meth:`k_pages` (a view)."""
        return self._v[self._check_layer(layer)]

    # ---- quantized caches: scales --------------------------------------------------------------
    def _need(self, what: str, fmts: tuple[str, ...]) -> None:
        if self.kv_format not in fmts:
            raise ValueError(f"{what} is defined for kv_format in {fmts}; this cache's kv_format is "
                             f"{self.kv_format!r}")

    def k_descale(self, layer: int) -> Any:
        """fp8 caches: float32 ``[num_kv_heads]`` K descales of ``layer`` (a device view):
        dequantized K = float32(code) * descale."""
        self._need("k_descale", quant.FP8_FORMATS)
        return self._kd[self._check_layer(layer)]

    def v_descale(self, layer: int) -> Any:
        """fp8 caches: float32 ``[num_kv_heads]`` V descales of ``layer`` (a device view)."""
        self._need("v_descale", quant.FP8_FORMATS)
        return self._vd[self._check_layer(layer)]

    def attention_kwargs(self, layer: int) -> dict[str, Any]:
        """What :func:`fdpp.paged_decode_attention` takes besides the pools of ``layer``: nothing for
        an unquantized cache; for an fp8 cache its format and the layer's [num_kv_heads] descales;
        for an int4 cache ``kv_dtype="int4"`` and the layer's fp16 scale / zero pools
        (``k_descale=k_scale_pages(layer)``, ``k_zero=k_zero_pages(layer)``, V alike)."""
        layer = self._check_layer(layer)
        if self.kv_format is None:
            return {}
        if self.kv_format == "int4":
            return {"kv_dtype": "int4", "k_descale": self.k_scale_pages(layer), "v_descale": self.v_scale_pages(layer),
                    "k_zero": self.k_zero_pages(layer), "v_zero": self.v_zero_pages(layer)}
        return {"kv_dtype": self.kv_format, "k_descale": self.k_descale(layer), "v_descale": self.v_descale(layer)}

    def set_descale(self, layer: int, k_descale: Any, v_descale: Any) -> None:
        """Set the fp8 descales of ``layer`` (float or ``[num_kv_heads]``, finite, > 0), used by
        every later append / extend of that layer.

        Raises ValueError once the layer stores tokens of a live sequence (an append or extend
        wrote it): stored codes cannot change their scale."""
        self._need("set_descale", quant.FP8_FORMATS)
        layer = self._check_layer(layer)
        kd = self._descale_values("k_descale", k_descale, False)
        vd = self._descale_values("v_descale", v_descale, False)
        if self._written[layer] and any(s.length > 0 for s in self._seqs.values()):
            raise ValueError(f"layer {layer} already stores tokens quantized with its current descales; "
                             "set_descale before the first append / extend of the layer (or free its sequences)")
        if self.backend == "numpy":
            self._kd[layer], self._vd[layer] = kd, vd
        else:
            self._be.h2d_into(self._kd[layer], kd)
            self._be.h2d_into(self._vd[layer], vd)

    def _scale_pool(self, i: int, what: str, layer: int) -> Any:
        self._need(what, ("int4",))
        return self._scale_pools[i][self._check_layer(layer)]

    def k_scale_pages(self, layer: int) -> Any:
        """int4 caches: fp16 K scales of ``layer``, ``[num_pages, page_size, num_kv_heads, head_dim //
        group_size]`` (NHD) or ``[num_pages, num_kv_heads, page_size, head_dim // group_size]`` (HND)."""
        return self._scale_pool(0, "k_scale_pages", layer)

    def k_zero_pages(self, layer: int) -> Any:
        """int4 caches: fp16 K zero points of ``layer``, shaped like :meth:`k_scale_pages`."""
        return self._scale_pool(1, "k_zero_pages", layer)

    def v_scale_pages(self, layer: int) -> Any:
        """int4 caches: fp16 V scales of ``layer``, shaped like :meth:`k_scale_pages`."""
        return self._scale_pool(2, "v_scale_pages", layer)

    def v_zero_pages(self, layer: int) -> Any:
        """int4 caches: fp16 V zero points of ``layer``, shaped like :meth:`k_scale_pages`."""
        return self._scale_pool(3, "v_zero_pages", layer)

    @property
    def block_table(self) -> Any:
        """int32 ``[B, max_pages_per_seq]`` device view: pages of the active batch (0 beyond)."""
        return self._bt_dev[:len(self._active)]

    @property
    def seqlens(self) -> Any:
        """int32 ``[B]`` device view: tokens stored per sequence of the active batch."""
        return self._len_dev[:len(self._active)]

    @property
    def batch(self) -> tuple[int, ...]:
        """Ids of the active batch, in row order."""
        ids = {id(s): i for i, s in self._seqs.items()}
        return tuple(ids[id(s)] for s in self._active)

    @property
    def batch_size(self) -> int:
        return len(self._active)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def length(self, seq: int) -> int:
        """Tokens stored (reserved) for sequence ``seq``."""
        return self._get(seq).length

    def pages(self, seq: int) -> tuple[int, ...]:
        """Page ids of sequence ``seq``, in order."""
        return tuple(self._get(seq).pages)

    def refcount(self, page: int) -> int:
        """Sequences holding ``page``."""
        return int(self._refcnt[_check_int("page", page, 0, self.num_pages - 1)])

    def to_numpy(self, x: Any) -> np.ndarray:
        """A host copy of one of this cache's arrays (``k_pages(l)``, ``block_table``, ...): a copy on
        the NumPy backend too (writing into it leaves the cache as it was)."""
        return np.array(x, copy=True) if self.backend == "numpy" else self._be.to_numpy(x)

    def _check_layer(self, layer: Any) -> int:
        return _check_int("layer", layer, 0, self.num_layers - 1)

    def _get(self, seq: Any, name: str = "seq") -> _Seq:
        if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)):
            raise TypeError(f"{name} must be a sequence id (int), got {type(seq).__name__}")
        s = self._seqs.get(int(seq))
        if s is None:
            raise ValueError(f"{name} {seq} is not a live sequence of this cache")
        return s

    # ---- sequences -------------------------------------------------------------------------
    def allocate(self) -> int:
        """A new empty sequence; returns its id (not in the active batch until set_batch)."""
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = _Seq([], 0)
        return sid

    def free(self, seq: int) -> None:
        """Drop sequence ``seq``; a page returns to the free list when no sequence holds it.

        Raises ValueError when ``seq`` is in the active batch (``set_batch`` without it first)."""
        s = self._get(seq)
        if id(s) in self._row:
            raise ValueError(f"seq {seq} is in the active batch; call set_batch without it first")
        del self._seqs[int(seq)]
        if s.pages:
            pages = np.asarray(s.pages, dtype=np.int64)
            self._refcnt[pages] -= 1
            freed = pages[self._refcnt[pages] == 0]
            self._free.extend(freed[::-1].tolist())
            self._append_ok = None  # a page the batch appends into may be unshared now

    def fork(self, seq: int) -> int:
        """A new sequence sharing every page of ``seq`` (copy-on-write); returns its id.

        The first write of either sequence into a shared, partly filled page copies it first
        (in ``reserve`` / ``extend_reserve``); full shared pages stay shared."""
        s = self._get(seq)
        sid = self.allocate()
        self._seqs[sid] = _Seq(list(s.pages), s.length)
        if s.pages:
            self._refcnt[np.asarray(s.pages, dtype=np.int64)] += 1
        self._append_ok = None
        return sid

    # ---- the active batch ------------------------------------------------------------------
    def set_batch(self, seq_ids: Iterable[int]) -> None:
        """Make ``seq_ids`` (in that order) rows 0..B-1 of ``block_table`` / ``seqlens`` and upload
        the changed rows to the device arrays."""
        if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Iterable):
            raise TypeError(f"seq_ids must be an iterable of sequence ids, got {type(seq_ids).__name__}")
        ids = list(seq_ids)
        new = [self._get(i, "seq_ids entry") for i in ids]
        if len({id(s) for s in new}) != len(new):
            raise ValueError(f"seq_ids has a sequence more than once: {ids}")
        if len(new) > self.max_batch:
            raise ValueError(f"seq_ids has {len(new)} sequences > max_batch {self.max_batch}")
        old, mp = self._active, self.max_pages_per_seq
        for r in range(max(len(old), len(new))):
            o = old[r] if r < len(old) else None
            n = new[r] if r < len(new) else None
            if o is n:
                continue
            w_old, w_new = len(o.pages) if o else 0, len(n.pages) if n else 0
            self._bt_host[r, :w_old] = 0
            if n:
                self._bt_host[r, :w_new] = n.pages
            self._dirty.append(r * mp + np.arange(max(w_old, w_new), dtype=np.int64))
        self._len_host[:] = 0
        self._len_host[:len(new)] = [s.length for s in new]
        self._active = new
        self._row = {id(s): r for r, s in enumerate(new)}
        self._append_ok = None
        self._upload()

    def _upload(self) -> None:
        """Write seqlens and the dirty block-table entries to the device arrays, from one staging
        buffer [lengths | flat indices | values] (int32)."""
        idx = np.concatenate(self._dirty) if self._dirty else np.zeros(0, np.int64)
        self._dirty = []
        buf = np.concatenate([self._len_host, idx.astype(np.int32), self._bt_host.reshape(-1)[idx]])
        mb, n = self.max_batch, idx.size
        if self.backend == "numpy":
            self._len_dev[:] = buf[:mb]
            self._bt_dev.reshape(-1)[buf[mb:mb + n]] = buf[mb + n:]
        else:
            self._device_upload(buf, n)

    def _device_upload(self, buf: np.ndarray, n: int) -> None:
        """One host-to-device copy into the staging buffer and one paged_table_update launch, both
        on the current stream (no synchronisation)."""
        from fdpp.launch import launch

        if self._stage is None or self._stage.shape[0] < buf.size:
            self._stage = self._be.zeros(max(buf.size, 2 * self.max_batch + 1024), np.int32)
        self._be.h2d_into(self._stage, buf)
        cfg = TableUpdateConfig()
        params = TABLE_UPDATE_PARAMS.pack(src=self._be.info(self._stage).ptr, block_table=self._bt_ptr,
                                          seqlens=self._len_ptr, table_size=self._bt_host.size,
                                          num_lens=self.max_batch, num_entries=n)
        launch(cfg, (-(-buf.size // cfg.threads), 1, 1), (params,), self.device, self._be.stream())

    # ---- reservation -----------------------------------------------------------------------
    def reserve(self, num_tokens: int = 1) -> None:
        """Make room for ``num_tokens`` more tokens in every sequence of the active batch.

        Takes fresh pages where a sequence's last page is full; a partly filled last page that
        is shared (a fork) is first copied, all layers, K and V, on the device, and the sequence
        points at its copy. Then lengths grow by ``num_tokens`` and the device tables are updated.

        Raises
        ------
        OutOfPagesError
            The pool cannot serve the whole batch; nothing changed.
        ValueError
            A sequence would exceed ``max_pages_per_seq``; nothing changed.
        """
        t = _check_int("num_tokens", num_tokens)
        b = len(self._active)
        if b == 0:
            return
        lens = self._len_host[:b].astype(np.int64)
        have = -(-lens // self.page_size)
        lasts = self._bt_host[np.arange(b), np.maximum(have - 1, 0)]
        self._grow(self._active, list(range(b)), lens, lasts, t, "reserve")
        self._len_host[:b] += t
        self._upload()

    def extend_reserve(self, seq: int, num_tokens: int) -> int:
        """Make room for ``num_tokens`` more tokens of sequence ``seq`` (a prefill, or a chunk of
        one); returns the position of the first new token. Copy-on-write and errors as
        :meth:`reserve`; ``seq`` may be in the active batch (its row is updated and uploaded)."""
        s = self._get(seq)
        t = _check_int("num_tokens", num_tokens)
        row = self._row.get(id(s))
        start = s.length
        lasts = np.array([s.pages[-1] if s.pages else 0], dtype=np.int64)
        self._grow([s], [row], np.array([start], dtype=np.int64), lasts, t, "extend_reserve")
        if row is not None:
            self._len_host[row] = s.length
            self._upload()
        return start

    def _grow(self, seqs: list[_Seq], rows: list[int | None], lens: np.ndarray, lasts: np.ndarray,
              t: int, what: str) -> None:
        """Plan (nothing changes if it fails), then commit: pages, copies, lengths, host table."""
        new, cow = self._plan(lens, lasts, t, what)
        need = int(new.sum()) + len(cow)
        if need > len(self._free):
            raise OutOfPagesError(need, len(self._free), f"{what}({t}) for {len(seqs)} sequences")
        fresh = self._take(need)
        src, dst = [], []
        for i in cow:  # the copy replaces the shared last page
            s = seqs[i]
            src.append(s.pages[-1])
            dst.append(fresh.pop())
            self._refcnt[s.pages[-1]] -= 1
            s.pages[-1] = dst[-1]
            self._set_entries(rows[i], len(s.pages) - 1, [dst[-1]])
        for i in np.flatnonzero(new):
            s = seqs[i]
            got = [fresh.pop() for _ in range(int(new[i]))]
            self._set_entries(rows[i], len(s.pages), got)
            s.pages.extend(got)
        for s in seqs:
            s.length += t
        if src:
            log.debug("copy-on-write of pages %s -> %s", src, dst)
            for pool in (self._k, self._v, *self._scale_pools):
                self._be.copy_pages(pool, np.asarray(src), np.asarray(dst))
        self._append_ok = None

    def _plan(self, lens: np.ndarray, lasts: np.ndarray, t: int, what: str) -> tuple[np.ndarray, list[int]]:
        """New pages per row, and the rows whose shared partly filled last page must be copied."""
        ps = self.page_size
        have, want = -(-lens // ps), -(-(lens + t) // ps)
        if want.size and int(want.max()) > self.max_pages_per_seq:
            raise ValueError(f"{what}: num_tokens={t} makes a sequence of {int(lens.max()) + t} "
                             f"tokens > max_pages_per_seq * page_size = {self.max_pages_per_seq * ps}")
        shared = np.flatnonzero((lens % ps != 0) & (self._refcnt[lasts] > 1))
        cow, taken = [], {}
        for i in shared.tolist():  # a page may be the last page of several rows: copy for all but one
            pg = int(lasts[i])
            if self._refcnt[pg] - taken.get(pg, 0) > 1:
                cow.append(i)
                taken[pg] = taken.get(pg, 0) + 1
        return want - have, cow

    def _take(self, n: int) -> list[int]:
        """Pop ``n`` pages off the free list (refcount 1), as a stack ``pop()`` yields them in order."""
        if n == 0:
            return []
        got = self._free[-n:]
        del self._free[-n:]
        self._refcnt[np.asarray(got, dtype=np.int64)] = 1
        return got

    def _set_entries(self, row: int | None, col: int, pages: list[int]) -> None:
        if row is None or not pages:
            return
        self._bt_host[row, col:col + len(pages)] = pages
        self._dirty.append(row * self.max_pages_per_seq + col + np.arange(len(pages), dtype=np.int64))

    # ---- writes ----------------------------------------------------------------------------
    def append(self, layer: int, k_new: Any, v_new: Any) -> None:
        """Write one decode step's K/V of the active batch into ``layer`` at position
        ``seqlens[b] - 1`` of each sequence b (call :meth:`reserve` first, then this per layer).

        Parameters
        ----------
        layer : int
            In ``[0, num_layers)``.
        k_new, v_new : array
            ``[B, num_kv_heads, head_dim]`` of the cache dtype and array type (backend), on the
            cache's device; B the active batch size. Read only.

        On cupy/torch this is one kernel launch that reads ``block_table`` and ``seqlens`` from
        device memory (no synchronisation), so it may be captured in a CUDA graph and replayed
        after later ``reserve`` calls. On numpy, a NumPy scatter.
        """
        layer = self._check_layer(layer)
        b = len(self._active)
        ki = self._check_rows("k_new", k_new, b)
        vi = self._check_rows("v_new", v_new, b)
        self._check_batch_writable()
        if b == 0:
            return
        if self.backend == "numpy":
            pos = self._len_dev[:b].astype(np.int64) - 1
            pages = self._bt_dev[np.arange(b), pos // self.page_size]
            self._scatter(layer, pages, pos % self.page_size, k_new, v_new)
            return
        self._written[layer] = True
        k_new, ki = self._aligned(k_new, ki)
        v_new, vi = self._aligned(v_new, vi)
        self._launch(layer, ki, vi, rows=b, block_table=self._bt_ptr, bt_row_stride=self.max_pages_per_seq,
                     seqlens=self._len_ptr, max_pages=self.max_pages_per_seq, pos0=0)

    def append_rope(self, layer: int, qkv: Any, cos: Any, sin: Any, q_out: Any) -> None:
        """One decode step's fused QKV projection rows, split, rotated and written in one launch:
        q and k rotated by RoPE at position ``seqlens[b] - 1`` of each sequence b, q written to
        ``q_out``, k and v appended into ``layer`` as :meth:`append` writes them (call
        :meth:`reserve` first). The values of a RoPE kernel followed by :meth:`append`, bit for bit.

        Parameters
        ----------
        layer : int
            In ``[0, num_layers)``.
        qkv : array
            ``[B, (Hq + 2 num_kv_heads) head_dim]`` of the cache dtype (fp16, bf16 or fp32): each
            row the q heads, then the k heads, then the v heads; B the active batch size, Hq the
            query heads (``q_out``'s). Read only.
        cos, sin : float32 arrays ``[n_pos, head_dim // 2]``
            The RoPE tables: row p holds cos / sin of p times each frequency. Rotate-half form
            (GPT-NeoX, Llama): for i < D/2, ``x'[i] = x[i] cos - x[i + D/2] sin`` and
            ``x'[i + D/2] = x[i + D/2] cos + x[i] sin``, each product and sum rounded in float32,
            the result to the cache dtype. Positions past the table use its last row.
        q_out : array
            ``[B, Hq, head_dim]`` of the cache dtype, last axis contiguous and rows 16-byte aligned;
            written. Must not overlap ``qkv``, ``cos`` or ``sin`` (ValueError on every backend).

        head_dim must be a multiple of 16. One kernel launch on cupy/torch (no synchronisation;
        CUDA-graph capturable like :meth:`append`); NumPy arithmetic on numpy.
        """
        layer = self._check_layer(layer)
        be, b = self._be, len(self._active)
        h, d = self.num_kv_heads, self.head_dim
        if d % 16:
            raise ValueError(f"append_rope needs head_dim a multiple of 16 (the cache's is {d})")
        qi = self._check_array("q_out", q_out, 3, self._xp_dtype, self.dtype)
        if qi.shape[0] != b or qi.shape[2] != d or qi.shape[1] < 1:
            raise ValueError(f"q_out must have shape ({b}, Hq >= 1, {d}) ([B, Hq, head_dim], B the "
                             f"active batch), got {tuple(qi.shape)}")
        hq = qi.shape[1]
        xi = self._check_array("qkv", qkv, 2, self._xp_dtype, self.dtype)
        if tuple(xi.shape) != (b, (hq + 2 * h) * d):
            raise ValueError(f"qkv must have shape ({b}, {(hq + 2 * h) * d}) ([B, (Hq + 2 num_kv_heads) "
                             f"head_dim] with Hq = {hq} from q_out), got {tuple(xi.shape)}")
        ci = self._check_array("cos", cos, 2, be.dtype_of("fp32"), "fp32")
        si = self._check_array("sin", sin, 2, be.dtype_of("fp32"), "fp32")
        for name, info in (("cos", ci), ("sin", si)):
            if info.shape[1] != d // 2 or info.shape[0] < 1 or info.shape != ci.shape:
                raise ValueError(f"{name} must have shape (n_pos >= 1, {d // 2}) like cos, got {tuple(info.shape)}")
        self._check_q_out_apart(qi, (("qkv", xi, self.dtype), ("cos", ci, "fp32"), ("sin", si, "fp32")))
        self._check_batch_writable()
        if b == 0:
            return
        if self.backend == "numpy":
            self._rope_scatter(layer, qkv, cos, sin, q_out, hq)
            return
        self._launch_rope(layer, qkv, xi, ci, si, qi, cos, sin)

    def _launch_rope(self, layer: int, qkv: Any, xi: _ArrayInfo, ci: _ArrayInfo, si: _ArrayInfo, qi: _ArrayInfo,
                     cos: Any, sin: Any) -> None:
        """append_rope's launch (checked arguments, q_out apart from the inputs): qkv / the tables
        copied when the kernel cannot read them in place, q_out refused when it cannot be written in place."""
        be, b, h, d = self._be, qi.shape[0], self.num_kv_heads, self.head_dim
        hq = qi.shape[1]
        isz = DTYPES[self.dtype].itemsize
        if qi.strides[2] != 1 or qi.ptr % 16 or any(n > 1 and (st * isz) % 16 for n, st in zip(qi.shape[:2], qi.strides[:2], strict=True)):
            raise ValueError(f"q_out must have a contiguous last axis and 16-byte aligned rows (strides "
                             f"{qi.strides} elements, address {qi.ptr:#x})")
        if xi.strides[1] != 1 or xi.ptr % 16 or (b > 1 and (xi.strides[0] * isz) % 16):
            qkv = be.copy(qkv)
            xi = be.info(qkv)
        tabs = []
        for t, info in ((cos, ci), (sin, si)):
            if info.strides != (d // 2, 1):
                t = be.copy(t)
                info = be.info(t)
            tabs.append((t, info))  # keep a copy alive through the launch
        self._written[layer] = True
        row = xi.strides[0]
        kinfo = _ArrayInfo((b, h, d), (row, d, 1), xi.ptr + hq * d * isz, xi.device)
        vinfo = _ArrayInfo((b, h, d), (row, d, 1), xi.ptr + (hq + h) * d * isz, xi.device)
        values = self._pool_values(layer, kinfo, vinfo, rows=b, block_table=self._bt_ptr,
                                   bt_row_stride=self.max_pages_per_seq, seqlens=self._len_ptr,
                                   max_pages=self.max_pages_per_seq, pos0=0)
        params = np.array(tuple(values[n] for n in _Q_PARAM_NAMES), dtype=PAGED_APPEND_Q_PARAMS.dtype)[()]
        rope = ROPE_APPEND_PARAMS.pack(q_src=xi.ptr, q_out=qi.ptr, cos_t=tabs[0][1].ptr, sin_t=tabs[1][1].ptr,
                                       q_src_row=row, q_src_head=d, q_out_row=qi.strides[0],
                                       q_out_head=qi.strides[1], num_q_heads=hq, n_pos=ci.shape[0])
        from fdpp.launch import launch

        cfg = PagedRopeAppendConfig(self.dtype, self.kv_format, self.group_size if self.kv_format == "int4" else 0,
                                    d, self.page_size, self.kv_layout == "HND")
        grid = (-(-b * max(hq, h) * (d // 8) // APPEND_THREADS), 3, 1)
        launch(cfg, grid, (params, rope), self.device, be.stream())

    def _rope_scatter(self, layer: int, qkv: Any, cos: Any, sin: Any, q_out: Any, hq: int) -> None:
        """append_rope on numpy: the rotation in float32 (each product and sum rounded), rounded to
        the cache dtype, then :meth:`append`'s scatter."""
        b, h, d = q_out.shape[0], self.num_kv_heads, self.head_dim
        lens = self._len_dev[:b].astype(np.int64)
        pos = np.clip(lens - 1, 0, cos.shape[0] - 1)
        c = np.asarray(cos, dtype=np.float32)[pos][:, None, :]
        sn = np.asarray(sin, dtype=np.float32)[pos][:, None, :]
        x = qkv.reshape(b, hq + 2 * h, d)
        qk = x[:, :hq + h].astype(np.float32)
        x1, x2 = qk[..., :d // 2], qk[..., d // 2:]
        rot = np.concatenate([x1 * c - x2 * sn, x2 * c + x1 * sn], axis=-1).astype(q_out.dtype)
        q_out[...] = rot[:, :hq]
        self._scatter(layer, self._bt_dev[np.arange(b), (lens - 1) // self.page_size], (lens - 1) % self.page_size,
                      rot[:, hq:], np.ascontiguousarray(x[:, hq + h:]))

    def extend(self, layer: int, seq: int, k: Any, v: Any) -> None:
        """Write a prefill's K/V for sequence ``seq`` into ``layer``: the T rows of ``k``/``v`` go to
        positions ``length(seq) - T .. length(seq) - 1`` (call :meth:`extend_reserve` once, then
        this per layer).

        Parameters
        ----------
        layer : int
            In ``[0, num_layers)``.
        seq : int
            A live sequence id (in the active batch or not).
        k, v : array
            ``[T, num_kv_heads, head_dim]``, 1 <= T <= ``length(seq)``, of the cache dtype and array
            type, on the cache's device. Read only.

        One kernel launch on cupy/torch (the page list of those positions is uploaded, and
        reused while it does not change); a NumPy scatter on numpy. No loop over tokens.
        """
        layer = self._check_layer(layer)
        s = self._get(seq)
        ki = self._check_rows("k", k, None)
        t = ki.shape[0]
        vi = self._check_rows("v", v, t)
        if t > s.length:
            raise ValueError(f"k has {t} tokens but seq {seq} holds {s.length}: call "
                             f"extend_reserve(seq, {t}) first")
        start, ps = s.length - t, self.page_size
        first, last = start // ps, (s.length - 1) // ps
        span = s.pages[first:last + 1]
        if int(self._refcnt[np.asarray(span, dtype=np.int64)].max()) > 1:
            raise ValueError(f"positions {start}..{s.length - 1} of seq {seq} lie in pages shared with "
                             f"another sequence (a fork); reserve them with extend_reserve first")
        if self.backend == "numpy":
            pos = np.arange(start, s.length, dtype=np.int64)
            self._scatter(layer, np.asarray(s.pages, dtype=np.int64)[pos // ps], pos % ps, k, v)
            return
        self._written[layer] = True
        k, ki = self._aligned(k, ki)
        v, vi = self._aligned(v, vi)
        table = self._extend_table(span)
        self._launch(layer, ki, vi, rows=t, block_table=self._be.info(table).ptr, bt_row_stride=0,
                     seqlens=0, max_pages=len(span), pos0=start - first * ps)

    def _extend_table(self, span: list[int]) -> Any:
        key = tuple(span)
        if self._ext_pages[0] != key:
            self._ext_pages = (key, self._be.to_device(np.asarray(span, dtype=np.int32)))
        return self._ext_pages[1]

    def _scatter(self, layer: int, pages: np.ndarray, slots: np.ndarray, k: Any, v: Any) -> None:
        self._written[layer] = True
        fmt = self.kv_format
        writes = []  # (pool of this layer, rows [T, Hkv, *])
        if fmt is None:
            writes = [(self._k[layer], k), (self._v[layer], v)]
        elif fmt in quant.FP8:
            writes = [(self._k[layer], quant.fp8_quantize(k, fmt, self._kd[layer][:, None])),
                      (self._v[layer], quant.fp8_quantize(v, fmt, self._vd[layer][:, None]))]
        else:
            assert self.group_size is not None
            k_sc, k_zp, v_sc, v_zp = self._scale_pools
            for name, pool, sp, zp, x in (("k", self._k, k_sc, k_zp, k), ("v", self._v, v_sc, v_zp, v)):
                packed, sc, zero = quant.int4_quantize(x, self.group_size)
                if np.isfinite(sc).all() and quant.int4_groups_bad(sc, zero).any():  # finite rows near +-65504
                    raise ValueError(f"{name} holds {quant.INT4_RANGE}: its int4 levels would read back as inf")
                writes += [(pool[layer], packed), (sp[layer], sc), (zp[layer], zero)]
        for pool, x in writes:
            if self.kv_layout == "NHD":
                pool[pages, slots] = x
            else:
                pool[pages, :, slots] = x

    def _launch(self, layer: int, ki: _ArrayInfo, vi: _ArrayInfo, **fields: int) -> None:
        """One paged_append (or paged_append_quant) launch writing ``ki`` / ``vi``'s rows into ``layer``."""
        from fdpp.launch import launch

        values = self._pool_values(layer, ki, vi, **fields)
        h, d = self.num_kv_heads, self.head_dim
        if self.kv_format is not None:
            params = np.array(tuple(values[n] for n in _Q_PARAM_NAMES), dtype=PAGED_APPEND_Q_PARAMS.dtype)[()]
            vpr = d // 8
        else:
            # one tuple -> record (what PAGED_APPEND_PARAMS.pack builds, without a store per field)
            params = np.array(tuple(values[n] for n in _PARAM_NAMES), dtype=PAGED_APPEND_PARAMS.dtype)[()]
            vpr = d * DTYPES[self.dtype].itemsize // self._cfg.vec_bytes
        grid = (-(-fields["rows"] * h * vpr // APPEND_THREADS), 2, 1)
        launch(self._cfg, grid, (params,), self.device, self._be.stream())

    def _pool_values(self, layer: int, ki: _ArrayInfo, vi: _ArrayInfo, **fields: int) -> dict[str, int]:
        """The fields of PagedAppendQParams (a plain cache: PagedAppendParams' and zeros) for writes of
        ``ki`` / ``vi``'s rows into ``layer``: pool strides in the pool's elements (the cache dtype, or
        bytes for a quantized pool), the scales of ``layer``."""
        ps, h, d = self.page_size, self.num_kv_heads, self.head_dim
        fmt = self.kv_format
        row = d if fmt is None or fmt in quant.FP8 else d // 2  # pool elements per (token, head)
        page = ps * h * row
        s1, s2 = (h * row, row) if self.kv_layout == "NHD" else (ps * row, row)
        off = layer * self.num_pages * page * (DTYPES[self.dtype].itemsize if fmt is None else 1)
        be = self._be
        values = dict(
            k_src=ki.ptr, v_src=vi.ptr, k_pool=self._k_ptr + off, v_pool=self._v_ptr + off,
            k_src_row=ki.strides[0], k_src_head=ki.strides[1], v_src_row=vi.strides[0],
            v_src_head=vi.strides[1], k_page=page, k_s1=s1, k_s2=s2, v_page=page, v_s1=s1, v_s2=s2,
            num_heads=h, num_pages=self.num_pages, k_sc=0, v_sc=0, k_zp=0, v_zp=0, sc_page=0, sc_s1=0, sc_s2=0,
            **fields)
        if fmt in quant.FP8:
            values.update(k_sc=be.info(self._kd).ptr + layer * h * 4, v_sc=be.info(self._vd).ptr + layer * h * 4)
        elif fmt is not None:
            assert self.group_size is not None
            srow = d // self.group_size
            sc_page = ps * h * srow
            ss1, ss2 = (h * srow, srow) if self.kv_layout == "NHD" else (ps * srow, srow)
            soff = layer * self.num_pages * sc_page * 2  # bytes (fp16)
            ptrs = [be.info(p).ptr + soff for p in self._scale_pools]
            values.update(k_sc=ptrs[0], k_zp=ptrs[1], v_sc=ptrs[2], v_zp=ptrs[3], sc_page=sc_page, sc_s1=ss1,
                          sc_s2=ss2)
        return values

    # ---- write checks ----------------------------------------------------------------------
    def _check_rows(self, name: str, x: Any, rows: int | None) -> _ArrayInfo:
        """``x`` is a ``[rows, num_kv_heads, head_dim]`` array of the backend, dtype and device
        (rows None: any positive count)."""
        be = self._be
        if not be.is_array(x):
            raise TypeError(f"{name} must be a {be.array_type} (the cache's backend is "
                            f"{self.backend!r}), got {type(x).__module__}.{type(x).__name__}")
        info = be.info(x)
        tail = (self.num_kv_heads, self.head_dim)
        if len(info.shape) != 3 or info.shape[1:] != tail or (rows is None and info.shape[0] < 1) or (
                rows is not None and info.shape[0] != rows):
            want = f"({'T >= 1' if rows is None else rows}, {tail[0]}, {tail[1]})"
            raise ValueError(f"{name} must have shape {want} ([rows, num_kv_heads, head_dim]), "
                             f"got {tuple(info.shape)}")
        if x.dtype != self._xp_dtype:
            raise TypeError(f"{name} dtype must be {self.dtype} (the cache's), got {x.dtype}")
        if info.device != self.device:
            where = "the host" if info.device < 0 else f"device {info.device}"
            raise ValueError(f"{name} is on {where}; the cache is on device {self.device}")
        return info

    def _check_array(self, name: str, x: Any, ndim: int, dtype: Any, dtype_name: str) -> _ArrayInfo:
        """``x`` is an ``ndim``-dimensional array of the backend, of ``dtype``, on the cache's device."""
        be = self._be
        if not be.is_array(x):
            raise TypeError(f"{name} must be a {be.array_type} (the cache's backend is "
                            f"{self.backend!r}), got {type(x).__module__}.{type(x).__name__}")
        info = be.info(x)
        if len(info.shape) != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(info.shape)}")
        if x.dtype != dtype:
            raise TypeError(f"{name} dtype must be {dtype_name}, got {x.dtype}")
        if info.device != self.device:
            where = "the host" if info.device < 0 else f"device {info.device}"
            raise ValueError(f"{name} is on {where}; the cache is on device {self.device}")
        return info

    def _check_q_out_apart(self, qi: _ArrayInfo, inputs: tuple[tuple[str, _ArrayInfo, str], ...]) -> None:
        """append_rope's q_out (of the cache dtype) shares no byte with any of ``inputs`` ((name, info,
        dtype name): what the kernel reads while it writes q_out), strides of either sign; checked on
        the caller's arrays before any copy, the same on every backend."""
        qlo, qhi = _byte_range(qi, DTYPES[self.dtype].itemsize)
        for name, info, dt in inputs:
            lo, hi = _byte_range(info, DTYPES[dt].itemsize)
            if qlo < hi and lo < qhi:
                raise ValueError(f"q_out must not overlap {name} (the kernel reads {name}'s rows while it writes q_out)")

    def _aligned(self, x: Any, info: _ArrayInfo) -> tuple[Any, _ArrayInfo]:
        """``x`` itself when the kernel's vector copies can read it in place, else a packed copy."""
        vb, isz = self._cfg.vec_bytes, DTYPES[self.dtype].itemsize
        ok = info.ptr % vb == 0 and all(
            n == 1 or (s * isz) % vb == 0 for n, s in zip(info.shape[:2], info.strides[:2], strict=True))
        if ok and (info.shape[2] == 1 or info.strides[2] == 1):
            return x, info
        log.debug("copying a %s array: strides %s / pointer not aligned to %d B", info.shape,
                  info.strides, vb)
        y = self._be.copy(x)
        return y, self._be.info(y)

    def _check_batch_writable(self) -> None:
        """Every active sequence has a reserved slot in an unshared page (cached until the batch,
        a reservation or a fork changes)."""
        if self._append_ok is None:
            self._append_ok = self._batch_problem()
        if self._append_ok:
            raise ValueError(self._append_ok)

    def _batch_problem(self) -> str:
        b = len(self._active)
        if b == 0:
            return ""
        lens = self._len_host[:b].astype(np.int64)
        if int(lens.min()) < 1:
            r = int(np.argmin(lens))
            return f"row {r} of the active batch holds no token: call reserve(1) before append"
        pages = self._bt_host[np.arange(b), (lens - 1) // self.page_size]
        shared = np.flatnonzero(self._refcnt[pages] > 1)
        if shared.size:
            r = int(shared[0])
            return (f"the slot append writes for row {r} (position {lens[r] - 1}) lies in page "
                    f"{pages[r]}, shared with another sequence (forked after reserve?): call reserve first")
        return ""
