"""fdpp.flat_gemm: variants, validity, dataflow table, validation, NumPy fallback (CPU) and the
kernels against a float64 reference (GPU, ``-m gpu``).

GPU tests poison every output with NaN before the call, so an unwritten element fails, and force
every kernel path (flat GEMM with each warp layout, GEMV, cuBLAS, stream-K grids from one CTA to
more than the tiles) at least once.
"""

from __future__ import annotations

import json
import os
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from nvrtc_util import slow_requested

import fdpp
from fdpp import dispatch, gemm, gemm_tune, registry, tables
from fdpp.configs import SM80, SM90
from fdpp.dtypes import DTYPES
from fdpp.reference import assert_close

ROOT = Path(__file__).resolve().parent.parent

DTS = ("fp16", "bf16")
ARCHS = ("sm_80", "sm_90")


# ---- variants compile, with no spills ---------------------------------------------------------
#: What CI compiles (CI time: ~1.4 s per variant on one core): every variant of both dtypes on
#: sm_90, every third fp16 variant on sm_80 (the same code; there only the MMA and the
#: griddepcontrol wait differ); the slow test compiles every variant of both dtypes on sm_80.
CI_STEP = {("fp16", "sm_90"): 1, ("bf16", "sm_90"): 1, ("fp16", "sm_80"): 3}


def _compile(job: tuple[str, str, int, int, int]) -> tuple[str, str, dict[str, registry.ResourceReport]]:
    dt, arch, lo, hi, step = job
    return dt, arch, registry.compile_offline(gemm.compile_space(dt)[::step][lo:hi], arch)


def _compile_pairs(steps: dict[tuple[str, str], int]) -> dict[tuple[str, str], dict[str, registry.ResourceReport]]:
    """Every ``step``-th variant of each (dtype, arch), compiled in chunks of 8 (the pool stays busy
    to the end: whole (dtype, arch) programs on two cores left one core idle for a long tail)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    jobs = [(dt, arch, lo, lo + 8, step) for (dt, arch), step in steps.items()
            for lo in range(0, len(gemm.compile_space(dt)[::step]), 8)]
    out: dict[tuple[str, str], dict[str, registry.ResourceReport]] = {pair: {} for pair in steps}
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as ex:
        for dt, arch, rep in ex.map(_compile, jobs):
            out[(dt, arch)].update(rep)
    return out


@pytest.fixture(scope="module")
def reports() -> dict[tuple[str, str], dict[str, registry.ResourceReport]]:
    return _compile_pairs(CI_STEP)


def _check_space(rep: dict[str, registry.ResourceReport], dt: str, step: int = 1, arch: str = "sm_90") -> None:
    space = gemm.compile_space(dt)
    assert 20 <= len(space) <= 110  # a bound on CI's compile time
    assert set(rep) == {c.key for c in space[::step]}
    bad = {k: r for k, r in rep.items() if r.spill_stores or r.spill_loads or r.stack_bytes or r.registers > 255}
    assert not bad, f"spills or stack frames: {bad}"
    # the validity rule counts static shared memory with an upper bound that stays close to ptxas's
    dev = SM80 if arch == "sm_80" else SM90  # (sm_80 compiles flat_tma's body out: not counted there)
    off = {c.key: (rep[c.key].static_smem, c.static_smem_bytes()) for c in space[::step] if c.is_valid(dev)
           and not rep[c.key].static_smem <= c.static_smem_bytes() <= rep[c.key].static_smem + 64}
    assert not off, f"static shared memory (ptxas, rule): {off}"


@pytest.mark.parametrize(("dt", "arch"), list(CI_STEP))
def test_every_variant_compiles_without_spills(reports, dt, arch):
    _check_space(reports[(dt, arch)], dt, CI_STEP[(dt, arch)], arch)
    if CI_STEP[(dt, arch)] > 1:  # the sample still holds every block shape and every M tile count
        got = [c for c in gemm.compile_space(dt)[::CI_STEP[(dt, arch)]] if isinstance(c, gemm.FlatGemmConfig)]
        every = [c for c in gemm.compile_space(dt) if isinstance(c, gemm.FlatGemmConfig)]
        assert {c.m_tiles for c in got} == {c.m_tiles for c in every}


@pytest.mark.slow
def test_every_variant_compiles_without_spills_on_sm80(request):
    if not slow_requested(request.config):
        pytest.skip("both dtypes' every variant on sm_80: set FDPP_SLOW=1 or pass -m slow")
    for (dt, _arch), rep in _compile_pairs({(dt, "sm_80"): 1 for dt in DTS}).items():
        _check_space(rep, dt, arch="sm_80")


def test_space_covers_every_m():
    for dt in DTS:
        space = gemm.compile_space(dt)
        assert all(c.check(SM90) is None for c in space)
        for m in range(1, gemm.MAX_M + 1):
            assert any(isinstance(c, gemm.FlatGemmConfig) and c.fits(m) for c in space), m
        assert {c.m_max for c in space if isinstance(c, gemm.GemvConfig)} == set(gemm.GEMV_M)


def test_keys_unique_and_derived():
    space = [c for dt in DTS for c in gemm.compile_space(dt)]
    keys = [c.key for c in space]
    assert len(keys) == len(set(keys))
    c = gemm.FlatGemmConfig("bf16", 32, 256, 4, 3, 2, 256)
    assert c.name_expression() == "fdpp::flat_gemm<fdpp::bfloat16_t,32,256,4,3,2,256>"
    assert c.key == "flat_gemm.bf16.n32.k256.w4.s3.m2.p256"
    g = gemm.GemvConfig("fp16", 8, 2, 4, 4)
    assert g.name_expression() == "fdpp::gemv<fdpp::half_t,8,2,4,4,0>"
    assert g.key == "gemv.f16.w8.r2.u4.m4.p0"


STATIC_INVALID = [
    gemm.FlatGemmConfig("fp16", 24, 128, 4, 4, 1),   # block_n not a multiple of 16
    gemm.FlatGemmConfig("fp16", 48, 128, 4, 4, 1),   # 3 row groups, 4 warps
    gemm.FlatGemmConfig("fp16", 64, 96, 4, 4, 1),    # block_k not a multiple of 64
    gemm.FlatGemmConfig("fp16", 16, 64, 4, 4, 1),    # 64 columns over 4 warps: 16 each
    gemm.FlatGemmConfig("fp16", 64, 128, 4, 1, 1),   # one stage
    gemm.FlatGemmConfig("fp16", 64, 128, 4, 4, 16),  # m_tiles > 8
    gemm.FlatGemmConfig("fp16", 64, 128, 4, 4, 1, 128),  # prefetch hint other than 0 / 256
]


@pytest.mark.parametrize("cfg", STATIC_INVALID, ids=lambda c: c.key)
def test_invalid_configs_fail_to_compile(cfg):
    """What check() rejects for layout reasons is what the kernel's static_asserts reject."""
    pytest.importorskip("cuda.bindings.nvrtc")
    assert cfg.check(SM90) is not None
    with pytest.raises(registry.KernelCompileError):
        registry.compile_offline([cfg], "sm_90")


