"""The GPU probes' source patches still find the text they replace in the shipped kernels (a probe
run on the device machine should not be the first to learn that a kernel edit moved it)."""

import importlib
import sys
import types
from pathlib import Path

import pytest

from fdpp import registry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
try:
    import cupy  # noqa: F401
    _STUB = False
except ImportError:  # the patches are text functions: a stand-in module just for the import
    sys.modules["cupy"] = types.ModuleType("cupy")
    _STUB = True
try:
    probe_pipeline = importlib.import_module("probe_pipeline")
    probe_softmax = importlib.import_module("probe_softmax")
    probe_phases = importlib.import_module("probe_phases")
finally:
    if _STUB:  # never left behind: other tests ask whether CuPy is installed
        del sys.modules["cupy"]


@pytest.mark.parametrize("variant", sorted(v for v, f in probe_pipeline.VARIANTS.items() if f is not None))
def test_pipeline_variant_changes_one_file(variant):
    fn = probe_pipeline.VARIANTS[variant]
    names = [f.name for f in registry.kernel_dir().iterdir() if f.is_file()]
    changed = [n for n in names if fn(n, registry.kernel_source(n)) != registry.kernel_source(n)]
    assert len(changed) == 1, changed


def test_head_order_patches_decode_split_mma_only():
    src = registry.kernel_source("decode_split.cu")
    out = probe_pipeline.VARIANTS["head-order"]("decode_split.cu", src)
    assert out.count(probe_pipeline._SPLIT_ORDER) == src.count(probe_pipeline._SPLIT_ORDER) - 1
    body = out.partition("decode_split_mma(const DecodeParams p) {")[2].partition("\n}\n")[0]
    assert "lin_ % gridDim.y" in body


@pytest.mark.parametrize("variant", sorted(v for v, r in probe_softmax.VARIANTS.items() if r))
def test_softmax_variant_texts_occur_once(variant):
    src = registry.kernel_source("decode_split.cu")
    assert {old: src.count(old) for old in probe_softmax.VARIANTS[variant]} == dict.fromkeys(
        probe_softmax.VARIANTS[variant], 1)


@pytest.mark.parametrize("marks", [True, False])
def test_phase_marks_patch_every_mark_into_the_shipped_kernels(monkeypatch, marks):
    monkeypatch.setattr(probe_phases, "MARKS_ON", marks)
    out = {n: probe_phases.patch(n, registry.kernel_source(n)) for n in ("common.cuh", "decode_split.cu", "merge.cuh")}
    assert ("fdpp_probe_ts" in out["common.cuh"]) is marks and "void probe_mark(int" in out["common.cuh"]
    assert out["merge.cuh"] == registry.kernel_source("merge.cuh")
    for slot in range(probe_phases.MARKS):
        assert f"probe_mark({slot});" in out["decode_split.cu"], slot
    # the entry and wait marks in every tensor-core phase-1 kernel (mma, umax, cluster, cluster umax)
    assert out["decode_split.cu"].count("probe_mark(0);") >= 4 and out["decode_split.cu"].count("probe_mark(1);") >= 4


def test_phase_marks_patch_another_revisions_kernels(tmp_path, monkeypatch):
    """probe_phases --kernels DIR: every file comes from DIR (not only the two use_kernel_dir reads by
    default), and the marks are patched into that text, not into the working tree's."""
    monkeypatch.setattr(registry, "kernel_dir", registry.kernel_dir)  # use_sources repoints it
    monkeypatch.setattr(probe_phases, "MARKS_ON", True)
    for f in registry.kernel_dir().iterdir():
        if f.is_file():
            (tmp_path / f.name).write_text(f.read_text() + f"// other revision: {f.name}\n")
    probe_cluster = importlib.import_module("probe_cluster")
    try:
        out = probe_cluster.use_kernel_dir(tmp_path, names=None, transform=probe_phases.patch)
    finally:
        registry.kernel_source.cache_clear()  # nothing read from the copy outlives the test
    for name in ("decode_split.cu", "merge.cuh", "common.cuh", "decode_combine.cu"):
        assert f"// other revision: {name}" in (out / name).read_text(), name
    assert "probe_mark(5);" in (out / "decode_split.cu").read_text()
    assert "fdpp_probe_ts" in (out / "common.cuh").read_text()


@pytest.mark.parametrize("size", [64, 128, 256])
def test_cp_prefetch_hints_the_kv_copy_only(size):
    """--cp-prefetch: common.cuh's 16-byte cp.async gains .L2::<size>B, and nothing else changes."""
    fn = probe_pipeline.cp_prefetch(size)
    names = [f.name for f in registry.kernel_dir().iterdir() if f.is_file()]
    changed = [n for n in names if fn(n, registry.kernel_source(n)) != registry.kernel_source(n)]
    assert changed == ["common.cuh"]
    src = registry.kernel_source("common.cuh")
    out = fn("common.cuh", src)
    assert out.count(f"cp.async.cg.shared.global.L2::{size}B [%0], [%1], 16, %2;") == 1
    assert out.replace(f".L2::{size}B", "") == src
    with pytest.raises(SystemExit, match="64, 128 or 256"):
        probe_pipeline.cp_prefetch(512)
