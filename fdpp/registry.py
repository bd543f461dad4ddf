"""Kernel sources, compilation and launch.

``get_kernel(config)`` compiles a variant once per device through ``cupy.RawModule`` (template
chosen with ``name_expressions``) and memoises it; CuPy's disk cache (``CUPY_CACHE_DIR``) keeps the
binaries across processes. ``compile_offline`` compiles variants without a GPU through the
``cuda-bindings`` NVRTC and parses ptxas' resource report (registers, spills, stack frame): CI uses
it to check the whole search space for sm_80 and sm_90.

The registry knows nothing of tables or dispatch: it is given a config and launches it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Protocol

from fdpp.configs import DeviceLimits


class KernelConfig(Protocol):
    key: str
    source: str

    def name_expression(self) -> str: ...
    def smem_bytes(self) -> int: ...


# -ftz=true: CuPy appends it to every NVRTC compile it makes (its compile_with_cache), so the kernels
# that run flush float32 subnormals; the offline compiles (CI's spill / register checks, the SASS
# tools) name it too, so that they build the binaries that run. Code that must keep subnormals
# writes its float32 operations as PTX without .ftz (kernels_cu/quant.cuh).
NVRTC_OPTIONS = ("-std=c++17", "-ftz=true")


@cache
def kernel_dir() -> Path:
    """Directory of the .cu/.cuh sources: the source tree's kernels_cu/, else the installed copy."""
    here = Path(__file__).resolve().parent
    tree = here.parent / "kernels_cu"
    if (tree / "common.cuh").is_file():
        return tree
    from importlib.resources import files

    return Path(str(files("fdpp.kernels_cu")))


@cache
def kernel_source(filename: str) -> str:
    return (kernel_dir() / filename).read_text()


