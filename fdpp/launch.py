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


#: How :class:`KernelCall` launches a plain (non-PDL) kernel (``FDPP_LAUNCH`` overrides):
#: - "cupy-driver" (the default): CuPy's own Cython binding of the driver's ``cuLaunchKernel``
#:   (``cupy.cuda.driver.launchKernel``: integers in, no wrapper objects), the arguments passed by
#:   address from the record's own memory;
#: - "bindings": ``cuda.bindings``' ``cuLaunchKernel``, the arguments passed by address (the
#:   function, stream and parameter array prebuilt once);
#: - "ctypes" (alias "driver"): libcuda's ``cuLaunchKernel`` through ctypes, every argument a
#:   prebuilt ctypes object;
#: - "cupy": CuPy's ``Function`` call, the arguments passed by value.
#: A launch with programmatic dependent launch (:data:`PDL`) always goes through ``cuda.bindings``'
#: ``cuLaunchKernelEx`` (the only binding here that passes launch attributes; libcuda's through
#: ctypes, given the same config's C struct, took 5.03 us per empty-kernel launch against 4.04 in
#: run N1).
#: Measured per launch of an empty kernel on the H200 host (``scripts/host_profile.py``, run K1):
#: cupy-driver 3.50 us, cuda.bindings 4.01, ctypes 4.75, CuPy's kernel call 5.6.
LAUNCHERS = ("cupy-driver", "cupy", "bindings", "ctypes")


def _has_bindings() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):
        return False


HAVE_BINDINGS = _has_bindings()


DEFAULT_LAUNCHER = "cupy-driver"
LAUNCHER = os.environ.get("FDPP_LAUNCH", DEFAULT_LAUNCHER)

#: Programmatic dependent launch (sm_90+): the kernel families in :data:`PDL` are launched with
#: CUDA's programmatic-stream-serialization attribute, so a kernel's launch overlaps the end of the
#: kernel before it on the stream instead of waiting for it to drain. Every attention and
#: flat_gemm kernel calls ``griddepcontrol.wait`` before touching memory (kernels_cu/common.cuh,
#: pdl_wait), so results are the same either way, and lets its dependents launch right after. The
#: PDL launch is ``cuda.bindings``' ``cuLaunchKernelEx``: without cuda.bindings, or with the "cupy"
#: launcher, kernels launch plainly. CUDA graphs captured from such launches keep the programmatic
#: edges.
#:
#: ``FDPP_PDL``: unset, "all" or "1" -> {"attention", "gemm"}; "0" or "none" -> none; else a
#: comma-separated list of families. An attention call that reads more than
#: :data:`PDL_ATTENTION_MAX_BYTES` of K/V launches plainly even so. Measured on the H200: PDL takes
#: ~1 us off a short attention call (llama3-8b B = 1: 6.15 / 8.92 / 20.96 us at 1k / 4k / 16k
#: against 7.31 / 10.08 / 21.96 plain, run J3), nothing off a long one (64k: 64.67 against 65.49),
#: and in the model step a long call's early-launched successor cost 0.14 ms at 64k (8.95 ms against
#: 8.81 with attention plain, run J5; 16k: 7.44 against 7.43). Moving the attention kernels' trigger
#: to after their KV loop (run K1, K2, K3) helped the model step by 1-2 % but cost back-to-back
#: calls at B = 8 4-21 % (4k: 39.93 against 35.29 us), so the kernels keep it at their start.
PDL_FAMILIES = ("attention", "gemm")


def parse_pdl(text: str | None) -> frozenset[str]:
    """The families of an ``FDPP_PDL`` value (see :data:`PDL`)."""
    t = (text or "").strip().lower()
    if t in ("", "1", "all"):
        return frozenset(PDL_FAMILIES)
    if t in ("0", "none"):
        return frozenset()
    fams = frozenset(x.strip() for x in t.split(",") if x.strip())
    bad = sorted(fams - set(PDL_FAMILIES))
    if bad:
        raise ValueError(f"FDPP_PDL: unknown kernel famil{'ies' if len(bad) > 1 else 'y'} {', '.join(bad)} "
                         f"(use all, none, or a comma-separated list of {', '.join(PDL_FAMILIES)})")
    return fams