def test_shared_memory_limit_is_per_device():
    big = gemm.FlatGemmConfig("fp16", 64, 256, 4, 3, 8)
    assert big.smem_bytes() > SM80.smem_per_block and big.smem_bytes() <= SM90.smem_per_block
    assert big.check(SM90) is None
    assert "shared memory" in big.check(SM80)


def test_smem_bytes_mirrors_kernel_layout():
    c = gemm.FlatGemmConfig("fp16", 64, 128, 4, 4, 1)
    # 4 stages x (64 + 8 rows) x 256 B + (1 slice x 8 rows x 68 floats)
    assert c.smem_bytes() == 4 * 72 * 256 + 8 * 68 * 4
    c2 = gemm.FlatGemmConfig("fp16", 32, 128, 4, 4, 2)  # 2 row groups, 4 warps: 2 K slices
    assert c2.warps_k == 2 and c2.smem_bytes() == 4 * 48 * 256 + 2 * 16 * 36 * 4
    assert gemm.GemvConfig("fp16", 4, 2, 2, 4).smem_bytes() == 4 * 12 * 4


# ---- dataflow ----------------------------------------------------------------------------------
@pytest.mark.parametrize("device", [SM80, SM90], ids=lambda d: d.arch)
def test_heuristic_plans_are_valid(device):
    for dt in DTS:
        for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 31, 33, 64):
            for n, k in ((1, 8), (77, 136), (4096, 14336), (28672, 4096)):
                p = gemm.choose(m, n, k, device, dt, table=gemm.GemmTable({}))
                assert p.source == "heuristic"
                assert p.config is not None and p.config.fits(m) and p.config.is_valid(device), (m, p)
                assert p.config.dtype == dt


def test_buckets():
    assert [gemm.m_bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 17, 33, 64)] == [1, 2, 4, 4, 8, 8, 16, 32, 64, 64]
    assert [gemm.m_tiles_for(m) for m in (1, 8, 9, 16, 17, 32, 33, 64)] == [1, 1, 2, 2, 4, 4, 8, 8]


def _fake_table(tmp_path, entries, edit=None, **hdr):
    """A GEMM table of ``entries`` (GemmEntry), its header updated with ``hdr``, each entry's JSON
    updated with ``edit[key]`` (a dict; None removes the entry's ``plan``)."""
    path = tmp_path / gemm.table_filename(SM90.name)
    gemm.write_table(path, SM90, entries, merge=False)
    if hdr or edit:
        doc = json.loads(path.read_text())
        doc.update(hdr)
        for key, plan in (edit or {}).items():
            doc["entries"][key]["plan"] = plan
        path.write_text(json.dumps(doc))
    return path


def E(plan, m, n=4096, k=4096, dtype="fp16", **kw):  # noqa: N802 - an entry, briefly
    return gemm.GemmEntry.of(plan, dtype, n, k, m, **kw)


def test_table_round_trip_and_lookup(tmp_path):
    flat = gemm.GemmPlan("flat", gemm.FlatGemmConfig("fp16", 32, 256, 4, 4, 1), 264)
    gemv = gemm.GemmPlan("gemv", gemm.GemvConfig("fp16", 4, 2, 4, 1), None)
    entries = [E(gemv, 1, time_us=9.0), E(flat, 8, time_us=10.0), E(gemm.GemmPlan("cublas"), 64)]
    path = _fake_table(tmp_path, entries)
    t = gemm.read_table(path, SM90)
    assert t.error is None and len(t.entries) == 3
    p1 = gemm.choose(1, 4096, 4096, SM90, "fp16", table=t)
    assert p1.impl == "gemv" and p1.source == "table" and p1.config.m_max == 1
    # M = 3 (bucket 4): nearest bucket with a plan that fits 3 rows is the flat one at 8
    p3 = gemm.choose(3, 4096, 4096, SM90, "fp16", table=t)
    assert p3.impl == "flat" and p3.config.block_k == 256 and p3.config.m_tiles == 1 and p3.grid == 264
    p16 = gemm.choose(16, 4096, 4096, SM90, "fp16", table=t)
    assert p16.impl == "flat" and p16.config.m_tiles == 2  # m_tiles follows M, not the entry
    assert gemm.choose(64, 4096, 4096, SM90, "fp16", table=t).impl == "cublas"
    # other shape or dtype: heuristic
    assert gemm.choose(8, 4096, 8192, SM90, "fp16", table=t).source == "heuristic"
    pb = gemm.choose(8, 4096, 4096, SM90, "bf16", table=t)  # fp16 entry serves bf16
    assert pb.source == "table" and pb.config.dtype == "bf16" and pb.config.block_k == 256


