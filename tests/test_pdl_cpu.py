"""Programmatic dependent launch (fdpp.launch.PDL): the attention and GEMM kernels wait for the previous
grid before their first memory access, on sm_90 (where the PTX has griddepcontrol) and only
there; the host asks for PDL only where it can (the family, the device, the launcher)."""

import importlib.util
import re
from pathlib import Path

import pytest

from fdpp import gemm, launch, registry
from fdpp.configs import DecodeConfig, combine_config, nosplit_config

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = [
    DecodeConfig("fp16", 128, 4, 4, 2, 1, mma=True),  # tensor cores, contiguous
    DecodeConfig("bf16", 128, 8, 4, 3, 1, mma=True, page_size=16),  # tensor cores, paged
    DecodeConfig("fp16", 128, 4, 4, 3, 1, mma=True, kv_dtype="fp8_e4m3"),  # FP8 codes
    DecodeConfig("fp16", 128, 4, 4, 3, 1, mma=True, cluster=16),  # merged in a thread-block cluster
    DecodeConfig("fp32", 64, 2, 4, 2, 2),  # CUDA cores
    nosplit_config("fp16", 128),
    combine_config("fp16", 128),
    *(next(iter(space("fp16"))) for space in (gemm.flat_space, gemm.tma_space, gemm.gemv_space)),
]
# the first instruction of a kernel that touches memory other than its parameters
MEMORY_OP = re.compile(r"^\s*(?:@%p\d+\s+)?(ld\.global|ld\.volatile\.global|cp\.async\.[a-z]+\.shared\.global|"
                       r"st\.global|atom\.|red\.|ld\.(?!param|shared|local))")


