"""python -m fdpp.bench --page-size on a CPU: argument parsing, the emulator's paged rows, the CSV
schema, the summary and the plots, and the GPU sweep's paged glue driven with NumPy stand-ins."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fdpp import bench, plot, timing
from fdpp.dtypes import DTYPES
from fdpp.reference import gather_pages

sys.path.insert(0, str(Path(__file__).parent))
from test_timing_bench_plot import _check_schema, _numpy_cupy  # noqa: E402


# ---- arguments ------------------------------------------------------------------------------
def test_parse_page_sizes():
    assert bench.parse_page_sizes("1,16, 64,16") == [1, 16, 64]
    assert bench.parse_page_sizes("0") == [0] and bench.parse_page_sizes("256,0") == [0, 256]
    for bad in ("3", "512", "-1", "x", "", "16,24"):
        with pytest.raises(Exception) as e:
            bench.parse_page_sizes(bad)
        assert "page sizes" in str(e.value)


def test_page_size_default_and_errors(capsys):
    top, _ = bench.build_parser()
    assert top.parse_args(["attn"]).page_size == [0]  # contiguous only: existing commands unchanged
    assert top.parse_args(["attn", "--page-size", "1,16,64"]).page_size == [1, 16, 64]
    with pytest.raises(SystemExit) as e:
        bench.main(["attn", "--emulator", "--page-size", "12"])
    assert e.value.code not in (0, None) and "--page-size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["attn", "--help"])
    assert "--page-size" in capsys.readouterr().out


def test_wanted_impls():
    every = list(bench.SELECTABLE)
    assert bench.wanted_impls(every, 0) == ["fdpp", "fdpp-two-launch", "fdpp-nosplit", "fdpp-umax", "fdpp-prefetch", "torch-cudnn", "torch-flash", "flashinfer"]
    assert bench.wanted_impls(every, 16) == ["fdpp-paged", "flashinfer-paged"]
    assert bench.wanted_impls(["fdpp", "floor"], 16) == ["fdpp-paged"]  # fdpp stands for fdpp-paged
    assert bench.wanted_impls(["flashinfer-paged"], 1) == ["flashinfer-paged"]
    assert bench.wanted_impls(["flashinfer-paged"], 0) == []
    assert bench.wanted_impls(["torch-cudnn"], 16) == []


def test_shuffled_table_and_paged_copy():
    rng = np.random.default_rng(0)
    for layout in ("NHD", "HND"):
        k = rng.standard_normal((3, 50, 2, 8)).astype(np.float16)  # N = 50: the last page is partial
        if layout == "HND":
            k = np.ascontiguousarray(k.transpose(0, 2, 1, 3))
        table = bench.shuffled_table(np.random.default_rng(1), 3, 4)
        assert table.dtype == np.int32 and sorted(table.ravel()) == list(range(12))
        assert not np.array_equal(table.ravel(), np.arange(12))
        pool = bench.paged_copy(k, table, 16, layout)
        assert pool.shape == ((12, 16, 2, 8) if layout == "NHD" else (12, 2, 16, 8))
        back = gather_pages(pool, table, np.full(3, 50), layout)
        np.testing.assert_array_equal(back[:, :50] if layout == "NHD" else back[:, :, :50], k)


def test_series_name():
    assert bench.series_name("fdpp-paged", 16) == "fdpp-paged p16"
    assert bench.series_name("flashinfer", 16) == "flashinfer"  # contiguous rows viewed as pages
    assert bench.series_name("fdpp", 0) == "fdpp" and bench.series_name("fdpp-paged", float("nan")) == "fdpp-paged"
    assert plot._style("fdpp-paged p16")["label"] == "fdpp paged, pages of 16"
    assert plot._style("fdpp-paged p16")["marker"] != plot._style("fdpp-paged p64")["marker"]


# ---- the emulator run -----------------------------------------------------------------------
def test_emulator_paged_rows(tmp_path, capsys):
    out = tmp_path / "paged.csv"
    assert bench.main(["--emulator", "--model", "llama3-8b", "--seqlens", "64,200", "--batch", "1,2",
                       "--page-size", "16", "--repeats", "2", "--warmup", "0", "--out", str(out)]) == 0
    df = pd.read_csv(out)
    _check_schema(df)
    assert list(df.columns) == bench.COLUMNS
    assert len(df) == 2 * 2 * 3
    floor = df[df["impl"] == "floor"]
    assert len(floor) == 4 and (floor["page_size"] == 0).all()  # one floor per (batch, seqlen)
    paged = df[df["impl"] != "floor"]
    assert set(paged["impl"]) == {"fdpp-paged-emulator", "reference-paged"} and (paged["page_size"] == 16).all()
    assert (paged["max_rel_err"] < DTYPES["fp16"].rtol).all()
    assert (df.loc[df["impl"] == "reference-paged", "max_rel_err"] < 1e-12).all()  # the pages hold the cache
    assert (paged["time_us"] > 0).all() and paged["pct_floor"].notna().all()
    meta = json.loads(out.with_name(out.name + ".meta.json").read_text())
    assert meta["page_sizes"] == [16] and meta["columns"] == bench.COLUMNS
    assert "fdpp-paged-emulator p16" in capsys.readouterr().out  # the summary: a series per page size
    pngs = tmp_path / "png"
    assert plot.main([str(out), "--out-dir", str(pngs)]) == 0
    assert len(list(pngs.glob("*.png"))) == 2 * 3  # latency, speedup (over reference-paged), floor


def test_emulator_contiguous_and_paged_hnd_bf16(tmp_path):
    out = tmp_path / "x.csv"
    assert bench.main(["attn", "--emulator", "--heads", "6/2", "--head-dim", "64", "--dtype", "bf16",
                       "--kv-layout", "HND", "--seqlens", "97", "--page-size", "0,1,64", "--repeats", "1",
                       "--warmup", "0", "--out", str(out)]) == 0
    df = pd.read_csv(out)
    _check_schema(df)
    assert sorted(zip(df["impl"], df["page_size"], strict=True)) == sorted([
        ("floor", 0), ("fdpp-emulator", 0), ("reference", 0), ("fdpp-paged-emulator", 1), ("reference-paged", 1),
        ("fdpp-paged-emulator", 64), ("reference-paged", 64)])
    emu = df[df["impl"].str.startswith("fdpp")]
    assert (emu["max_rel_err"] < DTYPES["bf16"].rtol).all()


def test_emulator_default_has_no_paged_rows(tmp_path):
    out = tmp_path / "c.csv"
    assert bench.main(["--emulator", "--seqlens", "64", "--repeats", "1", "--warmup", "0", "--out", str(out)]) == 0
    df = pd.read_csv(out)
    assert set(df["impl"]) == {"floor", "fdpp-emulator", "reference"} and (df["page_size"] == 0).all()


# ---- the GPU sweep's paged glue, with NumPy stand-ins --------------------------------------
def test_gpu_path_paged_glue_with_stand_ins(monkeypatch, tmp_path):
    """run_gpu with --page-size 0,16 on NumPy stand-ins for CuPy, the kernels and the timers: the
    paged sets (pools, shuffled table), the reference gathered through the table, fdpp-paged rows
    and their metadata; torch (so FlashInfer) is absent."""
    import fdpp
    import fdpp.api
    import fdpp.registry
    from fdpp.configs import SM90
    from fdpp.reference import split_kv_emulator

    monkeypatch.setitem(sys.modules, "cupy", _numpy_cupy())
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(fdpp.api, "gpu_available", lambda: True)
    monkeypatch.setattr(fdpp.registry, "device_limits", lambda d=0: SM90)
    monkeypatch.setattr(timing, "l2_bytes", lambda d=None: 1 << 20)
    monkeypatch.setattr(timing, "time_round_robin", lambda impls, **kw: [
        ([f() for f in im[0]], timing.Timing.from_samples([2.0, 2.5, 3.0]))[1] for im in impls])
    monkeypatch.setattr(timing, "stream_read_gbps", lambda nbytes=0, **kw: 4500.0)
    floors = []
    monkeypatch.setattr(timing, "time_stream_read",
                        lambda nbytes, **kw: floors.append(nbytes) or timing.Timing.from_samples([1.0]))
    monkeypatch.setattr(bench._Sets, "ptr", lambda self, i: 0)
    monkeypatch.setattr(bench, "MAX_SETS", 2)
    tables_seen = []

    def contiguous(q, k, v, *, kv_layout="NHD", out=None, **kw):
        out[...] = split_kv_emulator(q, k, v, kv_layout=kv_layout, chunk=32)[0].astype(q.dtype)
        return out

    def paged(q, kp, vp, table, lens, *, kv_layout="NHD", out=None, **kw):
        tables_seen.append(np.array(table))
        k, v = gather_pages(kp, table, lens, kv_layout), gather_pages(vp, table, lens, kv_layout)
        out[...] = split_kv_emulator(q, k, v, lens, kv_layout=kv_layout, chunk=32)[0].astype(q.dtype)
        return out

    monkeypatch.setattr(fdpp, "decode_attention", contiguous)
    monkeypatch.setattr(fdpp, "paged_decode_attention", paged)
    out = tmp_path / "gpu.csv"
    assert bench.main(["attn", "--heads", "4/2", "--head-dim", "64", "--seqlens", "64,100", "--batch", "1,3",
                       "--page-size", "0,16", "--impls", "fdpp,flashinfer,floor", "--repeats", "3",
                       "--out", str(out)]) == 0
    df = pd.read_csv(out)
    _check_schema(df)
    assert sorted(set(zip(df["impl"], df["page_size"], strict=True))) == [
        ("fdpp", 0), ("fdpp-paged", 16), ("floor", 0)]
    assert len(df[df["impl"] == "floor"]) == 4 and len(floors) == 4  # timed once per (batch, seqlen)
    fp = df[df["impl"] == "fdpp-paged"]
    assert len(fp) == 4 and (fp["max_rel_err"] < DTYPES["fp16"].rtol).all()
    assert np.allclose(fp["pct_floor"], 100.0 / 2.5)
    n100 = fp[fp["seqlen"] == 100].iloc[0]  # gbps counts the tokens, not the padded last page
    assert n100["gbps"] == pytest.approx(bench.kv_bytes_of(bench.Shape("x", 4, 2, 64), int(n100["batch"]), 100,
                                                           "fp16") / 2.5 / 1e3)
    # every set and call read through one shuffled table of the point: [B, ceil(N / 16)]
    assert {t.shape for t in tables_seen} == {(1, 4), (1, 7), (3, 4), (3, 7)}
    for t in tables_seen:
        assert sorted(t.ravel()) == list(range(t.size))
    assert any(not np.array_equal(t.ravel(), np.arange(t.size)) for t in tables_seen)
    meta = json.loads(out.with_name(out.name + ".meta.json").read_text())
    assert meta["page_sizes"] == [0, 16]
    keys = {f"B{b}_N{n}{p}" for b in (1, 3) for n in (64, 100) for p in ("", "_P16")}
    assert set(meta["rotation_sets"]) == set(meta["fdpp_plans"]) == keys
    assert "p16" in meta["fdpp_plans"]["B3_N100_P16"]  # the paged kernel variant
    assert set(meta["skipped_impls"]) == {"torch-cudnn", "torch-flash", "flashinfer", "flashinfer-paged"}
    assert meta["flagged"] == [] and meta["failed_impls"] == {}


def test_reference_gathers_pages_through_the_table(monkeypatch):
    """_GpuBench.reference on paged sets equals the reference of the same tokens stored contiguously."""
    import types

    from fdpp.reference import attention_reference

    monkeypatch.setitem(sys.modules, "cupy", _numpy_cupy())
    monkeypatch.setitem(sys.modules, "torch", None)
    import fdpp.registry
    from fdpp.configs import SM90

    monkeypatch.setattr(fdpp.registry, "device_limits", lambda d=0: SM90)
    monkeypatch.setattr(timing, "l2_bytes", lambda d=None: 1 << 20)
    for layout in ("NHD", "HND"):
        args = types.SimpleNamespace(device=0, dtype="fp16", fdpp_arrays="cupy", kv_layout=layout)
        gb = bench._GpuBench(args, bench.Shape("x", 4, 2, 64), bench.run_settings(
            types.SimpleNamespace(quick=True, repeats=None, warmup=None, calls_per_replay=None)))
        data = gb.make_sets(2, 40, 1, page=16)
        assert data.k(0).shape == ((6, 16, 2, 64) if layout == "NHD" else (6, 2, 16, 64))
        k = gather_pages(data.k(0), data.table, data.lens, layout)
        v = gather_pages(data.v(0), data.table, data.lens, layout)
        picks, ref = gb.reference(data, 2)
        want, _ = attention_reference(data.q[0], k, v, data.lens, kv_layout=layout)
        np.testing.assert_allclose(ref, np.stack([want[p] for p in picks]), rtol=1e-6, atol=1e-6)
