"""Streams and launches on the device, shared by every op (attention, paged append, GEMM).

- :func:`stream_for` — the CuPy stream a call runs on: CuPy's current stream for CuPy arrays,
  torch's current stream (wrapped once, zero-copy) for torch tensors.
- :func:`launch` — one kernel config launched with its argument tuple on a stream.

The argument of every fdpp kernel family is one C struct passed by value; :class:`ParamStruct`
builds its NumPy mirror (a structured scalar, C layout) from a field list, so Python and C++
agree on one definition per family (tests/test_compile.py checks the offsets against the
compiler).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

_ext_streams: dict[tuple[int, int], Any] = {}


class EnvWatch:
    """The raw value of one environment variable, read cheaply on every call (a part of launch-record
    keys). CPython keeps ``os.environ``'s mapping in ``_data``: one dict lookup instead of
    ``os.environ.get``'s encode/decode (~0.8 us). The value is bytes (POSIX) or str, None if unset."""

    __slots__ = ("name", "_data", "_key")

    def __init__(self, name: str):
        self.name = name
        self._data = getattr(os.environ, "_data", None)
        try:
            self._key: Any = os.environ.encodekey(name)  # type: ignore[attr-defined]
        except AttributeError:  # pragma: no cover - not CPython's os.environ
            self._data = None

    def __call__(self) -> Any:
        if self._data is not None:
            return self._data.get(self._key)
        return os.environ.get(self.name)  # pragma: no cover


def stream_for(kind: str, device: int, torch_device: Any = None) -> Any:
    """The CuPy stream a call on ``device`` runs on (``kind``: "cupy" or "torch")."""
    import cupy

    if kind == "torch":
        import torch

        ts = torch.cuda.current_stream(torch_device if torch_device is not None else device)
        key = (device, ts.cuda_stream)
        s = _ext_streams.get(key)
        if s is None:
            s = _ext_streams[key] = _wrap_torch_stream(cupy, ts, device)
        return s
    return cupy.cuda.get_current_stream(device)


def current_stream_fn(kind: str, device: int) -> Any:
    """A no-argument function returning what :func:`stream_for` returns for (``kind``,
    ``device``), bound once (a launch record's per-call stream lookup). For torch it reads the
    raw current stream (``torch._C._cuda_getCurrentRawStream``, what torch's own generated code
    uses) instead of building a ``torch.cuda.Stream`` object per call."""
    import cupy

    if kind == "torch":
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is None:  # an older torch: the general path
            return lambda: stream_for("torch", device)
        streams = _ext_streams

        def torch_stream() -> Any:
            s = streams.get((device, raw(device)))
            return s if s is not None else stream_for("torch", device)

        return torch_stream
    get = cupy.cuda.get_current_stream
    return lambda: get(device)


def _wrap_torch_stream(cupy: Any, ts: Any, device: int) -> Any:
    """A CuPy view of torch stream ``ts``: ``Stream.from_external`` (CuPy 14, the CUDA stream
    protocol) where torch implements the protocol, else the older ``ExternalStream``."""
    if hasattr(cupy.cuda.Stream, "from_external") and hasattr(ts, "__cuda_stream__"):
        return cupy.cuda.Stream.from_external(ts)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(ts.cuda_stream, device)


def launch(config: Any, grid: tuple[int, int, int], args: tuple, device: int, stream: Any) -> None:
    """Launch ``config`` (a registry kernel config) with ``grid`` and ``args`` on ``stream``."""
    import cupy

    from fdpp import registry

    kern = registry.get_kernel(config, device)
    with cupy.cuda.Device(device), stream:
        kern(grid, (config.threads, 1, 1), args, shared_mem=config.smem_bytes())


#: How :class:`KernelCall` launches: "cupy" (CuPy's Function call, the struct passed by value) or
#: "driver" (cuLaunchKernel of libcuda called through ctypes, the struct passed by address);
#: ``FDPP_LAUNCH`` overrides. (cuda.bindings' cuLaunchKernel was measured slower than both on the
#: H200: 31.8 us per eager call against 21.0 for CuPy, results/device_runD4/host_profile_h200.csv.)
LAUNCHER = os.environ.get("FDPP_LAUNCH", "cupy")
_cu_launch: Any = None


