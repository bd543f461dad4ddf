"""CPU stand-ins for CuPy arrays, torch tensors and the kernel launcher, so the host fast path
(launch records, ``_fast``, ``DecodePlan.run``, flat_gemm's records) runs and can be micro-timed
without a GPU. Only what fdpp's host path touches is modelled; no kernel ever runs.

``install(monkeypatch)`` puts a fake ``cupy`` and ``torch`` into ``sys.modules`` and points the
registry at a stub compiled kernel that records its launches (``LAUNCHES``).
"""

from __future__ import annotations

import functools
import math
import sys
import types
from typing import Any

import numpy as np

from fdpp import plan as fdpp_plan

LAUNCHES: list[tuple] = []  # (grid, block, args, shared_mem, stream) of every stub launch
_next_ptr = [1 << 32]


def _alloc(nbytes: int) -> int:
    p = _next_ptr[0]
    _next_ptr[0] += (max(int(nbytes), 1) + 255) // 256 * 256 + 256
    return p


_c_strides = functools.cache(fdpp_plan._c_strides)


# ---- CuPy ---------------------------------------------------------------------------------
class _Allocation:
    """The memory a pointer belongs to (CuPy's ``MemoryPointer.mem``)."""

    __slots__ = ("__weakref__",)


class _Mem:  # CuPy's MemoryPointer
    __slots__ = ("ptr", "device_id", "mem")

    def __init__(self, ptr: int, device_id: int = 0, mem: _Allocation | None = None):
        self.ptr, self.device_id = ptr, device_id
        self.mem = _Allocation() if mem is None else mem


class _Dev:
    __slots__ = ("id",)

    def __init__(self, i: int):
        self.id = i


_META: dict[tuple, tuple] = {}
_DEVS = [_Dev(i) for i in range(8)]


class ndarray:  # noqa: N801 - CuPy's name: fdpp tells array types by module
    __module__ = "cupy"

    def __init__(self, shape: tuple[int, ...], dtype: Any = np.float16, ptr: int | None = None,
                 strides: tuple[int, ...] | None = None, device: int = 0):
        key = (shape, dtype, strides)
        meta = _META.get(key)
        if meta is None:
            shp = tuple(int(s) for s in shape)
            dt = np.dtype(dtype)
            el = strides if strides is not None else _c_strides(shp)
            meta = _META[key] = (shp, dt, dt.itemsize, tuple(int(s) * dt.itemsize for s in el),
                                 math.prod(shp))
        self.shape, self.dtype, self.itemsize, self.strides, self.size = meta
        self.data = _Mem(_alloc(self.size * self.itemsize) if ptr is None else ptr, device)
        self.device = _DEVS[device] if device < len(_DEVS) else _Dev(device)

    def view_at(self, byte_offset: int) -> ndarray:
        """The same shape and strides ``byte_offset`` bytes further on (a misaligned view)."""
        return ndarray(self.shape, self.dtype, self.data.ptr + byte_offset,
                       tuple(s // self.itemsize for s in self.strides), self.data.device_id)

    def view(self) -> ndarray:
        """A view, as CuPy makes one: it holds its base and a pointer into the same memory."""
        v = ndarray(self.shape, self.dtype, self.data.ptr, tuple(s // self.itemsize for s in self.strides),
                    self.data.device_id)
        v.data = _Mem(self.data.ptr, self.data.device_id, self.data.mem)
        v.base = self
        return v


class _Stream:
    def __init__(self, ptr: int = 0):
        self.ptr = ptr

    def is_capturing(self) -> bool:
        return False

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _Device:
    def __init__(self, i: int | None = None):
        self.id = 0 if i is None else int(i)

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL_STREAM = _Stream(0)


def fake_cupy() -> types.ModuleType:
    mod = types.ModuleType("cupy")
    mod.ndarray = ndarray
    mod.empty = lambda shape, dtype=np.float32: ndarray(shape if isinstance(shape, tuple) else (shape,), dtype)
    mod.zeros = mod.empty
    mod.float32, mod.float16, mod.int32 = np.float32, np.float16, np.int32
    runtime = types.SimpleNamespace(getDevice=lambda: 0, deviceSynchronize=lambda: None,
                                    memsetAsync=lambda ptr, value, size, stream: None)
    stream_cls = type("Stream", (_Stream,), {})
    mod.cuda = types.SimpleNamespace(
        runtime=runtime, Device=_Device, Stream=stream_cls,
        get_current_stream=lambda device=None: _NULL_STREAM,
        alloc=lambda nbytes: _Mem(_alloc(nbytes), 0),
        ExternalStream=lambda ptr, device=0: _Stream(ptr))
    return mod


# ---- torch --------------------------------------------------------------------------------
class _TDtype:
    def __init__(self, name: str, itemsize: int):
        self.name, self.itemsize = name, itemsize

    def __repr__(self) -> str:
        return f"torch.{self.name}"


float16, bfloat16, float32, int32 = (_TDtype("float16", 2), _TDtype("bfloat16", 2), _TDtype("float32", 4),
                                     _TDtype("int32", 4))


class device(tuple):  # noqa: N801 - torch's name
    """torch.device('cuda', index): hashable, with .type and .index."""

    __module__ = "torch"

    def __new__(cls, kind: str = "cuda", index: int = 0):
        return super().__new__(cls, (kind, index))

    @property
    def type(self) -> str:
        return self[0]

    @property
    def index(self) -> int:
        return self[1]


_TDEVS = [device("cuda", i) for i in range(8)]


class Tensor:
    __module__ = "torch"

    def __init__(self, shape: tuple[int, ...], dtype: _TDtype = float16, ptr: int | None = None,
                 strides: tuple[int, ...] | None = None, dev: int = 0):
        self.shape = tuple(shape)
        self.dtype = dtype
        self._strides = tuple(strides) if strides is not None else _c_strides(self.shape)
        self._ptr = _alloc(math.prod(self.shape) * dtype.itemsize) if ptr is None else ptr
        self.device = _TDEVS[dev]
        self.is_cuda = True

    def stride(self) -> tuple[int, ...]:
        return self._strides

    def data_ptr(self) -> int:
        return self._ptr

    def get_device(self) -> int:
        return self.device.index

    def element_size(self) -> int:
        return self.dtype.itemsize

    def numel(self) -> int:
        return math.prod(self.shape)

    def __getitem__(self, s: slice) -> Tensor:
        start = s.start or 0
        stop = self.shape[0] if s.stop is None else s.stop
        return Tensor((stop - start,), self.dtype, self._ptr + start * self.dtype.itemsize)

    def view(self, *shape: Any) -> Tensor:
        shp = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        return Tensor(tuple(shp), self.dtype, self._ptr)

    def t(self) -> Tensor:
        return Tensor(self.shape[::-1], self.dtype, self._ptr, self._strides[::-1])

    def view_at(self, byte_offset: int) -> Tensor:
        return Tensor(self.shape, self.dtype, self._ptr + byte_offset, self._strides, self.device.index)

    def new_empty(self, shape: tuple[int, ...]) -> Tensor:
        return Tensor(tuple(shape), self.dtype, dev=self.device.index)


class _TStream:
    def __init__(self, ptr: int):
        self.cuda_stream = ptr


def fake_torch() -> types.ModuleType:
    mod = types.ModuleType("torch")
    mod.Tensor, mod.device = Tensor, device
    mod.float16, mod.bfloat16, mod.float32, mod.int32 = float16, bfloat16, float32, int32

    def empty(shape: Any, dtype: _TDtype = float32, device: Any = None) -> Tensor:
        shp = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
        return Tensor(shp, dtype, dev=getattr(device, "index", 0) or 0)

    mod.empty = empty
    mod.empty_like = lambda t: Tensor(t.shape, t.dtype, strides=t.stride(), dev=t.device.index)
    mod.zeros = empty  # the fused plans' tickets
    cur = _TStream(0x5000)
    mod.cuda = types.SimpleNamespace(current_stream=lambda dev=None: cur, _stream=cur,
                                     is_current_stream_capturing=lambda: False)
    mod._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda idx: cur.cuda_stream)
    return mod


# ---- the compiled kernel ------------------------------------------------------------------
class _Function:
    """A compiled function's stand-in: records each launch (grid, block, args, smem, stream)."""

    ptr = 0xF000

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, stream: Any = None) -> None:
        LAUNCHES.append((grid, block, tuple(bytes(a) if isinstance(a, np.void) else a for a in args),
                         shared_mem, stream))


class _RawKernel:
    def __init__(self) -> None:
        self.kernel = _Function()
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, stream: Any = None) -> None:
        self.kernel(grid, block, args, shared_mem=shared_mem, stream=stream)


