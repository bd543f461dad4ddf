"""Kernel variants compile for sm_80 and sm_90 through NVRTC (no GPU needed), with zero register
spills and no stack frame, and the Python validity rules agree with what the compiler reports.

What is compiled
----------------
* CI (the default run): ``fdpp.configs.ci_compile_set(device)`` for SM80 and SM90 (217 and 669
  variants) — every valid variant the shipped tables (``tuning/*.json``, hashes not
  checked) and the heuristic (``default_kernel`` for every dtype and K/V type x head_dim x cache x
  GQA ratio, ``nosplit_config``, ``combine_config``) can select (but ``configs.sampled_only``
  ones: on SM80 the quantized-cache variants, which share SM90's code, and pages but 16; on SM90
  pages outside ``configs.CI_PAGE_SIZES`` (1, 16, 64, 256): compiled on 12 variants of every kind,
  pages 16..256 of one variant took the same registers or within 5, with no spill anywhere; on
  both, unquantized tensor-core variants with group sizes outside ``configs.MMA_CI_GROUPS``
  (1, 4, 8): within 6 registers across group sizes), plus ``covering_sample``: ~20-90 more variants,
  plus ``configs.umax_twins``: the unified-max twins of the table's tensor-core variants and of
  the contiguous 4-heads-per-CTA ones (the full-space test does not compile twins)
  that hold by themselves every value of every template parameter and every page size with each
  mma value, and with the rest every pair of template-parameter values that some valid variant
  combines. Plus every combine variant and the register-rule cases below.
* ``merge_states`` (fdpp.merge): the default variant of each dtype at head_dim 64/128/256 and two
  odd head dims, both archs (``MERGE_SPACE``; a few seconds, its own test).
* ``quantize_kv`` (fdpp.quant, kernels_cu/quantize_kv.cu): all 25 variants, both archs, and the
  layout of its two argument structs (``QUANT_SPACE``; a few seconds).
* the quantized paged append (fdpp.cache, ``paged_append_quant`` in kernels_cu/paged_append.cu):
  ``append_quant_compile_space()`` (66 variants: every input dtype and format, both layouts), both
  archs (~5 s).
* The full space (slow): ``test_full_space_compiles_without_spills`` compiles every valid variant
  of the tuning space (``full_compile_space``: all dtypes, head dims, group sizes, contiguous and
  every page size, decode_nosplit; ~21,000 variants for both archs, ~1.5 CPU-hours). Run it before
  re-tuning or after a kernel change that touches register use::

      FDPP_SLOW=1 .venv/bin/pytest -q tests/test_compile.py -k full_space
      .venv/bin/pytest -q -m slow tests/test_compile.py

  It is marked ``slow`` and skips unless ``FDPP_SLOW=1`` is set or the ``-m`` expression asks for
  slow tests (``-m slow``, ``-m "slow or gpu"``; not ``-m "not slow"``, nor an expression that
  merely fails to exclude them, such as ``-m "not gpu"``).

``FDPP_COMPILE_JOBS=<n>`` sets the number of compiler processes (default: the CPU count, at least 2).
"""

import itertools
import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest
from nvrtc_util import nvrtc_compiles, slow_requested

from fdpp import registry
from fdpp.cache import PagedAppendQuantConfig, append_quant_compile_space
from fdpp.configs import (
    CI_PAGE_SIZES,
    CLUSTER_HEURISTIC_GROUPS,
    CLUSTER_HEURISTIC_SIZES,
    DECODE_PARAMS,
    HEAD_DIMS,
    INT4_CI,
    MMA_CI_GROUPS,
    MMA_DTYPES,
    PAGE_SIZES,
    QUANT_CI_GROUPS,
    QUANT_HEAD_DIMS,
    SM8X_CI_GROUPS,
    SM8X_CI_PAGE_SIZES,
    SM80,
    SM90,
    CombineConfig,
    DecodeConfig,
    ci_compile_set,
    combine_config,
    covering_sample,
    full_compile_space,
    heuristic_variants,
    sampled_only,
    table_variants,
    template_values,
)
from fdpp.dtypes import DTYPES, INT4_FORMATS, KV_FORMATS
from fdpp.launch import ParamStruct
from fdpp.merge import MergeConfig, merge_params_static_asserts, merge_variants
from fdpp.quant import DEQUANT_PARAMS, QUANT_PARAMS, QuantKernelConfig, quant_compile_space

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="needs the cuda-bindings NVRTC wheel")