def _env_pdl() -> frozenset[str]:
    try:
        return parse_pdl(os.environ.get("FDPP_PDL"))
    except ValueError as e:  # a typo in the environment must not break ``import fdpp``
        import warnings

        warnings.warn(f"{e}; using the default (all)", RuntimeWarning, stacklevel=2)
        return parse_pdl(None)


PDL: frozenset[str] = _env_pdl()
#: K/V bytes (``DecodeProblem.kv_bytes``: the whole cache at N_max, so a paged call counts its block
#: table's capacity) above which an attention call launches plainly: 64 MiB, llama3-8b heads at
#: B = 1, N = 16k (about 15 us of reading at the H200's 4.5 TB/s).
PDL_ATTENTION_MAX_BYTES = 64 << 20
_pdl_devices: dict[int, bool] = {}

#: L2 prefetch before ``griddepcontrol.wait`` (kernels_cu/common.cuh, l2_prefetch), opt-in: a
#: PDL-launched attention or flat_gemm kernel first asks the L2 for what it will read first
#: (attention: its chunk's K/V rows; flat_gemm: its first weight tiles), then waits for the kernel
#: before, so device memory streams this kernel's bytes while the kernel before is finishing. The
#: prefetch has no result (it cannot change a value read): results are the same bits either way.
#: ``FDPP_L2_PREFETCH_MB`` (default 0: off) bounds what one call prefetches: an attention call
#: prefetches all its K/V when they fit (:func:`attention_prefetch`) and nothing otherwise; a
#: flat_gemm CTA prefetches an equal share, at least its first weight tile (:func:`prefetch_units`).
#: Plain launches (no PDL) prefetch nothing. Measured on the H200 (runs T1, T2,
#: ``results/device_runT1/README.md``): back-to-back attention calls of at most 4 MiB of K/V gain
#: (llama3-8b B = 1, 1k: 4.57 against 5.07 us; llama3-70b TP 8, 1k: 4.42 against 4.75), calls of
#: 8 MiB or more lose (70b TP 8, 16k: 10.30 against 9.00; 8b 4k with a 16 MiB budget: 9.18
#: against 8.35: prefetched lines are evicted by the streaming reads before use and read twice);
#: flat_gemm alone gains 2-7 % at M <= 4 (qkv M = 1: 15.18 against 15.95 us), but the llama3-8b
#: model step was not faster with any of it (T2, with the model ops triggering their successors
#: early: 1k 4.854 ms with it, 4.733 without; T4, without: within 0.4 %), so it is off.
L2_PREFETCH_MB_DEFAULT = 0.0


def _env_prefetch_bytes() -> int:
    text = os.environ.get("FDPP_L2_PREFETCH_MB", "").strip()
    try:
        mb = L2_PREFETCH_MB_DEFAULT if text == "" else float(text)
        if not mb >= 0 or mb == float("inf"):
            raise ValueError
    except ValueError:  # a typo in the environment must not break ``import fdpp``
        import warnings

        warnings.warn(f"FDPP_L2_PREFETCH_MB={text!r} is not a number of MiB >= 0; using "
                      f"{L2_PREFETCH_MB_DEFAULT:g}", RuntimeWarning, stacklevel=2)
        mb = L2_PREFETCH_MB_DEFAULT
    return int(mb * (1 << 20))


L2_PREFETCH_BYTES: int = _env_prefetch_bytes()


def attention_prefetch(pdl: bool, kv_bytes: int, chunk: int) -> int:
    """K/V rows each CTA of an attention call prefetches before its PDL wait: its whole chunk when
    the call's K/V (``kv_bytes``) fit in :data:`L2_PREFETCH_BYTES`, else none."""
    return int(chunk) if pdl and 0 < kv_bytes <= L2_PREFETCH_BYTES else 0