_KERNEL = _RawKernel()


def install(monkeypatch: Any, record: bool = True) -> None:
    """Fake cupy and torch modules, the SM90 device limits and a recording stub kernel."""
    import fdpp.api
    import fdpp.registry
    from fdpp import plan
    from fdpp.configs import SM90

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    monkeypatch.setitem(sys.modules, "torch", fake_torch())
    monkeypatch.setattr(fdpp.registry, "device_limits", lambda d=0: SM90)
    monkeypatch.setattr(fdpp.registry, "get_kernel", lambda cfg, dev=None: _KERNEL)
    monkeypatch.setattr(fdpp.api, "gpu_available", lambda: True)
    if not record:
        monkeypatch.setattr(_Function, "__call__", lambda self, *a, **kw: None)
    LAUNCHES.clear()
    # fresh caches, put back at teardown: nothing made of stand-ins outlives the test (a later
    # GPU test would find a stand-in workspace under the null stream's key)
    from fdpp import gemm, launch, workspace

    for mod, name in ((plan, "_records"), (workspace, "_partials"), (workspace, "_tickets"),
                      (workspace, "_retired"), (fdpp.api, "_KINDS"), (launch, "_ext_streams"),
                      (gemm, "_records"), (gemm, "_occupancy")):
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, type(getattr(mod, name))())
    monkeypatch.setattr(launch, "LAUNCHER", "cupy")  # the stub kernel records CuPy-style calls
    # the CUDA occupancy calculator (a fused GEMM on the heuristic's plan sizes one wave with it)
    monkeypatch.setattr(gemm, "resident_ctas", lambda cfg, device_id: 1)


def llama_inputs(kind: str = "cupy", b: int = 1, hq: int = 32, hkv: int = 8, d: int = 128,
                 n: int = 1024) -> tuple[Any, Any, Any]:
    if kind == "torch":
        return Tensor((b, hq, d)), Tensor((b, n, hkv, d)), Tensor((b, n, hkv, d))
    return ndarray((b, hq, d)), ndarray((b, n, hkv, d)), ndarray((b, n, hkv, d))