DEVICES = {"sm_80": SM80, "sm_90": SM90}
CACHES = (0, *PAGE_SIZES)
CI_CACHES = (0, *CI_PAGE_SIZES)  # the caches of the heuristic variants compiled in full
REG_LIMIT = 255  # registers per thread an sm_80/sm_90 kernel may use

# ---- register-rule cases: outside the tuning space (unroll, warps or stages it never picks), chosen
# so that the estimate lands on both sides of REG_LIMIT.
RULE_REJECTS = [  # estimated_registers() > 255: the compiler hits the limit (255) or spills
    DecodeConfig("fp32", 256, 8, 4, 2, 9),  # fp32 d256, 8 heads per CTA, unroll 9: 256
    DecodeConfig("fp32", 256, 8, 4, 2, 8, page_size=16),  # 256 (paged)
    DecodeConfig("fp16", 256, 8, 8, 2, 9),  # 256
    DecodeConfig("fp16", 128, 8, 4, 2, 12),  # 280
    DecodeConfig("bf16", 128, 8, 8, 2, 10, page_size=64),  # 272
    DecodeConfig("fp16", 256, 1, 1, 2, 2, mma=True, page_size=16),  # tensor cores: 272
    DecodeConfig("bf16", 256, 8, 2, 2, 3, mma=True),  # 272
    DecodeConfig("fp16", 128, 8, 4, 2, 5, kv_dtype="fp8_e4m3"),  # FP8 codes on CUDA cores: 360
]
RULE_ACCEPTS = [  # estimate within 80 of the limit: compiles with no spill and no stack
    DecodeConfig("fp32", 128, 8, 4, 2, 9, page_size=16),  # 196
    DecodeConfig("fp32", 128, 8, 4, 2, 12),  # 212
    DecodeConfig("fp16", 128, 8, 4, 2, 6),  # 232
    DecodeConfig("bf16", 128, 8, 4, 1, 4),  # 216
    DecodeConfig("fp16", 128, 8, 8, 2, 6, page_size=16),  # 240
    DecodeConfig("fp16", 128, 8, 2, 2, 2, mma=True, page_size=16),  # tensor cores: 188
    DecodeConfig("fp16", 128, 1, 1, 2, 3, mma=True),  # 192
    DecodeConfig("fp16", 128, 8, 2, 2, 2, mma=True, page_size=8),  # tensor cores, pages of 8: 200
    DecodeConfig("bf16", 256, 1, 1, 2, 1, mma=True),  # 224
    DecodeConfig("fp16", 256, 8, 2, 2, 1, mma=True),  # 224 (unroll 2, est 248, reached 255 and spilled)
    DecodeConfig("fp16", 128, 8, 4, 2, 3, mma=True, kv_dtype="fp8_e4m3"),  # FP8 codes, tensor cores: 208
    DecodeConfig("fp16", 128, 8, 4, 2, 3, mma=True, kv_dtype="int4_g32"),  # INT4 code pairs, tensor cores: 214
]


# ---- compiling in a process pool ------------------------------------------------------------
def _compile_job(job):
    arch, configs = job
    return arch, registry.compile_offline(configs, arch)


def _cost(c) -> float:
    """Rough relative compile time of a variant (for ordering the pool's work)."""
    if isinstance(c, (CombineConfig, MergeConfig, QuantKernelConfig, PagedAppendQuantConfig)):
        return 0.3
    return (2.5 if c.mma else 1.0) * (1.3 if c.page_size else 1.0) * max(1.0, c.unroll / 4)


def compile_all(sets: dict[str, list], chunk: int = 12) -> dict[str, dict]:
    """{arch: configs} -> {arch: {key: ResourceReport}}, compiled by a process pool in chunks of one
    source file, the most expensive first (so no long job is left for the end)."""
    jobs = []
    for arch, configs in sets.items():
        by_source: dict[str, list] = {}
        for c in dict.fromkeys(configs):
            by_source.setdefault(c.source, []).append(c)
        for cs in by_source.values():
            cs.sort(key=_cost, reverse=True)
            jobs += [(arch, cs[i:i + chunk]) for i in range(0, len(cs), chunk)]
    jobs.sort(key=lambda j: sum(map(_cost, j[1])), reverse=True)
    out: dict[str, dict] = {arch: {} for arch in sets}
    workers = int(os.environ.get("FDPP_COMPILE_JOBS", "0")) or max(2, os.cpu_count() or 2)
    with ProcessPoolExecutor(max_workers=workers) as ex:
        for arch, reports in ex.map(_compile_job, jobs):
            out[arch].update(reports)
    return out