def prefetch_units(pdl: bool, parts: int, unit_bytes: int, cap: int) -> int:
    """Units (weight tiles) each of ``parts`` CTAs prefetches before its PDL wait: an equal share of
    :data:`L2_PREFETCH_BYTES`, but at least its first unit, and at most ``cap`` (what the CTA
    reads); 0 when the launch is plain or the budget is 0."""
    if not pdl or L2_PREFETCH_BYTES <= 0 or parts <= 0 or unit_bytes <= 0 or cap <= 0:
        return 0
    return min(int(cap), max(1, L2_PREFETCH_BYTES // (parts * unit_bytes)))


def pdl_supported(device: int) -> bool:
    """Whether ``device`` (an index) runs programmatic dependent launches (compute capability 9+)."""
    ok = _pdl_devices.get(device)
    if ok is None:
        import cupy

        ok = _pdl_devices[device] = int(cupy.cuda.Device(device).compute_capability) >= 90
    return ok


def pdl_for(device: int, family: str, kv_bytes: int = 0) -> bool:
    """Whether ``family``'s launches ("attention", "gemm") on ``device`` ask for PDL now
    (:data:`PDL`, the device, and a by-address launcher with ``cuda.bindings`` installed: the PDL
    launch is its ``cuLaunchKernelEx``); an attention call reading ``kv_bytes`` above
    :data:`PDL_ATTENTION_MAX_BYTES` launches plainly."""
    if family == "attention" and kv_bytes > PDL_ATTENTION_MAX_BYTES:
        return False
    return family in PDL and LAUNCHER != "cupy" and HAVE_BINDINGS and pdl_supported(device)


_cu_launch: Any = None
_STREAMS_MAX = 64  # per-call stream handles kept per launch (throwaway streams: cleared past this)


def _cuLaunchKernel() -> Any:  # noqa: N802 - the driver's name
    """libcuda's cuLaunchKernel as a ctypes function taking ctypes objects only (loaded once;
    no argtypes, so a call converts nothing)."""
    global _cu_launch
    if _cu_launch is None:
        import ctypes
        import sys

        name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
        f = ctypes.CDLL(name).cuLaunchKernel
        f.restype = ctypes.c_int
        _cu_launch = f
    return _cu_launch


def _cupy_launch_kernel() -> Any:
    """CuPy's Cython ``cuLaunchKernel`` (``cupy.cuda.driver.launchKernel``)."""
    from cupy.cuda import driver

    return driver.launchKernel


class KernelCall:
    """One launch whose function, grid, block, shared memory and argument memory are fixed (a
    launch record's part).

    ``params`` is a one-element NumPy structured array that holds the kernel's arguments: with
    ``fields=False`` it is the kernel's one argument (the attention kernels' parameter struct),
    with ``fields=True`` each of its fields is one argument, in order (flat_gemm's scalars). The
    record rewrites the pointer words in ``params`` before each ``call(stream)``; the launch reads
    them by value (CuPy) or by address (the driver launchers, from ``params``' own memory)."""

    __slots__ = ("fn", "grid", "block", "smem", "params", "fields", "pdl", "_bind", "_ct", "_drv")

    def __init__(self, config: Any, grid: tuple[int, int, int], device: int, params: np.ndarray, *,
                 fields: bool = False, fn: Any = None, pdl: bool = False):
        if fn is None:
            import cupy

            from fdpp import registry

            kern = registry.get_kernel(config, device)
            with cupy.cuda.Device(device):
                fn = kern.kernel
        self.fn = fn
        self.grid = tuple(grid)
        self.block, self.smem = (config.threads, 1, 1), config.smem_bytes()
        self.params, self.fields = params, fields
        self.pdl = bool(pdl)  # the kernel calls pdl_wait() first (the attention and flat_gemm kernels do)
        self._bind: Any = None
        self._ct: Any = None
        self._drv: Any = None

    def _addresses(self) -> list[int]:
        """kernelParams: the address of each argument in ``params``' memory."""
        base = self.params.ctypes.data
        if not self.fields:
            return [base]
        return [base + self.params.dtype.fields[n][1] for n in self.params.dtype.names]

    def _argv(self) -> Any:
        """The kernelParams array (void*[]) the driver launchers pass; kept alive by the caller."""
        import ctypes

        addrs = self._addresses()
        return (ctypes.c_void_p * len(addrs))(*addrs)

    def __call__(self, stream: Any) -> None:
        if self.pdl:
            self._bindings_launch_ex(stream)
            return
        mode = LAUNCHER
        if mode == "cupy-driver":
            st = self._drv
            if st is None:
                st = self._driver_state()
            launch_fn, f, gx, gy, gz, bx, by, bz, smem, addr, _argv = st
            launch_fn(f, gx, gy, gz, bx, by, bz, smem, stream.ptr, addr, 0)  # raises CUDADriverError
        elif mode == "cupy":  # by value: the struct scalar, or one NumPy scalar per field
            p = self.params[0]
            self.fn(self.grid, self.block, tuple(p) if self.fields else (p,), shared_mem=self.smem, stream=stream)
        elif mode == "bindings":
            self._bindings_launch(stream)
        elif mode in ("ctypes", "driver"):
            self._ctypes_launch(stream)
        else:
            raise ValueError(f"FDPP_LAUNCH / fdpp.launch.LAUNCHER must be one of {LAUNCHERS}, got {mode!r}")

    def _driver_state(self) -> tuple:
        """CuPy's ``launchKernel`` with this launch's fixed integers and its kernelParams array."""
        import ctypes

        argv = self._argv()
        self._drv = (_cupy_launch_kernel(), int(self.fn.ptr), *self.grid, *self.block, self.smem,
                     ctypes.addressof(argv), argv)
        return self._drv

    def _bindings_launch(self, stream: Any) -> None:
        st = self._bind
        if st is None:
            import ctypes

            from cuda.bindings import driver

            argv = self._argv()
            st = self._bind = (driver.cuLaunchKernel, driver.CUfunction(self.fn.ptr), *self.grid, *self.block,
                               self.smem, ctypes.addressof(argv), argv, {}, driver.CUstream,
                               driver.CUresult.CUDA_SUCCESS)
        launch_fn, f, gx, gy, gz, bx, by, bz, smem, addr, _argv, streams, cu_stream, ok = st
        hs = streams.get(stream.ptr)
        if hs is None:
            if len(streams) >= _STREAMS_MAX:
                streams.clear()
            hs = streams[stream.ptr] = cu_stream(stream.ptr)
        (err,) = launch_fn(f, gx, gy, gz, bx, by, bz, smem, hs, addr, 0)
        if err != ok:
            raise RuntimeError(f"cuLaunchKernel failed: {err}")

    def _bindings_launch_ex(self, stream: Any) -> None:
        """``cuLaunchKernelEx`` with the programmatic-stream-serialization attribute: one launch
        config per stream, built on the stream's first launch (a call changes no shared state)."""
        st = self._bind
        if st is None:
            import ctypes

            from cuda.bindings import driver

            argv = self._argv()
            st = self._bind = (driver.cuLaunchKernelEx, driver.CUfunction(self.fn.ptr), ctypes.addressof(argv),
                               argv, {}, driver.CUresult.CUDA_SUCCESS)
        launch_fn, f, addr, _argv, configs, ok = st
        cfg = configs.get(stream.ptr)
        if cfg is None:
            if len(configs) >= _STREAMS_MAX:
                configs.clear()
            cfg = configs[stream.ptr] = self._pdl_config(stream.ptr)
        (err,) = launch_fn(cfg, f, addr, 0)
        if err != ok:
            raise RuntimeError(f"cuLaunchKernelEx failed: {err}")

    def _pdl_config(self, stream_ptr: int) -> Any:
        """The CUlaunchConfig of this launch on stream ``stream_ptr`` with the PDL attribute."""
        from cuda.bindings import driver

        cfg = driver.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.block
        cfg.sharedMemBytes = self.smem
        cfg.hStream = driver.CUstream(stream_ptr)
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        return cfg

    def _ctypes_launch(self, stream: Any) -> None:
        st = self._ct
        if st is None:
            import ctypes

            u = ctypes.c_uint
            argv = self._argv()
            pre = (ctypes.c_void_p(self.fn.ptr), *(u(x) for x in (*self.grid, *self.block, self.smem)))
            st = self._ct = (_cuLaunchKernel(), pre, argv, {}, ctypes.c_void_p)
        f, pre, argv, streams, vp = st
        hs = streams.get(stream.ptr)
        if hs is None:
            if len(streams) >= _STREAMS_MAX:
                streams.clear()
            hs = streams[stream.ptr] = vp(stream.ptr)
        err = f(*pre, hs, argv, None)
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