def _cuLaunchKernel() -> Any:  # noqa: N802 - the driver's name
    """libcuda's cuLaunchKernel as a ctypes function (loaded once)."""
    global _cu_launch
    if _cu_launch is None:
        import ctypes
        import sys

        name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
        f = ctypes.CDLL(name).cuLaunchKernel
        u, vp = ctypes.c_uint, ctypes.c_void_p
        f.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
        f.restype = ctypes.c_int
        _cu_launch = f
    return _cu_launch


class KernelCall:
    """One launch whose function, grid, block, shared memory and argument struct are fixed (a
    launch record's part). ``params`` is the record's one-element struct array: the record
    rewrites its pointer fields before each ``call(stream)``, which passes the struct by value."""

    __slots__ = ("fn", "grid", "block", "smem", "params", "_drv")

    def __init__(self, config: Any, grid: tuple[int, int, int], device: int, params: np.ndarray):
        import cupy

        from fdpp import registry

        kern = registry.get_kernel(config, device)
        with cupy.cuda.Device(device):
            self.fn = kern.kernel
        self.grid, self.block, self.smem = tuple(grid), (config.threads, 1, 1), config.smem_bytes()
        self.params = params
        self._drv: Any = None

    def __call__(self, stream: Any) -> None:
        if LAUNCHER == "driver":
            self._driver_launch(stream)
        else:
            self.fn(self.grid, self.block, (self.params[0],), shared_mem=self.smem, stream=stream)

    def _driver_launch(self, stream: Any) -> None:
        drv = self._drv
        if drv is None:
            import ctypes

            argv = (ctypes.c_void_p * 1)(self.params.ctypes.data)  # kernelParams: the struct's address
            drv = self._drv = (_cuLaunchKernel(), self.fn.ptr, *self.grid, *self.block, self.smem, argv)
        f, fn, gx, gy, gz, bx, by, bz, smem, argv = drv
        err = f(fn, gx, gy, gz, bx, by, bz, smem, stream.ptr, argv, None)
        if err:
            raise RuntimeError(f"cuLaunchKernel failed: CUresult {err}")


class ParamStruct:
    """A kernel parameter struct: ordered (name, C type) fields -> NumPy aligned dtype.

    C types: ``ptr`` (64-bit address), ``i64``, ``i32``, ``f32``. ``pack(**values)`` returns the
    structured scalar to pass as the kernel's single argument; missing fields are 0.
    """

    _NP = {"ptr": np.uint64, "i64": np.int64, "i32": np.int32, "f32": np.float32}

    def __init__(self, c_name: str, fields: Sequence[tuple[str, str]]):
        self.c_name = c_name
        self.fields = tuple(fields)
        self.dtype = np.dtype({"names": [n for n, _ in self.fields],
                               "formats": [self._NP[t] for _, t in self.fields]}, align=True)
        self._zero = np.zeros(1, dtype=self.dtype)

    def pack(self, **values: Any) -> np.void:
        return self.array(**values)[0]

    def array(self, **values: Any) -> np.ndarray:
        """A one-element struct array (its memory is what a launch passes)."""
        rec = self._zero.copy()
        for k, v in values.items():
            rec[k] = v  # unknown names raise ValueError from NumPy
        return rec

    def offsets(self) -> dict[str, int]:
        return {n: self.dtype.fields[n][1] for n in self.dtype.names}

    def static_asserts(self) -> str:
        """C++ that fails to compile unless the struct's layout equals this dtype's."""
        lines = [f"static_assert(sizeof({self.c_name}) == {self.dtype.itemsize}, \"{self.c_name} size\");"]
        lines += [f"static_assert(__builtin_offsetof({self.c_name}, {n}) == {off}, \"{self.c_name}.{n}\");"
                  for n, off in self.offsets().items()]
        return "\n".join(lines)