#: Known spills, pinned as "key on arch" -> max bytes (``test_known_spills_still_spill`` fails
#: once one is gone, so the list cannot hide a new one). The fp32 d128 combine spill on sm_90 went
#: with the merge rewrite (kernels_cu/merge.cuh).
KNOWN_SPILLS: dict[str, int] = {
    # Tensor cores, head_dim 256, 7 query heads per KV head, 3 stages (the heuristic's kernel for a
    # GQA ratio of 7 at D=256, a shape no shipped model has): ptxas reaches 255 registers and keeps
    # 4 B in an 8 B stack frame; the 2-stage variant and the other group sizes do not spill.
    "decode_split_mma.f16.d256.g7.w4.s3.u1 on sm_90": 8,
    "decode_split_mma.bf16.d256.g7.w4.s3.u1 on sm_90": 8,
}


#: The KNOWN_SPILLS variants, compiled with the CI set whether or not it holds them (group size 7
#: is outside configs.MMA_CI_GROUPS).
KNOWN_SPILL_CONFIGS = [DecodeConfig(dt, 256, 7, 4, 3, 1, mma=True) for dt in ("fp16", "bf16")]
assert {f"{c.key} on sm_90" for c in KNOWN_SPILL_CONFIGS} == set(KNOWN_SPILLS)


def resource_problems(configs, reports, arch) -> list[str]:
    """Why each compiled variant could not run as the rules promise (empty when all can)."""
    dev = DEVICES[arch]
    bad = []
    for c in configs:
        r = reports[c.key]
        limit = KNOWN_SPILLS.get(f"{c.key} on {arch}")
        if limit is not None and r.spill_stores <= limit and r.spill_loads <= limit and r.stack_bytes <= limit:
            continue
        why = []
        if r.spill_stores or r.spill_loads:
            why.append(f"spills {r.spill_stores}/{r.spill_loads} B")
        if r.stack_bytes:
            why.append(f"{r.stack_bytes} B stack frame")
        if r.registers * c.threads > dev.regs_per_sm:
            why.append(f"{r.registers} regs x {c.threads} threads > {dev.regs_per_sm}")
        if r.static_smem + c.smem_bytes() > dev.smem_per_block:
            why.append(f"smem {r.static_smem} + {c.smem_bytes()} > {dev.smem_per_block}")
        if why:
            bad.append(f"{c.key} on {arch} ({r.registers} regs): {', '.join(why)}")
    return bad


def _rule_applies(c: DecodeConfig, dev) -> bool:
    """True when ``c`` is valid on ``dev`` or rejected there for registers alone (the register rule
    comes last in check(): a config rejected for shared memory says nothing about it)."""
    why = c.check(dev)
    return why is None or "registers" in why


@pytest.fixture(scope="module")
def ci_sets():
    return {arch: ci_compile_set(dev) for arch, dev in DEVICES.items()}


COMBINE_SPACE = [CombineConfig(dt, d, w, sl) for dt in DTYPES for d in HEAD_DIMS for w in (2, 4, 8)
                 for sl in (1, 2, 4, 8) if d % (4 * sl) == 0]


@pytest.fixture(scope="module")
def ci_reports(ci_sets):
    """The CI set, the register-rule cases and every combine variant of both archs, compiled in
    one pool."""
    cases = {arch: [c for c in RULE_REJECTS + RULE_ACCEPTS if _rule_applies(c, dev)] for arch, dev in DEVICES.items()}
    known = {"sm_80": [], "sm_90": KNOWN_SPILL_CONFIGS}
    return compile_all({arch: ci_sets[arch] + cases[arch] + COMBINE_SPACE + known[arch] for arch in DEVICES})


# ---- the CI set ------------------------------------------------------------------------------
def _pairs(configs) -> set:
    return {p for c in configs for p in itertools.combinations(template_values(c), 2)}


