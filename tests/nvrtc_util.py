"""Offline NVRTC helpers shared by the CPU tests that compile small programs against kernels_cu/
(no GPU needed; a test that calls them skips without the cuda-bindings NVRTC wheel)."""

import os
import re

import pytest

from fdpp import registry
from fdpp.launch import ParamStruct


def nvrtc_compiles(code: str, arch: str = "sm_90") -> tuple[bool, str]:
    """Compile ``code`` (may include kernels_cu files) with the offline NVRTC: (ok, log). Skips
    where this NVRTC has no __builtin_offsetof, which the layout checks (static_asserts) use: there
    a wrong mirror would fail to compile for that reason alone, and its test could not fail."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="needs the cuda-bindings NVRTC wheel")
    err, prog = nvrtc.nvrtcCreateProgram(code.encode(), b"layout_check.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    try:
        opts = [f"--gpu-architecture={arch}", *registry.NVRTC_OPTIONS, f"-I{registry.kernel_dir()}"]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    ok, text = err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace").rstrip("\x00")
    if not ok and '"__builtin_offsetof" is undefined' in text:
        pytest.skip("this NVRTC has no __builtin_offsetof (seen with NVRTC 13.0; 13.5 has it)")
    return ok, text


def append_layout_check(struct: ParamStruct) -> tuple[bool, str]:
    """Compile ``struct``'s static_asserts (its Python layout) against kernels_cu/paged_append.cu:
    (ok, log)."""
    return nvrtc_compiles(f'#include "paged_append.cu"\nnamespace fdpp {{\n{struct.static_asserts()}\n}}\n')


def slow_requested(config) -> bool:
    """FDPP_SLOW=1, or a -m expression that selects slow tests and would not select an unmarked
    one (``-m slow`` yes; ``-m "not slow"`` or ``-m "not gpu"`` no)."""
    if os.environ.get("FDPP_SLOW") == "1":
        return True
    expr = config.getoption("markexpr", "") or ""
    if not expr:
        return False
    try:
        from _pytest.mark.expression import Expression
    except ImportError:  # pragma: no cover - pytest moved its private parser: fall back to a token test
        return re.search(r"(?<!not )\bslow\b", expr) is not None
    compiled = Expression.compile(expr)
    return compiled.evaluate(lambda name, **_: name == "slow") and not compiled.evaluate(lambda name, **_: False)