def _ptx(cfg, arch: str) -> str:
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs the cuda-bindings NVRTC wheel")
    spec = importlib.util.spec_from_file_location("compare_ptx", ROOT / "scripts" / "compare_ptx.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ptx(Path(registry.kernel_dir()), cfg, arch)


def _entry_body(ptx: str) -> list[str]:
    start = next(i for i, ln in enumerate(ptx.splitlines()) if re.match(r"\.(visible|weak) \.entry", ln))
    return ptx.splitlines()[start:]


# the one read a kernel may make before its wait: a paged kernel's block-table entries for the L2
# prefetch (kernels_cu/common.cuh, pdl_read: L2 only, a hint whose value no result depends on)
HINT_READ = re.compile(r"^\s*(?:@%p\d+\s+)?ld\.global\.cg\.s32")


@pytest.mark.parametrize("cfg", VARIANTS, ids=lambda c: c.key)
def test_sm90_kernels_wait_before_their_first_memory_access(cfg):
    body = _entry_body(_ptx(cfg, "sm_90"))
    wait = next((i for i, ln in enumerate(body) if "griddepcontrol.wait" in ln), None)
    hint = re.compile("$^") if not getattr(cfg, "page_size", 0) else HINT_READ
    first = next((i for i, ln in enumerate(body) if MEMORY_OP.match(ln) and not hint.match(ln)), None)
    assert wait is not None, f"{cfg.key}: no griddepcontrol.wait in the sm_90 PTX"
    assert first is not None, f"{cfg.key}: no memory access found (the pattern is stale)"
    assert wait < first, f"{cfg.key}: {body[first].strip()!r} (line {first}) before the wait (line {wait})"
    assert any("griddepcontrol.launch_dependents" in ln for ln in body)


@pytest.mark.parametrize("cfg", VARIANTS[:1] + VARIANTS[-1:], ids=lambda c: c.key)
def test_sm80_kernels_have_no_griddepcontrol(cfg):
    assert "griddepcontrol" not in _ptx(cfg, "sm_80")


@pytest.mark.parametrize("cfg", [c for c in VARIANTS if not c.key.startswith("decode_combine")], ids=lambda c: c.key)
def test_sm90_kernels_prefetch_into_l2_before_their_wait(cfg):
    """The L2 prefetch (launch.L2_PREFETCH_BYTES) is issued before griddepcontrol.wait, where it
    overlaps the kernel before; sm_80 (no PDL) has none. The merge kernel reads only partials."""
    body = _entry_body(_ptx(cfg, "sm_90"))
    wait = next(i for i, ln in enumerate(body) if "griddepcontrol.wait" in ln)
    pf = [i for i, ln in enumerate(body) if "cp.async.bulk.prefetch.L2" in ln]
    assert pf and max(pf) < wait, f"{cfg.key}: prefetches at lines {pf}, wait at {wait}"
    if getattr(cfg, "cluster", 1) <= 1:  # cluster kernels exist on sm_90 only
        assert "prefetch" not in _ptx(cfg, "sm_80")


def test_the_pattern_finds_loads_before_a_wait():
    """The order check can fail: a load line ahead of the wait is reported."""
    body = [".weak .entry k(", "\tld.param.u64 %rd1, [k_param_0];", "\tld.global.u32 %r1, [%rd1];",
            "\tgriddepcontrol.wait;"]
    first = next(i for i, ln in enumerate(body) if MEMORY_OP.match(ln))
    assert first == 2 and first < 3


@pytest.mark.parametrize("text,want", [
    (None, {"attention", "gemm"}), ("", {"attention", "gemm"}), ("1", {"attention", "gemm"}), ("all", {"attention", "gemm"}),
    ("0", set()), ("none", set()), ("attention", {"attention"}), ("gemm, attention", {"attention", "gemm"}),
])
def test_parse_pdl(text, want):
    assert launch.parse_pdl(text) == want


def test_parse_pdl_names_an_unknown_family():
    with pytest.raises(ValueError, match="unknown kernel family merge"):
        launch.parse_pdl("gemm,merge")


def test_a_bad_environment_value_warns_and_keeps_the_default(monkeypatch):
    monkeypatch.setenv("FDPP_PDL", "gemmm")
    with pytest.warns(RuntimeWarning, match="unknown kernel family gemmm"):
        assert launch._env_pdl() == {"attention", "gemm"}


@pytest.mark.parametrize("fams,launcher,cc,bindings,family,want", [
    ({"attention", "gemm"}, "bindings", 90, True, "attention", True),
    ({"attention", "gemm"}, "cupy-driver", 90, True, "attention", True),  # the default
    ({"gemm"}, "cupy-driver", 90, True, "attention", False),  # FDPP_PDL=gemm
    ({"gemm"}, "cupy-driver", 90, True, "gemm", True),
    ({"gemm"}, "cupy-driver", 90, False, "gemm", False),  # no cuda.bindings: no cuLaunchKernelEx
    ({"attention", "gemm"}, "bindings", 80, True, "gemm", False),  # Ampere: no griddepcontrol
    ({"attention", "gemm"}, "cupy", 90, True, "gemm", False),  # CuPy's launch passes no attributes
    ({"attention", "gemm"}, "ctypes", 90, True, "attention", True),
    (set(), "bindings", 90, True, "gemm", False),  # FDPP_PDL=0
])
def test_pdl_for_needs_family_device_and_launcher(monkeypatch, fams, launcher, cc, bindings, family, want):
    monkeypatch.setattr(launch, "PDL", frozenset(fams))
    monkeypatch.setattr(launch, "LAUNCHER", launcher)
    monkeypatch.setattr(launch, "HAVE_BINDINGS", bindings)
    monkeypatch.setattr(launch, "_pdl_devices", {0: cc >= 90})
    assert launch.pdl_for(0, family) is want


def test_long_attention_calls_launch_plainly(monkeypatch):
    """PDL_ATTENTION_MAX_BYTES: an attention call reading more K/V launches plainly (its record's
    kernels and explain say so); flat_gemm is not affected."""
    from fdpp import configs, dispatch

    monkeypatch.setattr(launch, "PDL", frozenset({"attention", "gemm"}))
    monkeypatch.setattr(launch, "LAUNCHER", "cupy-driver")
    monkeypatch.setattr(launch, "HAVE_BINDINGS", True)
    monkeypatch.setattr(launch, "_pdl_devices", {0: True})
    short, long_ = (configs.DecodeProblem(1, 32, 8, 128, n) for n in (16384, 65536))
    assert short.kv_bytes() == launch.PDL_ATTENTION_MAX_BYTES < long_.kv_bytes()
    assert launch.pdl_for(0, "attention", short.kv_bytes())
    assert not launch.pdl_for(0, "attention", long_.kv_bytes())
    assert launch.pdl_for(0, "gemm", long_.kv_bytes())
    assert "launch: programmatic dependent launch" in dispatch.explain(short, configs.SM90)
    assert "launch: plain launches (the call reads 256 MiB of K/V" in dispatch.explain(long_, configs.SM90)


def test_pdl_families_are_part_of_the_launch_record_keys(monkeypatch):
    from fdpp import gemm, plan

    monkeypatch.setattr(launch, "PDL", frozenset({"attention", "gemm"}))
    on, on_gemm = plan.launch_env(), plan.launch_env("gemm")
    monkeypatch.setattr(launch, "PDL", frozenset({"gemm"}))
    assert plan.launch_env() != on and plan.launch_env("gemm") != on_gemm
    assert "launch_env" in gemm._probe_key.__code__.co_names  # the GEMM record key is made of it too


@pytest.mark.parametrize("fams,launcher,device,says", [
    ({"attention", "gemm"}, "bindings", "SM90", "programmatic dependent launch"),
    ({"attention"}, "bindings", "SM80", "plain launches (no programmatic dependent launch on sm_80)"),
    ({"attention"}, "cupy", "SM90", "plain launches (the 'cupy' launcher"),
    ({"gemm"}, "bindings", "SM90", "plain launches (FDPP_PDL leaves attention out)"),
])
def test_explain_says_how_attention_launches(monkeypatch, fams, launcher, device, says):
    from fdpp import configs, dispatch

    monkeypatch.setattr(launch, "PDL", frozenset(fams))
    monkeypatch.setattr(launch, "LAUNCHER", launcher)
    text = dispatch.explain(configs.DecodeProblem(1, 32, 8, 128, 4096), getattr(configs, device))
    assert f"launch: {says}" in text


class _Cfg:  # a kernel config's launch-relevant part
    threads = 128

    @staticmethod
    def smem_bytes():
        return 4096


class _Fn:
    ptr = 0


class _Stream:
    def __init__(self, ptr):
        self.ptr = ptr


def test_pdl_launch_passes_the_attribute_per_stream(monkeypatch):
    """The cuLaunchKernelEx path (driver call stubbed): each stream gets its own config carrying
    the grid, block, shared memory, that stream and the programmatic-serialization attribute, built
    once and reused; the argument array is the struct's own memory; pdl=False takes cuLaunchKernel."""
    driver = pytest.importorskip("cuda.bindings.driver", reason="needs cuda-bindings")
    from fdpp.configs import DECODE_PARAMS

    seen = []
    ok = driver.CUresult.CUDA_SUCCESS
    monkeypatch.setattr(driver, "cuLaunchKernelEx", lambda cfg, f, args, extra: (seen.append(("ex", cfg, args)), ok)[1:])
    monkeypatch.setattr(driver, "cuLaunchKernel", lambda *a: (seen.append(("plain", a[9], a[10])), ok)[1:])
    monkeypatch.setattr(launch, "LAUNCHER", "bindings")
    params = DECODE_PARAMS.array()
    call = launch.KernelCall(_Cfg(), (16, 8, 2), 0, params, fn=_Fn(), pdl=True)
    a, b = _Stream(0x1000), _Stream(0x2000)
    for s in (a, b, a):
        call(s)
    assert [k for k, *_ in seen] == ["ex"] * 3
    cfgs = [c for _, c, _ in seen]
    assert cfgs[0] is cfgs[2] and cfgs[0] is not cfgs[1]  # one config per stream
    for c, s in zip(cfgs, (a, b, a), strict=True):
        assert int(c.hStream) == s.ptr
        assert (c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.blockDimY, c.blockDimZ) == (16, 8, 2, 128, 1, 1)
        assert c.sharedMemBytes == 4096 and c.numAttrs == 1
        attr = c.attrs[0]
        assert attr.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        assert attr.value.programmaticStreamSerializationAllowed == 1
    import ctypes

    argv = ctypes.cast(seen[0][2], ctypes.POINTER(ctypes.c_void_p))
    assert argv[0] == params.ctypes.data  # the struct itself, by address
    seen.clear()
    launch.KernelCall(_Cfg(), (4, 1, 1), 0, params, fn=_Fn(), pdl=False)(a)
    assert [k for k, *_ in seen] == ["plain"]
    seen.clear()
    monkeypatch.setattr(launch, "LAUNCHER", "cupy-driver")  # a PDL launch takes cuLaunchKernelEx whatever the launcher
    launch.KernelCall(_Cfg(), (4, 1, 1), 0, params, fn=_Fn(), pdl=True)(a)
    assert [k for k, *_ in seen] == ["ex"]


def test_cupy_driver_launcher_passes_integers_and_the_struct_address(monkeypatch):
    """The default launcher (CuPy's Cython cuLaunchKernel, stubbed): function handle, grid, block,
    shared memory, the call's stream and a kernelParams array whose one entry is the struct's own
    memory; built once, the stream read per call."""
    import ctypes

    from fdpp.configs import DECODE_PARAMS

    seen = []
    monkeypatch.setattr(launch, "_cupy_launch_kernel", lambda: lambda *a: seen.append(a))
    monkeypatch.setattr(launch, "LAUNCHER", "cupy-driver")
    params = DECODE_PARAMS.array()
    fn = _Fn()
    fn.ptr = 0xABC0
    call = launch.KernelCall(_Cfg(), (16, 8, 2), 0, params, fn=fn)
    for s in (_Stream(0x1000), _Stream(0x2000)):
        call(s)
    assert [a[:8] for a in seen] == [(0xABC0, 16, 8, 2, 128, 1, 1, 4096)] * 2
    assert [a[8] for a in seen] == [0x1000, 0x2000] and [a[10] for a in seen] == [0, 0]
    assert seen[0][9] == seen[1][9]
    argv = ctypes.cast(seen[0][9], ctypes.POINTER(ctypes.c_void_p))
    assert argv[0] == params.ctypes.data


@pytest.mark.parametrize("text,want", [(None, launch.L2_PREFETCH_MB_DEFAULT), ("", launch.L2_PREFETCH_MB_DEFAULT),
                                       ("0", 0.0), ("2.5", 2.5), ("64", 64.0)])
def test_l2_prefetch_budget_from_the_environment(monkeypatch, text, want):
    if text is None:
        monkeypatch.delenv("FDPP_L2_PREFETCH_MB", raising=False)
    else:
        monkeypatch.setenv("FDPP_L2_PREFETCH_MB", text)
    assert launch._env_prefetch_bytes() == int(want * (1 << 20))


@pytest.mark.parametrize("text", ["-1", "lots", "nan", "inf"])
def test_a_bad_l2_prefetch_budget_warns_and_keeps_the_default(monkeypatch, text):
    monkeypatch.setenv("FDPP_L2_PREFETCH_MB", text)
    with pytest.warns(RuntimeWarning, match="FDPP_L2_PREFETCH_MB"):
        got = launch._env_prefetch_bytes()
    assert got == int(launch.L2_PREFETCH_MB_DEFAULT * (1 << 20))


def test_prefetch_units_share_the_budget_and_stop_at_the_cap(monkeypatch):
    monkeypatch.setattr(launch, "L2_PREFETCH_BYTES", 16 << 20)
    # 64 CTAs, units of 512 B: 512 each, capped by what a CTA reads
    assert launch.prefetch_units(True, 64, 512, 10**6) == 512
    assert launch.prefetch_units(True, 64, 512, 100) == 100
    assert launch.prefetch_units(True, 3, 1000, 10**9) == (16 << 20) // 3000
    assert launch.prefetch_units(False, 64, 512, 512) == 0  # plain launch: the wait is a no-op
    monkeypatch.setattr(launch, "L2_PREFETCH_BYTES", 0)
    assert launch.prefetch_units(True, 64, 512, 512) == 0
    monkeypatch.setattr(launch, "L2_PREFETCH_BYTES", 100)
    assert launch.prefetch_units(True, 64, 512, 512) == 1  # less than a unit each: the first one
    assert launch.prefetch_units(True, 64, 512, 0) == 0


def test_attention_prefetches_whole_chunks_of_calls_within_the_budget(monkeypatch):
    monkeypatch.setattr(launch, "L2_PREFETCH_BYTES", 8 << 20)
    assert launch.attention_prefetch(True, 4 << 20, 128) == 128  # llama3-8b B = 1, 1k: 4 MiB
    assert launch.attention_prefetch(True, 8 << 20, 300) == 300
    assert launch.attention_prefetch(True, (8 << 20) + 1, 300) == 0  # parts of larger calls are evicted unread
    assert launch.attention_prefetch(False, 4 << 20, 128) == 0  # plain launch
    monkeypatch.setattr(launch, "L2_PREFETCH_BYTES", 0)
    assert launch.attention_prefetch(True, 4 << 20, 128) == 0


def test_l2_prefetch_budget_is_part_of_the_launch_record_keys(monkeypatch):
    from fdpp import gemm, plan

    monkeypatch.setattr(launch, "L2_PREFETCH_BYTES", 16 << 20)
    on, on_gemm = plan.launch_env(), plan.launch_env("gemm")
    monkeypatch.setattr(launch, "L2_PREFETCH_BYTES", 0)
    assert plan.launch_env() != on and plan.launch_env("gemm") != on_gemm
    assert "launch_env" in gemm._probe_key.__code__.co_names


def test_explain_names_the_l2_prefetch(monkeypatch):
    from fdpp import configs, dispatch

    monkeypatch.setattr(launch, "PDL", frozenset({"attention", "gemm"}))
    monkeypatch.setattr(launch, "LAUNCHER", "cupy-driver")
    monkeypatch.setattr(launch, "HAVE_BINDINGS", True)
    prob = configs.DecodeProblem(1, 32, 8, 128, 4096)
    monkeypatch.setattr(launch, "L2_PREFETCH_BYTES", 16 << 20)
    assert "ask the L2 for their chunks' K/V rows (calls of at most 16 MiB of K/V, FDPP_L2_PREFETCH_MB: " \
           "this one)" in dispatch.explain(prob, configs.SM90)
    monkeypatch.setattr(launch, "L2_PREFETCH_BYTES", 8 << 20)  # the call reads 16 MiB
    assert "FDPP_L2_PREFETCH_MB: not this one)" in dispatch.explain(prob, configs.SM90)
    monkeypatch.setattr(launch, "L2_PREFETCH_BYTES", 0)
    assert "no L2 prefetch (FDPP_L2_PREFETCH_MB=0)" in dispatch.explain(prob, configs.SM90)