@pytest.mark.parametrize("arch", DEVICES)
def test_ci_set_covers_tables_heuristic_and_space(arch, ci_sets):
    dev = DEVICES[arch]
    ci = ci_sets[arch]
    keys = [c.key for c in ci]
    assert len(keys) == len(set(keys)), "duplicates in the CI set"
    assert keys == [c.key for c in ci_compile_set(dev)], "the CI set is not deterministic"
    assert all(c.is_valid(dev) for c in ci)
    ci_keys = set(keys)
    # every valid variant the heuristic or a shipped table can select
    selectable = [c for c in (*heuristic_variants(dev), *table_variants(dev)) if c.is_valid(dev)]
    assert {c.key for c in selectable if not sampled_only(c, dev)} <= ci_keys
    # through the sample only: paged variants with pages outside CI_PAGE_SIZES (sm_80:
    # SM8X_CI_PAGE_SIZES), every one of them
    caches = CI_CACHES if arch == "sm_90" else (0, *SM8X_CI_PAGE_SIZES)
    assert all(sampled_only(c, dev) for c in heuristic_variants(dev) if getattr(c, "page_size", 0) not in caches)
    assert {getattr(c, "page_size", 0) for c in selectable if not sampled_only(c, dev)} == set(caches)
    # and at those caches: E5M2 variants, E4M3 ones but sm_90's with QUANT_CI_GROUPS heads per
    # CTA, INT4 but sm_90's configs.INT4_CI (fp16 q, groups of 64, 4 heads per CTA), unquantized
    # tensor-core ones with group sizes outside MMA_CI_GROUPS, and on sm_80 the unquantized
    # CUDA-core ones with group sizes outside configs.SM8X_CI_GROUPS
    at_ci = [c for c in selectable if getattr(c, "page_size", 0) in caches]
    assert {c.kv_dtype for c in at_ci if sampled_only(c, dev)} == {"fp8_e4m3", "fp8_e5m2"} | set(INT4_FORMATS) | (
        set(DTYPES) if arch == "sm_80" else set(MMA_DTYPES))
    plain = [c for c in at_ci if isinstance(c, DecodeConfig) and c.kv_dtype in DTYPES and c.cluster == 1]
    assert {c.group_size for c in plain if sampled_only(c, dev) and c.mma} == set(range(1, 9)) - set(MMA_CI_GROUPS)
    assert {c.group_size for c in plain if sampled_only(c, dev) and not c.mma} == (
        set(range(1, 9)) - set(SM8X_CI_GROUPS) if arch == "sm_80" else set())
    fp8_ci = {c.key for c in heuristic_variants(dev) if c.is_valid(dev) and getattr(c, "kv_dtype", "") == "fp8_e4m3"
              and not sampled_only(c, dev)}
    assert len(fp8_ci) == (0 if arch == "sm_80" else len(MMA_DTYPES) * len(QUANT_HEAD_DIMS) * len(caches)
                           * len(QUANT_CI_GROUPS) + len(MMA_DTYPES) * len(CLUSTER_HEURISTIC_SIZES)) and fp8_ci <= ci_keys
    # the heuristic's cluster twins (sm_90: each tensor-core kernel of an unquantised or FP8 cache
    # with CLUSTER_HEURISTIC_GROUPS heads per CTA, in clusters of 2 and 8) CI compiles: contiguous,
    # head_dim 128, 4 query heads per CTA
    twins = [c for c in heuristic_variants(dev) if isinstance(c, DecodeConfig) and c.cluster > 1]
    assert len(twins) == (0 if arch == "sm_80" else len(CLUSTER_HEURISTIC_SIZES) * sum(
        1 for c in heuristic_variants(dev) if isinstance(c, DecodeConfig) and c.cluster == 1 and c.mma
        and c.kv_dtype not in INT4_FORMATS and c.group_size in CLUSTER_HEURISTIC_GROUPS and c.is_valid(dev)))
    assert len({c.key for c in twins if not sampled_only(c, dev)}) == (
        0 if arch == "sm_80" else len(CLUSTER_HEURISTIC_SIZES) * len(MMA_DTYPES) * 2)  # unquantised and E4M3
    assert {c.key for c in table_variants(dev) if c.is_valid(dev)} <= ci_keys  # a shipped table's: always
    i4_ci = {c.key for c in heuristic_variants(dev) if c.is_valid(dev) and getattr(c, "kv_dtype", "") in INT4_FORMATS
             and not sampled_only(c, dev)}  # the heuristic's INT4 variants CI compiles (tables may add more)
    assert len(i4_ci) == (0 if arch == "sm_80" else len(QUANT_HEAD_DIMS) * len(caches) * len(INT4_CI[2])) \
        and i4_ci <= ci_keys
    # the heuristic part alone: one phase-1 kernel per (dtype, K/V type) x head_dim x cache x group
    # size, one decode_nosplit per dtype x head_dim (contiguous), the combines (a slice count per
    # row count) per dtype x head_dim
    n_caches = len(DTYPES) * len(HEAD_DIMS) * len(CACHES)
    n_fp8 = len(MMA_DTYPES) * len(KV_FORMATS) * len(QUANT_HEAD_DIMS) * len(CACHES)
    n_int4 = len(MMA_DTYPES) * len(CACHES) * sum(f.group_size <= d for f in INT4_FORMATS.values() for d in QUANT_HEAD_DIMS)
    combines = {combine_config(dt, d, rows, dev).key for dt in DTYPES for d in HEAD_DIMS for rows in (1, 32, 64, 1 << 20)}
    assert len(combines) >= 2 * len(DTYPES) * len(HEAD_DIMS)  # sliced and unsliced
    assert len(heuristic_variants(dev)) == ((n_caches + n_fp8 + n_int4) * 8 + len(DTYPES) * len(HEAD_DIMS) + len(combines)
                                           + len(twins))
    # the sample: every (parameter, value) and every page size with each mma value by itself, and
    # with the selectable variants every pair of values some valid variant combines
    space = full_compile_space(dev)
    table_keys = {c.key for c in table_variants(dev)}  # compiled in full even where sampled_only (cluster twins)
    sample = covering_sample(dev, [c for c in selectable if isinstance(c, DecodeConfig)
                                   and (not sampled_only(c, dev) or c.key in table_keys)])
    assert {c.key for c in sample} <= ci_keys
    values = {v for c in space for v in template_values(c)}
    assert values == {v for c in sample for v in template_values(c)}
    assert {("mma", m) for m in (False, True)} | {("page_size", p) for p in CACHES} <= values
    assert {(("mma", m), ("page_size", p)) for m in (False, True) for p in CACHES} <= _pairs(sample)
    assert _pairs(space) == _pairs(c for c in ci if isinstance(c, DecodeConfig))
    assert 2 * len(CACHES) <= len(sample) <= 90  # larger on sm_80, where fewer variants are compiled in full
    # on its own (nothing compiled anyway) the sample is a full pairwise covering: >= 10 caches x 8
    # group sizes, yet a small fraction of the space
    alone = covering_sample(dev)
    assert _pairs(alone) == _pairs(space) and 80 <= len(alone) < len(space) / 50