def _code_only(text: str) -> str:
    """Source text without comments and with whitespace collapsed: what the compiler sees."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return " ".join(text.split())


@cache
def source_hash(filename: str) -> str:
    """Hash of a kernel's code and of every header it includes (tuned entries are tied to it).

    Comments and whitespace are left out, so documenting a kernel does not invalidate its tuning."""
    h = hashlib.sha256()
    text = kernel_source(filename)
    for inc in sorted(_includes(filename) - {filename}):
        h.update(_code_only(kernel_source(inc)).encode())
    h.update(_code_only(text).encode())
    return h.hexdigest()[:16]


def _includes(filename: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """``filename`` and every header it includes, directly or through other headers."""
    out = {filename}
    for inc in re.findall(r'#include "([^"]+)"', kernel_source(filename)):
        if inc not in seen and inc not in out:
            out |= _includes(inc, seen | out)
    return out


# ---- run time (CuPy) -----------------------------------------------------------------------
_compiled: dict[tuple[int, str], Any] = {}


class KernelCompileError(RuntimeError):
    """A variant failed to compile; the message names the variant and carries the compiler log."""


#: CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED (cuda.h's CUfunction_attribute).
NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


def get_kernel(config: KernelConfig, device_id: int | None = None) -> Any:
    """The compiled ``cupy.RawKernel`` of ``config`` on ``device_id`` (default: current device)."""
    import cupy

    dev = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
    key = (dev.id, config.key)
    kern = _compiled.get(key)
    if kern is not None:
        return kern
    with dev:
        expr = config.name_expression()
        try:
            mod = cupy.RawModule(
                code=kernel_source(config.source),
                options=(*NVRTC_OPTIONS, f"-I{kernel_dir()}"),
                name_expressions=[expr],
            )
            kern = mod.get_function(expr)
        except cupy.cuda.compiler.CompileException as e:
            raise KernelCompileError(f"compiling variant {config.key} ({expr}) failed:\n{e}") from e
        smem = config.smem_bytes()
        if smem + kern.shared_size_bytes > 48 * 1024:  # dynamic + static past the default opt-in
            try:
                kern.max_dynamic_shared_size_bytes = smem
            except cupy.cuda.driver.CUDADriverError as e:
                raise KernelCompileError(
                    f"variant {config.key} needs {smem} B of dynamic shared memory; the driver refused "
                    f"it ({e}); kernel uses {kern.num_regs} registers, {kern.shared_size_bytes} B static "
                    f"shared memory, max {kern.max_threads_per_block} threads per block") from e
        if getattr(config, "cluster", 1) > 8:  # past the portable cluster size: opt in (H100 / H200: 16)
            try:
                cupy.cuda.driver.funcSetAttribute(kern.kernel.ptr, NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            except cupy.cuda.driver.CUDADriverError as e:
                raise KernelCompileError(f"variant {config.key}: the driver refused a cluster of "
                                         f"{config.cluster} CTAs ({e})") from e
    _compiled[key] = kern
    return kern


@cache
def device_limits(device_id: int = 0) -> DeviceLimits:
    import cupy

    p = cupy.cuda.runtime.getDeviceProperties(device_id)
    name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
    return DeviceLimits(
        name=name,
        cc=(int(p["major"]), int(p["minor"])),
        sm_count=int(p["multiProcessorCount"]),
        smem_per_block=int(p["sharedMemPerBlockOptin"]),
        regs_per_sm=int(p["regsPerMultiprocessor"]),
        max_threads_per_sm=int(p["maxThreadsPerMultiProcessor"]),
    )


# ---- offline (no GPU): NVRTC from the cuda-bindings wheel -----------------------------------
@dataclass(frozen=True)
class ResourceReport:
    key: str
    arch: str
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    static_smem: int


def compile_offline(configs: Iterable[KernelConfig], arch: str) -> dict[str, ResourceReport]:
    """Compile ``configs`` (all from one source file) for ``arch`` and return ptxas' report per key.

    Raises KernelCompileError naming the variants when NVRTC fails.
    """
    log, lowered, _ = _nvrtc(list(configs), arch, output="")
    return _parse_ptxas(log, lowered, arch)


def compile_cubin(configs: Iterable[KernelConfig], arch: str) -> tuple[bytes, dict[str, ResourceReport]]:
    """Compile ``configs`` (one source file) for ``arch``: the cubin and ptxas' report per lowered
    (mangled) name, the name a disassembly shows (scripts/sass_count.py)."""
    log, lowered, binary = _nvrtc(list(configs), arch, output="cubin")
    reports = _parse_ptxas(log, lowered, arch)
    return binary, {name: reports[c.key] for name, c in lowered.items()}


def compile_ptx(configs: Iterable[KernelConfig], arch: str) -> str:
    """The PTX of ``configs`` (one source file) for ``arch``, compiled with NVRTC_OPTIONS."""
    _, _, text = _nvrtc(list(configs), arch, output="ptx")
    return text.decode(errors="replace").rstrip("\x00")


def _nvrtc(configs: list[KernelConfig], arch: str, output: str) -> tuple[str, dict[str, KernelConfig], bytes]:
    """Compile ``configs`` with NVRTC: (the log, lowered name -> config, the ``output`` ("cubin",
    "ptx" or "": nothing) as bytes)."""
    from cuda.bindings import nvrtc

    sources = {c.source for c in configs}
    if len(sources) != 1:
        raise ValueError(f"one NVRTC program compiles configs of one source file, got {sorted(sources)}")
    (src_name,) = sources
    src = kernel_source(src_name).encode()

    def ok(res: Any) -> Any:
        err, *rest = res if isinstance(res, tuple) else (res,)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(f"NVRTC call failed: {err}")
        return rest[0] if rest else None

    # Named by its path, so that its quoted includes resolve in kernel_dir() whatever the working
    # directory (the sources' #line directives keep the names diagnostics show).
    prog = ok(nvrtc.nvrtcCreateProgram(src, str(kernel_dir() / src_name).encode(), 0, [], []))
    try:
        for c in configs:
            ok(nvrtc.nvrtcAddNameExpression(prog, c.name_expression().encode()))
        opts = [f"--gpu-architecture={arch}", "-Xptxas=-v", *NVRTC_OPTIONS, f"-I{kernel_dir()}"]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        size = ok(nvrtc.nvrtcGetProgramLogSize(prog))
        buf = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.decode(errors="replace").rstrip("\x00")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            keys = ", ".join(c.key for c in configs[:8])
            raise KernelCompileError(f"compiling {keys}{' ...' if len(configs) > 8 else ''} "
                                     f"for {arch} failed:\n{log}")
        lowered = {ok(nvrtc.nvrtcGetLoweredName(prog, c.name_expression().encode())).decode(): c
                   for c in configs}
        binary = b""
        if output == "cubin":
            binary = b" " * ok(nvrtc.nvrtcGetCUBINSize(prog))
            ok(nvrtc.nvrtcGetCUBIN(prog, binary))
        elif output == "ptx":
            binary = b" " * ok(nvrtc.nvrtcGetPTXSize(prog))
            ok(nvrtc.nvrtcGetPTX(prog, binary))
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return log, lowered, binary


_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(\w+)'")


def _parse_ptxas(log: str, lowered: dict[str, KernelConfig], arch: str) -> dict[str, ResourceReport]:
    out: dict[str, ResourceReport] = {}
    blocks = _ENTRY.split(log)
    # split gives [pre, name1, arch1, body1, name2, arch2, body2, ...]
    for i in range(1, len(blocks) - 2, 3):
        name, body = blocks[i], blocks[i + 2]
        if name not in lowered:
            continue

        def num(pat: str, body: str = body) -> int:
            m = re.search(pat, body)
            return int(m.group(1)) if m else 0

        c = lowered[name]
        out[c.key] = ResourceReport(
            key=c.key, arch=arch,
            registers=num(r"Used (\d+) registers"),
            stack_bytes=num(r"(\d+) bytes stack frame"),
            spill_stores=num(r"(\d+) bytes spill stores"),
            spill_loads=num(r"(\d+) bytes spill loads"),
            static_smem=num(r"(\d+) bytes smem"),
        )
    missing = [c.key for c in lowered.values() if c.key not in out]
    if missing:
        raise KernelCompileError(f"no ptxas report for {missing[:4]} in the compiler log")
    return out
