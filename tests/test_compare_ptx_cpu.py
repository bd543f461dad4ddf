"""scripts/compare_ptx.py --restamp: entries whose kernels the comparison did not list get the
current source hashes; entries with a listed kernel stay stale (the dispatcher keeps ignoring
them)."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from fdpp import registry, tables
from fdpp.tables import Entry, shipped_dir

ROOT = Path(__file__).resolve().parent.parent


def _script():
    pytest.importorskip("cuda.bindings.nvrtc", reason="compare_ptx imports the NVRTC bindings")
    spec = importlib.util.spec_from_file_location("compare_ptx", ROOT / "scripts" / "compare_ptx.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_restamp_keeps_changed_entries_stale(tmp_path):
    table = tmp_path / "NVIDIA_H200.json"
    shutil.copy(shipped_dir() / "NVIDIA_H200.json", table)
    raw = json.loads(table.read_text())
    for d in raw["entries"].values():  # every entry stale, as after a kernel edit
        d["sources"] = {k: "0" * 16 for k in d["sources"]}
    raw["kernel_hashes"] = {k: "0" * 16 for k in raw["kernel_hashes"]}
    entries = raw.pop("entries")
    table.write_text(tables.format_table(raw, entries))
    keys = sorted(entries)
    changed_entry = next(k for k in keys if ".p16." in k)
    changed = Entry.from_json(entries[changed_entry], str(table)).plan().kernels[0].key
    kept, stale_count = _script().restamp(table, {changed})
    out = json.loads(table.read_text())
    assert set(out["entries"]) == set(keys)
    hashes = {name: registry.source_hash(name) for name in ("decode_split.cu", "decode_combine.cu")}
    stale = [k for k, d in out["entries"].items() if any(v != hashes[n] for n, v in d["sources"].items())]
    uses = [k for k in keys if any(x.key == changed for x in Entry.from_json(entries[k], "t").plan().kernels)]
    assert changed_entry in stale and sorted(stale) == sorted(uses)
    assert (kept, stale_count) == (len(keys) - len(stale), len(stale)) and kept > 0
    assert out["kernel_hashes"] == {n: hashes[n] for n in out["kernel_hashes"]}


def test_restamp_of_the_gemm_table_is_per_entry(tmp_path):
    from fdpp import gemm
    from fdpp.configs import SM90

    table = tmp_path / "NVIDIA_H200_gemm.json"
    table.write_text((shipped_dir() / table.name).read_text().replace(gemm.current_source_hash(), "0" * 16))
    entries = gemm.read_table(table, SM90)
    assert not entries.entries and len(entries.rejected) == 40  # every entry stale
    mod = _script()
    parsed = {k: gemm.GEMM_OP.parse(d, "t") for k, d in json.loads(table.read_text())["entries"].items()}
    one = next(e for e in parsed.values() if e.plan.config is not None)
    uses = {k for k, e in parsed.items() if e.plan.config is not None and e.plan.config.key == one.plan.config.key}
    cublas = {k for k, e in parsed.items() if e.plan.config is None}
    kept, stale = mod.restamp(table, {one.plan.config.key}, gemm.GEMM_OP)
    assert cublas and (kept, stale) == (40 - len(uses) - len(cublas), len(uses) + len(cublas))
    with pytest.warns(tables.TableWarning):
        t = gemm.read_table(table, SM90)
    assert set(t.entries) == set(parsed) - uses - cublas  # the rest serve again
    assert mod.restamp(table, set(), gemm.GEMM_OP) == (40, 0)  # nothing changed: every entry, cuBLAS too
    assert len(gemm.read_table(table, SM90).entries) == 40


def test_ptx_reads_the_headers_of_its_kernel_dir(tmp_path):
    """Each side compiles against its own headers: a header edited only in the copy changes the PTX
    (a program named by a relative path would include the working tree's headers on both sides)."""
    from fdpp.configs import DecodeConfig

    mod = _script()
    for f in registry.kernel_dir().iterdir():
        if f.is_file():
            (tmp_path / f.name).write_text(f.read_text())
    cfg = DecodeConfig("fp16", 128, 4, 4, 2, 1, mma=True, cluster=4)
    before = mod.normalise(mod.ptx(tmp_path, cfg, "sm_90"))
    merge = tmp_path / "merge.cuh"
    merge.write_text(merge.read_text().replace("const float sc = fast_exp2(ms[r] - mref);",
                                               "const float sc = fast_exp2(ms[r] - mref) * 0.5f;"))
    assert mod.normalise(mod.ptx(tmp_path, cfg, "sm_90")) != before
    assert mod.normalise(mod.ptx(registry.kernel_dir(), cfg, "sm_90")) == before


def test_sass_mode_sees_through_register_renumbering(tmp_path):
    """--sass: a source edit that renumbers PTX registers but changes no instruction (this session's
    flat_gemm lambda: `auto tail` with a tag type -> `bool tail` with constants) compares equal in
    SASS and unequal in PTX; a real change differs in both."""
    from fdpp import gemm

    mod = _script()
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    sass_count = importlib.import_module("sass_count")
    try:
        sass_count.nvdisasm()
    except SystemExit:
        pytest.skip("needs nvdisasm (the nvidia-cuda-nvdisasm wheel of the test extra)")
    for f in registry.kernel_dir().iterdir():
        if f.is_file():
            (tmp_path / f.name).write_text(f.read_text())
    cfg = next(c for c in gemm.tma_space("fp16", w8=1))
    src = tmp_path / "flat_gemm.cu"
    text = src.read_text()
    old = ("    auto steps = [&](const bool tail) {  // called with a constant: inlined, the predicate folds away\n",
           "        const bool ok = !tail || k0 + kc < K;\n",
           "    if (W8 && k0 + BLOCK_K <= K) steps(false);\n    else steps(true);\n")
    assert all(text.count(o) == 1 for o in old)
    tagged = (text.replace(old[0], "    auto steps = [&](auto tail) {\n      constexpr bool TAIL = decltype(tail)::value;\n")
              .replace(old[1], "        const bool ok = !TAIL || k0 + kc < K;\n")
              .replace(old[2], "    if (W8 && k0 + BLOCK_K <= K) steps(Tag<false>{});\n    else steps(Tag<true>{});\n")
              .replace("// 8 E4M3 codes (byte i", "template <bool B> struct Tag { static constexpr bool value = B; };\n"
                       "// 8 E4M3 codes (byte i", 1))
    src.write_text(tagged)
    try:
        alt = mod.ptx(tmp_path, cfg, "sm_90")
    except RuntimeError:
        pytest.skip("this NVRTC refuses generic lambdas in device code (13.0)")
    here = registry.kernel_dir()
    assert mod.normalise(alt) != mod.normalise(mod.ptx(here, cfg, "sm_90"))
    assert mod.sass(tmp_path, cfg, "sm_90") == mod.sass(here, cfg, "sm_90")
    src.write_text(text.replace(old[2], "    steps(true);\n"))  # the K-tail predicates everywhere: other code
    assert mod.sass(tmp_path, cfg, "sm_90") != mod.sass(here, cfg, "sm_90")