def test_table_variants_are_valid_on_their_device():
    # entries are read without their source hashes: every variant a table names counts
    # the shipped H200 table: its kernels must run on the H200 (SM90's limits)
    variants = table_variants(SM90)
    assert len(variants) >= 10 and any(isinstance(c, CombineConfig) for c in variants)
    assert [c.key for c in variants if not c.is_valid(SM90)] == []
    assert table_variants(SM80) == []  # no A100 table is shipped


@pytest.mark.parametrize("arch", DEVICES)
def test_heuristic_variants_are_valid(arch):
    dev = DEVICES[arch]  # default_config raises for an invalid default: it must never pick one
    assert [f"{c.key}: {c.check(dev)}" for c in heuristic_variants(dev) if not c.is_valid(dev)] == []


def test_ci_variants_compile_without_spills(ci_sets, ci_reports):
    total = 0
    bad = []
    for arch, configs in ci_sets.items():
        assert {c.key for c in configs} <= set(ci_reports[arch]), f"variants missing from the {arch} report"
        bad += resource_problems(configs, ci_reports[arch], arch)
        total += len(configs)
    assert bad == [], f"{len(bad)} of {total} variants cannot run as compiled:\n" + "\n".join(bad)
    # per arch: the heuristic's 3 dtypes x 4 head dims x its caches (sm_90: 5, CI_CACHES; sm_80: 2)
    # x at least MMA_CI_GROUPS' 3 group sizes, its 12 decode_nosplit (contiguous) and 12 combine
    # variants, the covering sample's top-up (>= 1 per page size); on sm_90 also the heuristic's
    # E4M3 ones with QUANT_CI_GROUPS heads per CTA (2 q dtypes x 2 head dims x 5 caches = 20), its
    # INT4_CI ones (10) and the H200 table's variants besides (>= 10 the heuristic does not pick)
    assert len(ci_sets["sm_80"]) >= 3 * 4 * 2 * len(MMA_CI_GROUPS) + 12 + 12 + 10
    assert len(ci_sets["sm_90"]) >= 3 * 4 * len(CI_CACHES) * len(MMA_CI_GROUPS) + 20 + 10 + 12 + 12 + 10 + 10
    assert total > 700