def test_tma_entry_round_trip_and_arch_rule(tmp_path):
    tma = gemm.GemmPlan("tma", gemm.FlatTmaConfig("fp16", 8, 4, 1, 2, 1), 256)
    path = _fake_table(tmp_path, [E(tma, 2)])
    t = gemm.read_table(path, SM90)
    p = gemm.choose(2, 4096, 4096, SM90, "fp16", table=t)
    assert p.impl == "tma" and p.config == gemm.FlatTmaConfig("fp16", 8, 4, 1, 2, 1) and p.grid == 256
    assert gemm.choose(16, 4096, 4096, SM90, "fp16", table=t).config.m_tiles == 2
    # bulk copies need sm_90: the entry is skipped on an A100 and the heuristic avoids flat_tma
    assert "sm_90" in gemm.FlatTmaConfig("fp16").check(SM80)
    a100 = gemm.read_table(path, SM80)  # written for the H200: ignored as a whole
    assert a100.error is not None
    assert gemm.heuristic_plan(2, 4096, 4096, "fp16", SM80).impl == "flat"
    assert gemm.heuristic_plan(2, 4096, 4096, "fp16", SM90).impl == "tma"


def test_shipped_h200_table_is_current():
    t = gemm.read_table(tables.shipped_dir() / gemm.table_filename(SM90.name), SM90)
    assert t.error is None and len(t.entries) == 40 and not t.rejected
    t = gemm.GemmTable(t.entries)
    assert sum(".e4m3." in k for k in t.entries) == 20  # FP8-weight entries of the four shapes x five Ms
    impls = {gemm.choose(m, 4096, 4096, SM90, "fp16", table=t).impl for m in (1, 2, 4, 8)}
    assert impls == {"tma"}
    w8 = {gemm.choose(m, 4096, 4096, SM90, "fp16", table=t, wfmt="e4m3").config.w8 for m in (1, 2, 4, 8)}
    assert w8 == {1}


def test_cublas_keeps_an_entry_unless_beaten_by_the_margin():
    tma = gemm.GemmPlan("tma", gemm.FlatTmaConfig("fp16", 4, 8, 1, 2, 0, 1), 132, "tuner")
    cub = gemm.GemmPlan("cublas", None, None, "tuner")
    inside = gemm_tune.rank_candidates([(61.59, tma), (61.88, cub)], 61.88)  # 0.5 % faster: noise
    assert [p.impl for _, p in inside] == ["cublas", "tma"]
    clear = gemm_tune.rank_candidates([(11.31, tma), (13.83, cub)], 13.83)  # 18 % faster
    assert [p.impl for _, p in clear] == ["tma", "cublas"]
    assert gemm_tune.rank_candidates([(9.0, tma), (8.0, cub)], 8.0)[0][1] is cub  # cuBLAS fastest
    assert gemm_tune.rank_candidates([(9.0, tma)], float("nan"))[0][1] is tma  # cuBLAS failed to run
    edge = 13.83 * (1 - gemm_tune.CUBLAS_MARGIN)
    assert gemm_tune.rank_candidates([(edge, tma), (13.83, cub)], 13.83)[0][1] is tma


def test_table_for_other_device_op_or_source_is_ignored(tmp_path):
    entries = [E(gemm.GemmPlan("cublas"), 1, 64, 64)]
    other = _fake_table(tmp_path, entries, **{"device": {"name": "NVIDIA A100-SXM4-80GB"}})
    with pytest.warns(RuntimeWarning, match="A100"):
        t = gemm.read_table(other, SM90)
    assert t.error and not t.entries
    attn = _fake_table(tmp_path, entries, op="attention")
    with pytest.warns(tables.TableWarning, match="op 'attention', expected 'flat_gemm'"):
        assert not gemm.read_table(attn, SM90).entries
    with pytest.warns(tables.TableWarning, match="op 'flat_gemm', expected 'attention'"):
        assert not tables.read_table(_fake_table(tmp_path, entries), SM90).entries  # nor the other way
    old = tmp_path / "old.json"  # the format before GEMM tables were fdpp.tables' (no "op")
    old.write_text(json.dumps({"schema": 1, "kind": "flat_gemm", "device": "NVIDIA H200", "entries": {}}))
    with pytest.warns(tables.TableWarning, match="older table format"):
        assert gemm.read_table(old, SM90).error
    stale = tmp_path / "stale.json"
    stale.write_text(_fake_table(tmp_path, entries).read_text().replace(gemm.current_source_hash(), "0" * 16))
    with pytest.warns(tables.TableWarning, match="flat_gemm.cu changed since tuning"):
        t = gemm.read_table(stale, SM90)
    assert not t.entries and t.error is None and len(t.rejected) == 1  # the entry alone
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="corrupt JSON"):
        assert gemm.read_table(bad, SM90).error
    absent = gemm.read_table(tmp_path / "absent.json", SM90)
    assert not absent.found and absent.error is None and not absent.entries


