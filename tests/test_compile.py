"""Every kernel variant of the tuning space compiles for sm_80 and sm_90 through NVRTC (no GPU
needed), with zero register spills and no stack frame, and the Python validity rules agree with
what the compiler reports."""

import itertools
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from fdpp import registry
from fdpp.configs import (
    HEAD_DIMS,
    SM80,
    SM90,
    CombineConfig,
    DecodeConfig,
    compile_space,
    nosplit_config,
)
from fdpp.dtypes import DTYPES

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="needs the cuda-bindings NVRTC wheel")

DEVICES = {"sm_80": SM80, "sm_90": SM90}


def _compile(job):
    dtype, head_dim, arch = job
    dev = DEVICES[arch]
    space = compile_space(dtype, head_dim) + [nosplit_config(dtype, head_dim)]
    valid = [c for c in space if c.is_valid(dev)]
    rejected = [c for c in space if not c.is_valid(dev)]
    reports = registry.compile_offline(valid, arch)
    # configs rejected only by the register estimate: compile them to see the compiler agrees
    reg_rejected = [c for c in rejected if "registers" in (c.check(dev) or "")]
    rej_reports = registry.compile_offline(reg_rejected, arch) if reg_rejected else {}
    return job, valid, reports, reg_rejected, rej_reports


@pytest.fixture(scope="module")
def space_reports():
    jobs = list(itertools.product(DTYPES, HEAD_DIMS, DEVICES))
    with ProcessPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
        return list(ex.map(_compile, jobs))


def test_every_valid_variant_compiles_without_spills(space_reports):
    total = 0
    for (dtype, head_dim, arch), valid, reports, _, _ in space_reports:
        dev = DEVICES[arch]
        assert valid, f"no valid variant for {dtype} d{head_dim}"
        for c in valid:
            r = reports[c.key]
            total += 1
            where = f"{c.key} on {arch}"
            assert r.spill_stores == 0 and r.spill_loads == 0, f"{where} spills: {r}"
            assert r.stack_bytes == 0, f"{where} has a stack frame: {r}"
            assert r.registers * c.threads <= dev.regs_per_sm, f"{where} cannot launch: {r}"
            assert r.static_smem + c.smem_bytes() <= dev.smem_per_block, f"{where} smem: {r}"
    assert total > 1000  # the whole space, both archs


def test_register_rule_agrees_with_compiler(space_reports):
    # a config the rule rejects for registers really is at the limit (255) or spills
    for _, _, _, rejected, reports in space_reports:
        for c in rejected:
            r = reports[c.key]
            assert r.registers >= 200 or r.spill_stores > 0, f"{c.key} rejected but uses {r.registers} regs"


def test_combine_variants_compile():
    for arch in DEVICES:
        cfgs = [CombineConfig(dt, d, w) for dt in DTYPES for d in HEAD_DIMS for w in (2, 4, 8)]
        reports = registry.compile_offline(cfgs, arch)
        for c in cfgs:
            r = reports[c.key]
            assert (r.spill_stores, r.stack_bytes) == (0, 0), r


@pytest.mark.parametrize(
    "cfg",
    [
        DecodeConfig("fp16", 100, 1),  # not a multiple of the 16-byte vector
        DecodeConfig("fp32", 50, 1),
        DecodeConfig("fp16", 96, 4, mma=True, num_stages=3),  # mma needs head_dim % 64 == 0
        DecodeConfig("fp16", 128, 4, mma=True, num_stages=1),  # mma needs >= 2 stages
        DecodeConfig("fp16", 128, 9, mma=True, num_stages=2),  # > 8 heads per CTA
    ],
)
def test_invalid_configs_fail_to_compile(cfg):
    assert not cfg.is_valid(SM90)
    with pytest.raises(registry.KernelCompileError):
        registry.compile_offline([cfg], "sm_90")


def test_smem_rule_is_per_device():
    big = DecodeConfig("fp16", 256, 4, num_warps=4, num_stages=3, unroll=1, mma=True)
    assert SM80.smem_per_block < big.smem_bytes() <= SM90.smem_per_block
    assert big.is_valid(SM90)
    assert not big.is_valid(SM80) and "shared memory" in big.check(SM80)


def test_compile_error_names_variant_and_line():
    bad = DecodeConfig("fp16", 100, 1)
    with pytest.raises(registry.KernelCompileError) as e:
        registry.compile_offline([bad], "sm_90")
    msg = str(e.value)
    assert bad.key in msg and "kernels_cu/decode_split.cu(" in msg