def test_split_kernels_have_no_static_shared_memory(ci_sets, ci_reports):
    """The phase-1 kernels keep everything in their dynamic buffer: a static ``__shared__`` variable
    is placed first and moves the dynamic base off 128-byte alignment, which slowed every split
    kernel's main loop by 10-15 % on an H200 (results/device_runH1/README.md: the fused merge's
    role word, moved into the dynamic buffer)."""
    static = [f"{c.key} on {arch}: {ci_reports[arch][c.key].static_smem} B"
              for arch, configs in ci_sets.items() for c in configs
              if isinstance(c, DecodeConfig) and ci_reports[arch][c.key].static_smem]
    assert sum(isinstance(c, DecodeConfig) for cs in ci_sets.values() for c in cs) > 600
    assert static == [], "phase-1 kernels with static shared memory:\n" + "\n".join(static[:20])


# ---- the register estimate -------------------------------------------------------------------
def test_register_rule_agrees_with_compiler(ci_reports):
    checked = {c.key: 0 for c in RULE_REJECTS + RULE_ACCEPTS}
    disagree = []
    for arch, dev in DEVICES.items():
        for c in RULE_REJECTS + RULE_ACCEPTS:
            if not _rule_applies(c, dev):
                continue  # rejected for shared memory on this arch
            checked[c.key] += 1
            r = ci_reports[arch][c.key]
            est = c.estimated_registers()
            if c.is_valid(dev):  # the rule accepts: no spill and no stack frame
                assert c in RULE_ACCEPTS, f"{c.key} on {arch}: accepted, est {est}"
                if r.spill_stores or r.spill_loads or r.stack_bytes:
                    disagree.append(f"{c.key} on {arch}: accepted (est {est}) but {r}")
            else:  # the rule rejects: the compiler needs the whole register file, or spills
                assert c in RULE_REJECTS, f"{c.key} on {arch}: rejected, {c.check(dev)}"
                if r.registers < REG_LIMIT and not (r.spill_stores or r.spill_loads or r.stack_bytes):
                    disagree.append(f"{c.key} on {arch}: rejected (est {est}) but {r}")
    assert [k for k, n in checked.items() if n == 0] == [], "cases checked on no arch"
    assert disagree == [], "the register estimate disagrees with ptxas:\n" + "\n".join(disagree)


def test_register_rule_cases_are_outside_the_tuning_space():
    space = {c.key for dev in DEVICES.values() for c in full_compile_space(dev)}
    assert [c.key for c in RULE_REJECTS + RULE_ACCEPTS if c.key in space] == []
    for c in RULE_REJECTS:
        assert c.estimated_registers() > REG_LIMIT and "registers" in c.check(SM90)
    for c in RULE_ACCEPTS:
        assert REG_LIMIT - 80 <= c.estimated_registers() <= REG_LIMIT and c.is_valid(SM90)


# ---- the kernel argument struct --------------------------------------------------------------
def _layout_program(mirror: ParamStruct) -> str:
    return f'#include "kv_cache.cuh"\n{mirror.static_asserts()}\n'


def test_decode_params_mirror_matches_cxx_layout():
    ok, log = nvrtc_compiles(_layout_program(DECODE_PARAMS))
    assert ok, log
    assert DECODE_PARAMS.static_asserts().count("static_assert") == len(DECODE_PARAMS.fields) + 1


def test_wrong_decode_params_mirror_fails_to_compile():
    fields = list(DECODE_PARAMS.fields)
    i, j = fields.index(("q_sb", "i64")), fields.index(("k_sb", "i64"))
    fields[i], fields[j] = fields[j], fields[i]  # two fields swapped: other offsets, same size
    swapped = ParamStruct(DECODE_PARAMS.c_name, fields)
    assert swapped.dtype.itemsize == DECODE_PARAMS.dtype.itemsize
    ok, log = nvrtc_compiles(_layout_program(swapped))
    assert not ok
    assert "fdpp::DecodeParams.q_sb" in log and "fdpp::DecodeParams.k_sb" in log, log
    short = ParamStruct(DECODE_PARAMS.c_name, DECODE_PARAMS.fields[:-2])  # two 4-byte fields missing: size
    assert short.dtype.itemsize != DECODE_PARAMS.dtype.itemsize
    ok, log = nvrtc_compiles(_layout_program(short))
    assert not ok and "fdpp::DecodeParams size" in log, log