def test_malformed_or_invalid_entries_fall_back(tmp_path):
    cub = gemm.GemmPlan("cublas")
    entries = [E(cub, m, 64, 64) for m in (1, 2, 4, 8)]
    edit = {
        gemm.table_key("fp16", 64, 64, 1): {"impl": "flat", "block_n": 48, "block_k": 128, "num_warps": 4,
                                           "num_stages": 4, "l2_prefetch": 0},  # parses, invalid layout
        gemm.table_key("fp16", 64, 64, 2): {"impl": "warp-drive"},
        gemm.table_key("fp16", 64, 64, 4): {"impl": "flat"},  # missing fields
        gemm.table_key("fp16", 64, 64, 8): {"impl": "tma", "num_warps": 8, "ksteps": 8, "num_stages": 2,
                                           "x_ring": 0, "groups": 1, "w8": 1},  # FP8 plan, 16-bit bucket
    }
    with pytest.warns(tables.TableWarning, match="3 entries") as w:
        t = gemm.GemmTable(gemm.read_table(_fake_table(tmp_path, entries, edit), SM90).entries)
    assert "disagree on the weight format" in str(w[0].message)
    assert list(t.entries) == [gemm.table_key("fp16", 64, 64, 1)]
    for m in (1, 2, 3, 8):
        assert gemm.choose(m, 64, 64, SM90, "fp16", table=t).source == "heuristic"


# ---- the table layers (fdpp.tables' files, directories, lock and warning) ----------------------
GEMV1 = gemm.GemmPlan("gemv", gemm.GemvConfig("fp16", 4, 2, 4, 1), None)
FLAT8 = gemm.GemmPlan("flat", gemm.FlatGemmConfig("fp16", 32, 256, 4, 4, 1), 264)


@pytest.fixture
def layers(tmp_path, monkeypatch):
    """An empty shipped dir and user dir, no memoised tables."""
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    shipped.mkdir()
    monkeypatch.setattr(tables, "shipped_dir", lambda: shipped)
    monkeypatch.setenv(tables.ENV_DIR, str(user))
    tables.clear_cache()
    yield shipped / gemm.table_filename(SM90.name), user / gemm.table_filename(SM90.name)
    tables.clear_cache()


def test_gemm_uses_the_shared_table_layer():
    assert not hasattr(gemm, "shipped_dir") and not hasattr(gemm, "default_table_path")
    assert gemm.table_filename("NVIDIA H200") == "NVIDIA_H200_gemm.json"
    assert tables.table_filename("NVIDIA H200", "_gemm") == gemm.table_filename("NVIDIA H200")
    assert gemm.table_paths(SM90.name)[0] == tables.shipped_dir() / "NVIDIA_H200_gemm.json"
    assert gemm.GEMM_OP.filename("NVIDIA H200") == "NVIDIA_H200_gemm.json"
    assert not hasattr(gemm, "ENV_TABLE")  # one env var for every op's user tables: $FDPP_TUNING_DIR
    assert gemm.forced_plan(GEMV1).__class__ is dispatch.forced_plan(GEMV1).__class__


def test_user_table_overrides_shipped(layers, monkeypatch, tmp_path):
    shipped, user = layers
    assert gemm.table_paths(SM90.name) == [shipped, user]
    key = gemm.table_key
    gemm.write_table(shipped, SM90, [E(GEMV1, 1), E(FLAT8, 8)])
    gemm.write_table(user, SM90, [E(gemm.GemmPlan("cublas"), 1)])
    assert user.is_file() and gemm.read_table(shipped, SM90).entries.keys() == {
        key("fp16", 4096, 4096, 1), key("fp16", 4096, 4096, 8)}  # the user write left shipped alone
    assert gemm.choose(1, 4096, 4096, SM90, "fp16").impl == "cublas"  # user entry
    p8 = gemm.choose(8, 4096, 4096, SM90, "fp16")
    assert p8.impl == "flat" and p8.source == "table" and p8.config.block_k == 256  # shipped entry
    assert [t.path for t in gemm.table_for(SM90).layers] == [shipped, user]
    # another user dir (no memo to clear: the dir is in the key)
    other = tmp_path / "other"
    tma = gemm.GemmPlan("tma", gemm.FlatTmaConfig("fp16", 8, 4, 1, 2, 1), 128)
    gemm.write_table(other / gemm.table_filename(SM90.name), SM90, [E(tma, 2)])
    monkeypatch.setenv(tables.ENV_DIR, str(other))
    assert gemm.choose(1, 4096, 4096, SM90, "fp16").impl == "gemv"  # shipped's exact bucket
    assert gemm.choose(2, 4096, 4096, SM90, "fp16").impl == "tma"  # other's
    monkeypatch.setenv(tables.ENV_DIR, str(user.parent))
    assert gemm.choose(1, 4096, 4096, SM90, "fp16").impl == "cublas"
    assert "runs: cublas" in gemm.explain(1, 4096, 4096, device=SM90)
    # the user dir is the shipped dir: one layer
    monkeypatch.setenv(tables.ENV_DIR, str(shipped.parent))
    assert gemm.table_paths(SM90.name) == [shipped]


def test_write_merges_atomically_under_the_lock(tmp_path):
    path = tmp_path / gemm.table_filename(SM90.name)
    k1, k8, k64 = (gemm.table_key("fp16", 4096, 4096, m) for m in (1, 8, 64))
    cub = gemm.GemmPlan("cublas")
    gemm.write_table(path, SM90, [E(GEMV1, 1), E(FLAT8, 8)])
    gemm.write_table(path, SM90, [E(cub, 8), E(cub, 64)])
    t = gemm.read_table(path, SM90)
    assert t.entries.keys() == {k1, k8, k64} and t.entries[k8].plan.impl == "cublas"  # k1 kept, k8 replaced
    assert t.entries[k1] == E(GEMV1, 1) and t.entries[k1].plan_for("fp16", 1) == GEMV1
    assert sorted(f.name for f in tmp_path.iterdir()) == [f".{path.name}.lock", path.name]  # no temp left
    gemm.write_table(path, SM90, [E(cub, 64)], merge=False)
    assert gemm.read_table(path, SM90).entries.keys() == {k64}