# ---- combine, invalid configs, error messages ------------------------------------------------
def test_combine_variants_compile(ci_reports):
    bad = [b for arch in DEVICES for b in resource_problems(COMBINE_SPACE, ci_reports[arch], arch)]
    assert bad == [], "\n".join(bad)


def test_known_spills_still_spill(ci_reports):
    """Each KNOWN_SPILLS entry still spills (remove it once fixed), and no more than its limit."""
    by_name = {f"{key} on {arch}": r for arch in DEVICES for key, r in ci_reports[arch].items()}
    assert set(KNOWN_SPILLS) <= set(by_name)
    for name, limit in KNOWN_SPILLS.items():
        r = by_name[name]
        assert 0 < r.spill_stores <= limit, f"{name}: {r} (fixed? then drop it from KNOWN_SPILLS)"


#: merge_states variants compiled in CI: every dtype at head_dim 64/128/256 (the defaults a call
#: uses), plus head_dim 96 (12 threads per row) and fp32 at 512 (128 threads per row).
MERGE_SPACE = [*merge_variants((64, 128, 256)), MergeConfig("bf16", 96, 10), MergeConfig("fp32", 512, 1)]


def test_merge_variants_compile_without_spills():
    assert all(c.is_valid() for c in MERGE_SPACE)
    reports = compile_all({arch: list(MERGE_SPACE) for arch in DEVICES}, chunk=len(MERGE_SPACE))
    bad = [b for arch in DEVICES for b in resource_problems(MERGE_SPACE, reports[arch], arch)]
    assert bad == [], "\n".join(bad)
    assert all(set(reports[arch]) == {c.key for c in MERGE_SPACE} for arch in DEVICES)


def test_merge_params_mirror_matches_cxx_layout():
    ok, log = nvrtc_compiles(f'#include "merge_states.cu"\n{merge_params_static_asserts()}\n')
    assert ok, log
    wrong = merge_params_static_asserts().replace("MergeParams, o_ss) == ", "MergeParams, o_ss) == 8 + ")
    ok, log = nvrtc_compiles(f'#include "merge_states.cu"\n{wrong}\n')
    assert not ok and "MergeParams.o_ss" in log, log


#: quantize_kv kernels compiled in CI: every variant (amax, descale, fp8/int4 quantize, dequantize).
QUANT_SPACE = quant_compile_space()


def test_quant_variants_compile_without_spills():
    assert len(QUANT_SPACE) == 25 and len({c.key for c in QUANT_SPACE}) == 25
    reports = compile_all({arch: list(QUANT_SPACE) for arch in DEVICES}, chunk=len(QUANT_SPACE))
    bad = [b for arch in DEVICES for b in resource_problems(QUANT_SPACE, reports[arch], arch)]
    assert bad == [], "\n".join(bad)
    assert all(set(reports[arch]) == {c.key for c in QUANT_SPACE} for arch in DEVICES)
    assert all(r.static_smem <= 64 for arch in DEVICES for r in reports[arch].values())


def test_quant_params_mirror_matches_cxx_layout():
    prog = f'#include "quantize_kv.cu"\n{QUANT_PARAMS.static_asserts()}\n{DEQUANT_PARAMS.static_asserts()}\n'
    ok, log = nvrtc_compiles(prog)
    assert ok, log
    f = list(QUANT_PARAMS.fields)
    f[12], f[13] = f[13], f[12]  # k_sb <-> k_sn: the check catches a swap
    ok, log = nvrtc_compiles(f'#include "quantize_kv.cu"\n{ParamStruct(QUANT_PARAMS.c_name, f).static_asserts()}\n')
    assert not ok and "QuantKVParams.k_sb" in log, log


def test_quant_append_variants_compile_without_spills():
    space = append_quant_compile_space()
    reports = compile_all({arch: list(space) for arch in DEVICES}, chunk=17)
    bad = [b for arch in DEVICES for b in resource_problems(space, reports[arch], arch)]
    assert bad == [], "\n".join(bad)
    assert all(set(reports[arch]) == {c.key for c in space} for arch in DEVICES)
    assert all(r.static_smem == 0 for arch in DEVICES for r in reports[arch].values())


def test_bad_quant_variant_fails_to_compile():
    with pytest.raises(registry.KernelCompileError, match="group size"):
        registry.compile_offline([QuantKernelConfig("quantize_int4", dtype="fp16", group_size=16)], "sm_90")
    with pytest.raises(registry.KernelCompileError, match="dividing HEAD_DIM"):
        registry.compile_offline([PagedAppendQuantConfig("fp16", "int4", 128, 64, 16)], "sm_90")