def _edit(old: str, new: str):
    return lambda p: p.write_text(p.read_text().replace(old, new))


@pytest.mark.parametrize("damage, match, whole", [
    (lambda p: p.write_text("{not json"), "corrupt JSON", True),
    (lambda p: p.write_bytes(b"\xff\xfe"), "unreadable", True),
    (_edit(gemm.current_source_hash(), "0" * 16), "flat_gemm.cu changed", True),  # every entry (the file's)
    (_edit('"impl": "cublas"', '"impl": "warp-drive"'), "1 entry", False),  # that entry alone
])
def test_damaged_user_table_warns_and_falls_back(layers, damage, match, whole):
    shipped, user = layers
    gemm.write_table(shipped, SM90, [E(GEMV1, 1)])
    gemm.write_table(user, SM90, [E(gemm.GemmPlan("cublas"), 1), E(FLAT8, 8)])
    damage(user)
    with pytest.warns(tables.TableWarning, match=match):
        p1 = gemm.choose(1, 4096, 4096, SM90, "fp16")
    assert p1.impl == "gemv" and p1.source == "table"  # the shipped entry serves
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gemm.choose(1, 4096, 4096, SM90, "fp16")  # warned once per load, not per call
    shipped.write_text("{not json")  # no shipped entry either: the heuristic, or the user's m8 entry
    tables.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tables.TableWarning)
        p1 = gemm.choose(1, 4096, 4096, SM90, "fp16")
    assert p1 == (gemm.heuristic_plan(1, 4096, 4096, "fp16", SM90) if whole else
                  E(FLAT8, 8).plan_for("fp16", 1))


def test_forced_plan_adapts_to_m_and_dtype():
    plan = gemm.GemmPlan("flat", gemm.FlatGemmConfig("fp16", 128, 128, 4, 3, 1), 7)
    with gemm.forced_plan(plan):
        p = gemm.choose(20, 100, 64, SM90, "bf16")
    assert p.source == "forced" and p.config.m_tiles == 4 and p.config.dtype == "bf16" and p.grid == 7
    with gemm.forced_plan(gemm.GemmPlan("gemv", gemm.GemvConfig("fp16", 4, 2, 2, 1))):
        with pytest.raises(ValueError, match="cannot run M=5"):
            gemm.choose(5, 100, 64, SM90, "fp16")


# ---- validation ------------------------------------------------------------------------------------
def _arrays(rng, m=3, n=5, k=16, dt=np.float16):
    return (rng.standard_normal((m, k)).astype(dt), rng.standard_normal((n, k)).astype(dt),
            rng.standard_normal(n).astype(dt))


def _quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fn(*a, **kw)