@pytest.mark.parametrize(
    "cfg",
    [
        DecodeConfig("fp16", 100, 1),  # not a multiple of the 16-byte vector
        DecodeConfig("fp32", 50, 1),
        DecodeConfig("fp16", 96, 4, mma=True, num_stages=3),  # mma needs head_dim % 64 == 0
        DecodeConfig("fp16", 128, 4, mma=True, num_stages=1),  # mma needs >= 2 stages
        DecodeConfig("fp16", 128, 9, mma=True, num_stages=2),  # > 8 heads per CTA
        DecodeConfig("fp16", 128, 4, page_size=3),  # pages must be a power of two
        DecodeConfig("bf16", 128, 4, mma=True, num_stages=3, unroll=1, page_size=48),
    ],
    ids=lambda c: c.key,
)
def test_invalid_configs_fail_to_compile(cfg):
    assert not cfg.is_valid(SM90)
    with pytest.raises(registry.KernelCompileError):
        registry.compile_offline([cfg], "sm_90")


@pytest.mark.parametrize("page_size", [3, 48, 512, -1])
def test_check_rejects_page_sizes_outside_the_set(page_size):
    why = DecodeConfig("fp16", 128, 4, page_size=page_size).check(SM90)
    assert why is not None and "page_size" in why


def test_smem_rule_is_per_device():
    big = DecodeConfig("fp16", 256, 4, num_warps=4, num_stages=3, unroll=1, mma=True)
    assert SM80.smem_per_block < big.smem_bytes() <= SM90.smem_per_block
    assert big.is_valid(SM90)
    assert not big.is_valid(SM80) and "shared memory" in big.check(SM80)
    paged = DecodeConfig("fp16", 256, 4, num_warps=4, num_stages=3, unroll=1, mma=True, page_size=16)
    assert paged.smem_bytes() == big.smem_bytes() and paged.is_valid(SM90) and not paged.is_valid(SM80)


@pytest.mark.parametrize("bad, where", [
    (DecodeConfig("fp16", 100, 1), "kernels_cu/decode_split.cu("),
    (DecodeConfig("fp16", 128, 4, page_size=3), "kernels_cu/kv_cache.cuh("),
], ids=["head_dim", "page_size"])
def test_compile_error_names_variant_and_line(bad, where):
    with pytest.raises(registry.KernelCompileError) as e:
        registry.compile_offline([bad], "sm_90")
    msg = str(e.value)
    assert bad.key in msg and where in msg, msg
    assert re.search(re.escape(where) + r"\d+\)", msg), msg


# ---- the full space (slow) ---------------------------------------------------------------------
@pytest.mark.slow
def test_full_space_compiles_without_spills(request):
    if not slow_requested(request.config):
        pytest.skip("the full space takes ~1.5 CPU-hours: set FDPP_SLOW=1 or pass -m slow")
    spaces = {arch: full_compile_space(dev) for arch, dev in DEVICES.items()}
    reports = compile_all({arch: space + COMBINE_SPACE for arch, space in spaces.items()})
    bad = []
    for arch, space in spaces.items():
        bad += resource_problems(space + COMBINE_SPACE, reports[arch], arch)
    total = sum(map(len, spaces.values()))
    assert bad == [], f"{len(bad)} of {total} variants cannot run as compiled:\n" + "\n".join(bad)
    # 3 dtypes x 4 head dims x 10 caches x (8 group sizes x 8 CUDA-core shapes + nosplit), plus the
    # mma shapes of fp16/bf16 at head_dim 64/128/256, less what shared memory rules out
    assert total > 20000


def test_kernels_have_no_generic_lambdas():
    """NVRTC 13.0 (the device machine's, through cuda.bindings) treats the call operator of a lambda
    with an ``auto`` parameter in device code as a host function and refuses to compile it ("host
    functions are not allowed in JIT mode"); NVRTC 13.5, which CI runs, accepts it. flat_gemm.cu
    had one until 2026-12-07. Lambdas in kernels_cu take concrete parameter types."""
    generic = re.compile(r"\[[^\]\n]*\]\s*\(\s*(?:const\s+)?auto\b")
    found = [f"{p.name}:{i}: {line.strip()}" for p in sorted(registry.kernel_dir().iterdir())
             if p.suffix in (".cu", ".cuh") for i, line in enumerate(p.read_text().splitlines(), 1)
             if generic.search(line)]
    assert found == [], "\n".join(found)