def _read_only(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@pytest.mark.parametrize(
    "mutate, exc, words",
    [
        (lambda x, w, b: (x[0], w, {}), ValueError, "x must have shape"),
        (lambda x, w, b: (x, w[0], {}), ValueError, "w must have shape"),
        (lambda x, w, b: (x, w[:, :8], {}), ValueError, "columns"),
        (lambda x, w, b: (x[:, :12], w[:, :12], {}), ValueError, "multiple of 8"),
        (lambda x, w, b: (np.zeros((65, 16), np.float16), w, {}), ValueError, "1..64 rows"),
        (lambda x, w, b: (x[:0], w, {}), ValueError, "1..64 rows"),
        (lambda x, w, b: (x, w[:0], {}), ValueError, "N >= 1"),
        (lambda x, w, b: (x.astype(np.float32), w.astype(np.float32), {}), TypeError, "unsupported"),
        (lambda x, w, b: (x.astype(np.float64), w, {}), TypeError, "unsupported"),
        (lambda x, w, b: (x, w.astype(np.float32), {}), TypeError, "w dtype"),
        (lambda x, w, b: (x, w, {"bias": b.astype(np.float32)}), TypeError, "bias dtype"),
        (lambda x, w, b: (x, w, {"bias": b[:4]}), ValueError, "bias must have shape"),
        (lambda x, w, b: (x, w, {"out": np.empty((3, 4), np.float16)}), ValueError, "out must have shape"),
        (lambda x, w, b: (x, w, {"out": np.empty((5, 3), np.float16).T}), ValueError, "C-contiguous"),
        (lambda x, w, b: (x, w, {"out": np.empty((3, 5), np.float32)}), TypeError, "out dtype"),
        (lambda x, w, b: (x, w, {"out": _read_only(np.empty((3, 5), np.float16))}), ValueError,
         "out must be a writable array"),
        (lambda x, w, b: (x.tolist(), w, {}), TypeError, "x must be"),
        (lambda x, w, b: (x, w.tolist(), {}), TypeError, "w must be the same array type"),
        (lambda x, w, b: (x, w, {"bias": b.tolist()}), TypeError, "bias must be the same array type"),
    ],
)
def test_bad_arguments(rng, mutate, exc, words):
    x, w, kw = mutate(*_arrays(rng))
    with pytest.raises(exc, match=words):
        _quiet(fdpp.gemm.flat_gemm, x, w, **kw)


def test_out_must_not_overlap(rng):
    buf = np.zeros((3, 16), np.float16)
    x = buf
    w = rng.standard_normal((16, 16)).astype(np.float16)
    with pytest.raises(ValueError, match="overlap x"):
        _quiet(gemm.flat_gemm, x, w, out=buf[:, :16])


# ---- NumPy path (the GPU when there is one, else the float32 fallback) -------------------------------
def _ref64(x, w, b=None):
    y = x.astype(np.float64) @ w.astype(np.float64).T
    return y if b is None else y + b.astype(np.float64)


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("m, n, k", [(1, 77, 136), (3, 5, 8), (17, 130, 72), (64, 33, 264)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_numpy_path_vs_float64(rng, dt, m, n, k, with_bias):
    npdt = DTYPES[dt].np_dtype
    x = rng.standard_normal((m, k)).astype(npdt)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(npdt)
    b = rng.standard_normal(n).astype(npdt) if with_bias else None
    y = _quiet(gemm.flat_gemm, x, w, bias=b)
    assert isinstance(y, np.ndarray) and y.dtype == npdt and y.shape == (m, n)
    assert_close(y, _ref64(x, w, b), dt)
    out = np.full((m, n), np.nan, dtype=npdt)
    assert _quiet(gemm.flat_gemm, x, w, bias=b, out=out) is out
    assert_close(out, _ref64(x, w, b), dt)


def test_fallback_warns_once(rng, monkeypatch):
    if fdpp.gpu_available():
        pytest.skip("a GPU is present: the NumPy path runs on it")
    x, w, _ = _arrays(rng)
    gemm._warn_fallback.cache_clear()
    with pytest.warns(RuntimeWarning, match="float32 on the CPU") as got:
        gemm.flat_gemm(x, w)
    assert got[0].filename == __file__  # the user's line, not one inside fdpp
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gemm.flat_gemm(x, w)  # no second warning


def test_exported():
    assert fdpp.flat_gemm is gemm.flat_gemm


def test_summarize_committed_csv(tmp_path, capsys):
    """The bench summary of a committed H200 CSV, recomputed here with pandas."""
    import pandas as pd

    from fdpp import bench_gemm

    csv = os.path.join(os.path.dirname(__file__), "..", "results", "gemm_llama3-8b_h200.csv")
    df = pd.read_csv(csv)
    f = df[df.impl == "fdpp"].set_index(["layer", "M"])
    c = df[df.impl == "cublas"].set_index(["layer", "M"])
    assert len(f) == len(c) == 20
    ceiling = (c.time_us / f.floor_us).median()
    same = f.speedup[f.plan == c.plan]
    assert bench_gemm.main(["--summarize", csv]) == 0
    text = capsys.readouterr().out
    assert f"median speedup over cuBLAS: {f.speedup.median():.3f}" in text
    assert f"median ceiling (cuBLAS / floor): {ceiling:.3f}" in text
    assert f"at {len(same)} points; speedup there {same.min():.3f}..{same.max():.3f}" in text
    assert len(text.splitlines()) == 1 + 20 + 3
    bad = tmp_path / "other.csv"
    bad.write_text("a,b\n1,2\n")
    assert bench_gemm.main(["--summarize", str(bad)]) == 1
    assert "not a CSV written by" in capsys.readouterr().err
    cut = tmp_path / "cut.csv"
    lines = open(csv).read().splitlines()
    cut.write_text("\n".join([lines[0], lines[1].replace(lines[1].split(",")[7], "", 1)]) + "\n")
    assert bench_gemm.main(["--summarize", str(cut)]) == 1
    assert "line 2: numeric columns must hold numbers" in capsys.readouterr().err


# ---- GPU ---------------------------------------------------------------------------------------------
def _cp():
    import cupy

    return cupy


def _dev(a):
    """Host fp16/bf16 array -> CuPy, through its raw 16-bit words."""
    cp = _cp()
    return cp.asarray(np.ascontiguousarray(a).view(np.uint16)).view(a.dtype)


def _host(a, npdt):
    return _cp().asnumpy(a.view(_cp().uint16)).view(npdt)


def _poisoned(m, n, npdt):
    cp = _cp()
    return cp.full((m, n), 0xFFFF, dtype=cp.uint16).view(npdt)


_W_CACHE: dict = {}


def _weights(dt, n, k):
    key = (dt, n, k)
    if key not in _W_CACHE:
        _W_CACHE.clear()
        r = np.random.default_rng(n * 7919 + k)
        npdt = DTYPES[dt].np_dtype
        w = (r.standard_normal((n, k)) / np.sqrt(k)).astype(npdt)
        b = r.standard_normal(n).astype(npdt)
        _W_CACHE[key] = (w, b, _dev(w), _dev(b), w.astype(np.float64).T.copy())
    return _W_CACHE[key][:4]


def _ref_cached(x, dt, n, k, b=None):
    w64t = _W_CACHE[(dt, n, k)][4]
    y = x.astype(np.float64) @ w64t
    return y if b is None else y + b.astype(np.float64)


def _run_check(dt, m, n, k, rng, with_bias=True, plan=None):
    npdt = DTYPES[dt].np_dtype
    w, b, wd, bd = _weights(dt, n, k)
    x = rng.standard_normal((m, k)).astype(npdt)
    out = _poisoned(m, n, npdt)
    if plan is None:
        y = gemm.flat_gemm(_dev(x), wd, bias=bd if with_bias else None, out=out)
    else:
        with gemm.forced_plan(plan):
            y = gemm.flat_gemm(_dev(x), wd, bias=bd if with_bias else None, out=out)
    assert y is out
    got = _host(y, npdt)
    assert_close(got, _ref_cached(x, dt, n, k, b if with_bias else None), dt)
    return got


GPU_MS = (1, 2, 3, 4, 8, 16, 17, 33, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("n", [1, 77, 4096 + 24])
@pytest.mark.parametrize("k", [8, 136, 4096])
def test_gpu_dispatch_vs_float64(rng, dt, n, k):
    for m in GPU_MS:
        _run_check(dt, m, n, k, rng)


def _forced_plans():
    """(plan, Ms): every kernel path and warp layout, Ms chosen to reach each m_tiles / m_max once
    without compiling every combination on the GPU machine."""
    F, G, P, R = gemm.FlatGemmConfig, gemm.GemvConfig, gemm.GemmPlan, gemm.FlatTmaConfig
    return [
        (P("tma", R("fp16", 4, 8, 1, 2)), (1, 9)),               # bulk copies, 4 warps over K
        (P("tma", R("fp16", 8, 4, 1, 3)), (2, 16)),              # 8 warps, 3 stages
        (P("tma", R("fp16", 8, 4, 1, 2)), (17, 32)),             # m_tiles 4
        (P("tma", R("fp16", 8, 2, 1, 2)), (33, 64)),             # m_tiles 8
        (P("tma", R("fp16", 4, 4, 1, 4), 7), (1, 16)),           # tiles split at odd places
        (P("tma", R("fp16", 2, 16, 1, 2), 1), (5,)),             # one CTA does everything
        (P("tma", R("fp16", 4, 4, 1, 2, 1)), (1, 9)),            # x bulk-copied into the ring
        (P("tma", R("fp16", 8, 4, 1, 2, 1), 5), (17, 32)),       # ... m_tiles 4, split tiles
        (P("tma", R("fp16", 4, 4, 1, 2, 1)), (33, 64)),          # ... m_tiles 8
        (P("tma", R("fp16", 8, 4, 1, 2, 0, 2)), (1, 16)),        # two row groups per tile
        (P("tma", R("fp16", 4, 8, 1, 2, 1, 2), 9), (3, 12)),     # ... x in the ring, split tiles
        (P("tma", R("fp16", 8, 4, 1, 2, 0, 3)), (1, 9)),         # three row groups (48-row tiles)
        (P("tma", R("fp16", 8, 4, 1, 2, 0, 3), 7), (3,)),        # ... split at odd places
        (P("flat", F("fp16", 32, 256, 4, 4, 1)), (1, 17)),         # two warps per group (K slices)
        (P("flat", F("fp16", 128, 128, 4, 3, 1)), (1, 17)),        # two groups per warp
        (P("flat", F("fp16", 64, 64, 4, 6, 1)), (3,)),             # deep pipeline, short stages
        (P("flat", F("fp16", 64, 128, 8, 4, 1)), (3,)),            # 8 warps, two per group
        (P("flat", F("fp16", 64, 128, 4, 4, 1), 1), (1, 9)),       # one CTA streams everything
        (P("flat", F("fp16", 64, 128, 4, 4, 1), 7), (1, 9)),       # tiles split at odd places
        (P("flat", F("fp16", 64, 128, 4, 4, 1), 100000), (2,)),    # clamped to the iterations
        (P("flat", F("fp16", 64, 256, 4, 3, 1, 256)), (2, 9)),   # L2 prefetch hint
        (P("gemv", G("fp16", 4, 2, 2, 1)), (1, 2, 3, 4)),
        (P("gemv", G("fp16", 4, 2, 4, 1, 256)), (1, 3)),           # m_max 1 and 4
        (P("gemv", G("fp16", 8, 2, 2, 1), 5), (1,)),
        (P("gemv", G("fp16", 8, 2, 2, 1), 1), (1,)),
        (P("cublas"), (1, 17)),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("plan_ms", _forced_plans(), ids=lambda p: p[0].describe())
@pytest.mark.parametrize("dt", DTS)
def test_gpu_forced_paths(rng, plan_ms, dt):
    plan, ms = plan_ms
    for n, k in ((77, 136), (4096 + 24, 4096), (1, 8)):
        for m in ms:
            _run_check(dt, m, n, k, rng, with_bias=(m % 2 == 1), plan=plan)


@pytest.mark.gpu
def test_gpu_split_is_deterministic(rng):
    plan = gemm.GemmPlan("flat", gemm.FlatGemmConfig("fp16", 64, 128, 4, 4, 1), 333)
    a = _run_check("fp16", 5, 4096 + 24, 4096, rng, plan=plan)
    cp = _cp()
    w, b, wd, bd = _weights("fp16", 4096 + 24, 4096)
    x = cp.asarray(rng.standard_normal((5, 4096)).astype(np.float16))
    with gemm.forced_plan(plan):
        y1 = _host(gemm.flat_gemm(x, wd, bias=bd), np.float16)
        y2 = _host(gemm.flat_gemm(x, wd, bias=bd), np.float16)
    assert np.array_equal(y1.view(np.uint16), y2.view(np.uint16))
    assert a.shape == y1.shape


@pytest.mark.gpu
def test_gpu_numpy_in_numpy_out(rng):
    x, w, b = _arrays(rng, 3, 70, 64)
    y = gemm.flat_gemm(x, w, bias=b)
    assert isinstance(y, np.ndarray)
    assert_close(y, _ref64(x, w, b), "fp16")


@pytest.mark.gpu
@pytest.mark.parametrize("dt", DTS)
def test_gpu_torch_tensors(rng, dt):
    torch = pytest.importorskip("torch")
    tdt = torch.float16 if dt == "fp16" else torch.bfloat16
    x = torch.randn(5, 264, device="cuda").to(tdt)
    w = (torch.randn(300, 264, device="cuda") / 16).to(tdt)
    b = torch.randn(300, device="cuda").to(tdt)
    ref = x.double() @ w.double().T + b.double()
    y = gemm.flat_gemm(x, w, bias=b)
    assert y.dtype == tdt and y.shape == (5, 300)
    assert_close(y.double().cpu().numpy(), ref.cpu().numpy(), dt)
    out = torch.full((5, 300), float("nan"), device="cuda", dtype=tdt)
    assert gemm.flat_gemm(x, w, bias=b, out=out) is out
    assert_close(out.double().cpu().numpy(), ref.cpu().numpy(), dt)


@pytest.mark.gpu
def test_gpu_device_validation():
    cp = _cp()
    w = cp.zeros((16, 64), cp.float16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gemm.flat_gemm(cp.zeros((2, 72), cp.float16)[:, 4:68], w)
    with pytest.raises(ValueError, match="contiguous along K"):
        gemm.flat_gemm(cp.zeros((64, 2), cp.float16).T, w)
    with pytest.raises(TypeError, match="same array type"):
        gemm.flat_gemm(cp.zeros((2, 64), cp.float16), np.zeros((16, 64), np.float16))


@pytest.mark.gpu
def test_gpu_graph_capture(rng):
    cp = _cp()
    w, b, wd, bd = _weights("fp16", 77, 136)
    x = rng.standard_normal((3, 136)).astype(np.float16)
    xd = _dev(x)
    out = cp.empty((3, 77), cp.float16)
    s = cp.cuda.Stream(non_blocking=True)
    s.wait_event(cp.cuda.get_current_stream().record())  # the work queued before (inputs) first
    with s:
        gemm.flat_gemm(xd, wd, bias=bd, out=out)  # warm-up: compile, workspace
        s.begin_capture()
        gemm.flat_gemm(xd, wd, bias=bd, out=out)
        g = s.end_capture()
        out.view(cp.uint16).fill(0xFFFF)
        g.launch(s)
        s.synchronize()
    assert_close(_host(out, np.float16), _ref64(x, w, b), "fp16")


@pytest.mark.gpu
def test_gpu_stream_k_first_called_inside_a_torch_capture():
    """A stream-K plan's first call on a stream inside a torch graph capture takes its scratch from
    torch's capture-aware allocator (zeroed by a captured memset) and registers nothing: an eager
    call on that stream before the first replay gets real, zeroed tickets (stale tickets would
    leave tiles unwritten), and the replay is right too. Fresh pool memory is poisoned first."""
    torch = pytest.importorskip("torch")
    from fdpp import workspace

    cp = _cp()
    n = k = 2048
    x = torch.randn(2, k, device="cuda").half()
    w = (torch.randn(n, k, device="cuda") / 32).half()
    ref = (x.double() @ w.double().T).cpu().numpy()
    cfg = gemm.FlatTmaConfig("fp16", 4, 8, 1, 2, 0)
    tiles, _, total = gemm.iterations(cfg, n, k)
    plan = gemm.GemmPlan("tma", cfg, max(1, total // 3))  # fewer CTAs than iterations: stream-K fix-ups
    assert plan.grid < total and tiles > 1
    with gemm.forced_plan(plan):
        y0 = gemm.flat_gemm(x, w)  # compile and record on the default stream
        torch.cuda.synchronize()
        assert_close(y0.double().cpu().numpy(), ref, "fp16")
        for _ in range(4):  # pool blocks of the tickets' size, full of ones, handed back to CuPy's pool
            junk = cp.full(workspace.TICKETS_MIN * 4, 0x5A, dtype=cp.uint8)
            del junk
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        out = torch.full((2, n), float("nan"), device="cuda", dtype=torch.float16)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            gemm.flat_gemm(x, w, out=out)
        assert not workspace.has_tickets(torch.cuda.current_device(), s.cuda_stream)  # nothing registered
        with torch.cuda.stream(s):
            y1 = gemm.flat_gemm(x, w)  # eager, on the capture stream, before any replay
        torch.cuda.synchronize()
        assert_close(y1.double().cpu().numpy(), ref, "fp16")
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert_close(out.double().cpu().numpy(), ref, "fp16")


def test_convert_gemm_table_script(tmp_path, capsys):
    """scripts/convert_gemm_table.py: an old-format table (one source_hash, hand-typed keys) becomes a
    table of the shared format with the same plans; a missing file is an argparse error, not a traceback."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_gemm_table", ROOT / "scripts" / "convert_gemm_table.py")
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    old = {"kind": "flat_gemm", "device": "NVIDIA H100 80GB HBM3", "source_hash": "0123456789abcdef",
           "entries": {"fp16.n4096.k4096.m1": {"impl": "tma", "num_warps": 8, "ksteps": 4, "num_stages": 2,
                                                "x_ring": 1, "groups": 2, "grid": 128, "time_us": 11.2},
                       "fp16.n6144.k4096.m2": {"impl": "cublas", "time_us": 16.3}, "junk": {"impl": "tma"}}}
    src, dst = tmp_path / "old.json", tmp_path / "new.json"
    src.write_text(json.dumps(old))
    assert conv.main([str(src), str(dst)]) == 0
    new = json.loads(dst.read_text())
    assert new["op"] == "flat_gemm" and new["device"]["name"] == "NVIDIA H100 80GB HBM3" and len(new["entries"]) == 2
    e = new["entries"]["fp16.n4096.k4096.m1"]
    assert e["plan"]["impl"] == "tma" and e["plan"]["groups"] == 2 and e["sources"] == {"flat_gemm.cu": "0123456789abcdef"}
    assert "skipped malformed key 'junk'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        conv.main([str(tmp_path / "missing.json")])
    assert exc.value.code == 2 and "cannot read" in capsys.readouterr().err


def test_explain_without_a_gpu_describes_the_h200(monkeypatch):
    """fdpp.gemm.explain(m, n, k) without a GPU (or CuPy) asked the registry for the device and failed;
    it falls back to the H200's limits as fdpp.explain does."""
    from fdpp import api

    monkeypatch.setattr(api, "gpu_available", lambda: False)
    text = gemm.explain(1, 4096, 4096)
    assert "on NVIDIA H200" in text and "bucket: fp16.n4096.k4096.m1" in text
