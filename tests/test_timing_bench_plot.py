"""CPU tests of fdpp.timing, python -m fdpp.bench and python -m fdpp.plot (no GPU needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fdpp import bench, plot, timing
from fdpp.api import gpu_available
from fdpp.dtypes import DTYPES

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "data" / "bench_fixture.csv"


# ---- timing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes, l2, kw, want", [
    (4 << 20, 60 << 20, {}, 60),                    # 60 x 4 MB = 4 x 60 MB
    (1 << 30, 60 << 20, {}, 1),                     # one set already exceeds 4 x L2
    (1 << 20, 60 << 20, {}, 64),                    # capped at max_sets
    (1 << 20, 60 << 20, {"max_sets": 512}, 240),
    (59 << 20, 60 << 20, {"factor": 1}, 2),
    (60 << 20, 60 << 20, {"factor": 1}, 1),
    (7, 0, {}, 1),                                  # no L2: one set
])
def test_rotation_count(nbytes, l2, kw, want):
    assert timing.rotation_count(nbytes, l2, **kw) == want


def test_rotation_count_covers_factor_l2():
    l2 = 50 * 2**20
    for nbytes in (1 << 16, 3 << 20, 17 << 20, 199 << 20, 1 << 31):
        n = timing.rotation_count(nbytes, l2, max_sets=10**6)
        assert n * nbytes >= 4 * l2 and (n == 1 or (n - 1) * nbytes < 4 * l2)


@pytest.mark.parametrize("args", [(0, 1 << 20), (-5, 1 << 20), (16, 1 << 20, 4, 0)])
def test_rotation_count_rejects(args):
    with pytest.raises(ValueError):
        timing.rotation_count(*args)


def test_timing_from_samples():
    t = timing.Timing.from_samples([3.0, 1.0, 2.0, 100.0, 4.0])
    assert t.median_us == 3.0 and t.p10_us < t.median_us < t.p90_us and len(t.samples) == 5
    one = timing.Timing.from_samples([5.0])
    assert one.median_us == one.p10_us == one.p90_us == 5.0
    with pytest.raises(ValueError):
        timing.Timing.from_samples([])


def test_time_cpu_calls_counts_calls():
    n = [0, 0]

    def mk(i):
        def f():
            n[i] += 1
        return f

    t = timing.time_cpu_calls([mk(0), mk(1)], warmup=2, repeats=3)
    assert n == [5, 5] and len(t.samples) == 3 and t.median_us >= 0


def _fake_cupy(elapsed_ms: float) -> types.ModuleType:
    """Just enough of CuPy's stream/graph/event API to run time_calls and host_call_us on a CPU."""
    log: list[str] = []

    class Graph:
        def upload(self, stream=None):
            log.append("upload")

        def launch(self, stream=None):
            log.append("launch")

    class Stream:
        def __init__(self, null=False, non_blocking=False):
            assert non_blocking
            self.capturing = False

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def begin_capture(self):
            self.capturing = True
            log.append("begin")

        def end_capture(self):
            self.capturing = False
            log.append("end")
            return Graph()

        def synchronize(self):
            pass

    class Event:
        def record(self, stream=None):
            log.append("record")

        def synchronize(self):
            pass

    cuda = types.SimpleNamespace(
        Stream=Stream, Event=Event, get_elapsed_time=lambda a, b: elapsed_ms,
        runtime=types.SimpleNamespace(deviceSynchronize=lambda: None))
    mod = types.ModuleType("cupy")
    mod.cuda = cuda
    mod.log = log
    return mod


@pytest.mark.parametrize("n_sets, cpr, captured", [(3, 20, 20), (30, 20, 30), (1, 1, 1)])
def test_time_calls_graph_logic(monkeypatch, n_sets, cpr, captured):
    fake = _fake_cupy(elapsed_ms=2.0)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    counts = [0] * n_sets

    def mk(i):
        def f():
            counts[i] += 1
        return f

    t = timing.time_calls([mk(i) for i in range(n_sets)], calls_per_replay=cpr, warmup=2, repeats=4)
    # each closure once eagerly, then `captured` calls round-robin inside one capture
    assert sum(counts) == n_sets + captured
    assert max(counts) - min(counts) <= 1 + 1
    assert fake.log.count("begin") == 1 and fake.log.count("launch") == 2 + 4
    assert t.median_us == pytest.approx(2000.0 / captured) and len(t.samples) == 4


def test_time_calls_eager_logic(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(elapsed_ms=1.0))
    count = [0]

    def f():
        count[0] += 1

    t = timing.time_calls([f], calls_per_replay=5, warmup=1, repeats=2, use_graph=False)
    assert count[0] == 1 + (1 + 2) * 5
    assert t.median_us == pytest.approx(200.0)


def test_host_call_us_logic(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(elapsed_ms=1.0))
    count = [0]

    def f():
        count[0] += 1

    us = timing.host_call_us(f, n=100)
    assert count[0] == 150 and us > 0


def test_stream_read_config_names_and_grid():
    cfg = timing.StreamReadConfig(unroll=8, num_warps=8, l2_prefetch=256, ctas_per_sm=4)
    assert cfg.key == "stream_read.u8.w8.c4.p256"
    assert cfg.name_expression() == "fdpp::stream_read<8,8,4,256>"
    assert cfg.source == "stream_read.cu" and cfg.smem_bytes() == 0 and cfg.threads == 256
    assert cfg.grid(1 << 30, 132) == 4 * 132  # large read: CTAs per SM x SMs
    assert cfg.grid(2048, 132) == 1  # one CTA's worth of vectors
    assert cfg.grid(1, 132) == 1
    assert len({c.key for c in timing.STREAM_READ_VARIANTS}) == len(timing.STREAM_READ_VARIANTS)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_stream_read_compiles_without_spills(arch):
    pytest.importorskip("cuda.bindings.nvrtc")
    from fdpp.registry import compile_offline

    reports = compile_offline(timing.STREAM_READ_VARIANTS, arch)
    assert set(reports) == {c.key for c in timing.STREAM_READ_VARIANTS}
    for cfg in timing.STREAM_READ_VARIANTS:
        r = reports[cfg.key]
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, r
        # registers leave room for ctas_per_sm CTAs per SM (64K registers per SM)
        assert r.registers * cfg.threads * cfg.ctas_per_sm <= 65536, r


# ---- bench: arguments -----------------------------------------------------------------------
def test_parse_seqlens():
    assert bench.parse_seqlens("1k..8k") == [1024, 2048, 4096, 8192]
    assert bench.parse_seqlens("4096, 1k,2K") == [1024, 2048, 4096]
    assert bench.parse_seqlens("54,97") == [54, 97]
    assert list(bench.DEFAULT_SEQLENS) == bench.parse_seqlens("1k..256k")


@pytest.mark.parametrize("argv, flag", [
    (["--heads", "32/5"], "--heads"),
    (["--heads", "abc"], "--heads"),
    (["--heads", "0/0"], "--heads"),
    (["--seqlens", "0"], "--seqlens"),
    (["--seqlens", "abc"], "--seqlens"),
    (["--seqlens", "8k..1k"], "--seqlens"),
    (["--seqlens", "1000..4k"], "--seqlens"),  # ran 1000, 2000, 4000: the stated end never came
    (["--model", "gpt-9"], "--model"),
    (["--batch", "0"], "--batch"),
    (["--batch", "x"], "--batch"),
    (["--model", "llama3-8b", "--tp", "3"], "--tp"),
    (["--heads", "32/8", "--tp", "2"], "--tp"),
    (["--heads", "32/8", "--model", "llama3-8b"], "--heads"),
    (["--heads", "32/8", "--head-dim", "100"], "--head-dim"),
    (["--impls", "fdpp,cublas"], "--impls"),
    (["--dtype", "int3"], "--dtype"),
    (["--repeats", "0"], "--repeats"),
    (["--warmup", "-1"], "--warmup"),
    (["--kv-dtype", "fp8_e4m3"], "--kv-dtype"),  # the emulator has no quantised rows
    (["--impls", "fdpp"], "--impls"),  # nor a choice of implementations
    (["--out", "."], "--out"),  # a directory
    (["--out", "/proc/fdpp-no-such-dir/x.csv"], "--out"),  # a folder that cannot be made
])
def test_bad_arguments_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["attn", *argv, "--emulator"])
    assert e.value.code not in (0, None)
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("sub, argv, flag", [
    ("gemm", ["--tp", "3"], "--tp"),
    ("gemm", ["--tp", "0"], "--tp"),
    ("gemm", ["--m", "1,x"], "--m"),  # was a ValueError traceback
    ("gemm", ["--m", "0"], "--m"),
    ("gemm", ["--layers", "qkv,mlp"], "--layers"),
    ("gemm", ["--paths", "fdpp,triton"], "--paths"),
    ("gemm", ["--dtype", "bf16", "--weights", "fp8"], "--weights"),
    ("gemm", ["--repeats", "0"], "--repeats"),
    ("gemm", ["--calls-per-replay", "-2"], "--calls-per-replay"),
    ("gemm", ["--out", "."], "--out"),
    ("gemm", ["--summarize", "results/gemm_llama3-8b_h200.csv", "--tune"], "--summarize"),  # was ignored
    ("gemm", ["--summarize", "results/gemm_llama3-8b_h200.csv", "--out", "/tmp/x.csv"], "--summarize"),
    ("gemm", ["--eager", "--tune"], "--eager"),
    ("gemm", ["--paths", ","], "--paths"),  # was taken: an empty list, nothing to time
    ("gemm", ["--layers", ","], "--layers"),
    ("e2e", ["--tp", "3"], "--tp"),
    ("e2e", ["--warmup", "-1"], "--warmup"),  # was taken, and ran no warm-up
    ("e2e", ["--device", "-1"], "--device"),
    ("e2e", ["--out", "."], "--out"),  # was found only after the whole run, when the CSV was written
    ("e2e", ["--out", "/proc/fdpp-no-such-dir/x.csv"], "--out"),
    ("e2e", ["--kv", "fp16,nosuch"], "--kv"),  # was taken: every fdpp point then failed and the run exited 0
    ("e2e", ["--kv", "bf16"], "--kv"),  # a 16-bit cache other than the model's --dtype (fp16)
    ("e2e", ["--page-size", "3"], "--page-size"),
    ("e2e", ["--page-size", "100000"], "--page-size"),
])
def test_gemm_and_e2e_name_a_bad_flag_before_looking_for_a_gpu(sub, argv, flag, capsys, monkeypatch):
    """On a machine without a GPU these once said only "no GPU", and on one with a GPU some failed late
    (an --out that cannot be written, after the whole run). The GPU probe is made to fail the test."""
    from fdpp import api

    def no_probe():
        raise AssertionError("looked for a GPU before checking the arguments")

    monkeypatch.setattr(api, "gpu_available", no_probe)
    with pytest.raises(SystemExit) as e:
        bench.main([sub, *argv])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_help_lists_flags(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["attn", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--tp", "--heads", "--seqlens", "--batch", "--dtype", "--kv-layout", "--out",
                 "--repeats", "--quick", "--emulator"):
        assert flag in out
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    assert "gemm" in capsys.readouterr().out


def test_tp_shares_heads():
    top, p = bench.build_parser()
    args = top.parse_args(["attn", "--model", "llama3-70b", "--tp", "8"])
    assert bench.resolve_shape(args, p) == bench.Shape("llama3-70b-tp8", 8, 1, 128)
    args = top.parse_args(["attn", "--heads", "28/4", "--head-dim", "64"])
    assert bench.resolve_shape(args, p) == bench.Shape("custom-28x4-d64", 28, 4, 64)


def test_calls_per_replay_for():
    assert bench.calls_per_replay_for(4 << 20, 20) == 20  # a few µs per call: the cap
    assert bench.calls_per_replay_for(8 << 30, 20) == 3  # ms per call: the minimum
    assert 3 <= bench.calls_per_replay_for(1 << 30, 20) <= 20


@pytest.mark.skipif(gpu_available(), reason="a GPU is present: the bench would run")
def test_no_gpu_exits_2():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "fdpp.bench", "--seqlens", "1k"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "no GPU found" in r.stderr and "--emulator" in r.stderr


def test_gemm_hook(monkeypatch, capsys):
    seen = []
    fake = types.ModuleType("fdpp.bench_gemm")
    fake.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "fdpp.bench_gemm", fake)
    assert bench.main(["gemm", "--model", "llama3-8b"]) == 7 and seen == [["--model", "llama3-8b"]]
    monkeypatch.setitem(sys.modules, "fdpp.bench_gemm", None)  # as if the module were absent
    assert bench.main(["gemm"]) == 2
    assert "bench_gemm" in capsys.readouterr().err


# ---- bench: emulator end to end, CSV schema -------------------------------------------------
INT_COLS = ("hq", "hkv", "head_dim", "batch", "seqlen", "page_size")
FLOAT_COLS = ("time_us", "p10_us", "p90_us", "gbps", "pct_floor", "max_rel_err")
STR_COLS = ("impl", "model", "dtype", "kv_dtype", "gpu")


def _check_schema(df: pd.DataFrame) -> None:
    assert list(df.columns) == bench.COLUMNS
    for c in INT_COLS:
        assert pd.api.types.is_integer_dtype(df[c]), c
    for c in FLOAT_COLS:
        assert pd.api.types.is_float_dtype(df[c]), c
    for c in STR_COLS:
        assert df[c].map(type).eq(str).all(), c


def test_emulator_end_to_end(tmp_path, capsys):
    out = tmp_path / "emu.csv"
    # no subcommand: attn is the default
    rc = bench.main(["--emulator", "--model", "llama3-8b", "--seqlens", "64,200", "--batch", "1,2",
                     "--repeats", "2", "--warmup", "0", "--out", str(out)])
    assert rc == 0
    df = pd.read_csv(out)
    _check_schema(df)
    assert len(df) == 2 * 2 * 3
    assert set(df["impl"]) == {"floor", "fdpp-emulator", "reference"}
    assert (df["gpu"] == "cpu-emulator").all() and (df["model"] == "llama3-8b").all()
    assert (df[["hq", "hkv", "head_dim"]].drop_duplicates().values == [[32, 8, 128]]).all()
    assert (df["time_us"] > 0).all() and (df["p10_us"] <= df["p90_us"]).all()
    floor = df[df["impl"] == "floor"]
    assert np.allclose(floor["pct_floor"], 100.0) and floor["max_rel_err"].isna().all()
    emu = df[df["impl"] == "fdpp-emulator"]
    assert (emu["max_rel_err"] < DTYPES["fp16"].rtol).all()
    row = df.iloc[0]
    assert row["gbps"] == pytest.approx(bench.kv_bytes_of(bench.Shape("x", 32, 8, 128), int(row["batch"]),
                                                          int(row["seqlen"]), "fp16") / row["time_us"] / 1e3)
    meta = json.loads(out.with_name(out.name + ".meta.json").read_text())
    for key in ("gpu", "fdpp_version", "git_commit", "date", "command_line", "cupy", "torch", "columns"):
        assert key in meta, key
    assert meta["gpu"] == "cpu-emulator" and meta["columns"] == bench.COLUMNS
    text = capsys.readouterr().out
    assert "time_us" in text and "pct_floor" in text and "fdpp-emulator" in text

    # the CSV plots
    pngs = tmp_path / "png"
    assert plot.main([str(out), "--out-dir", str(pngs)]) == 0
    # latency, speedup (fdpp-emulator over the float64 reference) and floor per batch; once the
    # emulator CSV had no speedup figure and nothing said why
    assert len(list(pngs.glob("*.png"))) == 2 * 3 and len(list(pngs.glob("*_speedup.png"))) == 2


def test_emulator_hnd_bf16_custom_heads(tmp_path):
    out = tmp_path / "x.csv"
    assert bench.main(["attn", "--emulator", "--heads", "6/2", "--head-dim", "64", "--dtype", "bf16",
                       "--kv-layout", "HND", "--seqlens", "97", "--repeats", "1", "--warmup", "0",
                       "--out", str(out)]) == 0
    df = pd.read_csv(out)
    _check_schema(df)
    assert (df["model"] == "custom-6x2-d64").all() and (df["dtype"] == "bf16").all()
    assert (df.loc[df["impl"] == "fdpp-emulator", "max_rel_err"] < DTYPES["bf16"].rtol).all()


def test_out_check_makes_no_folder(tmp_path, monkeypatch, capsys):
    """--out in a missing folder is checked without creating it (a run that stopped for want of a
    GPU once left the folder behind); a file in the way is refused."""
    from fdpp import api

    monkeypatch.setattr(api, "gpu_available", lambda: False)
    assert bench.main(["gemm", "--out", str(tmp_path / "new" / "deeper" / "x.csv")]) == bench.EXIT_NO_GPU
    assert not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        bench.main(["gemm", "--out", str(tmp_path / "file" / "x.csv")])
    assert e.value.code == 2 and "not a writable directory" in capsys.readouterr().err
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")  # its mkdir would fail only after the run
    with pytest.raises(SystemExit) as e:
        bench.main(["gemm", "--out", str(tmp_path / "dangling" / "x.csv")])
    assert e.value.code == 2 and "not a writable directory" in capsys.readouterr().err


def test_int4_rows_want_fp16_before_a_gpu_is_looked_for(capsys, monkeypatch):
    from fdpp import api

    monkeypatch.setattr(api, "gpu_available", lambda: pytest.fail("looked for a GPU before checking --dtype"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--kv-dtype", "int4", "--dtype", "bf16"])
    assert e.value.code == 2 and "argument --dtype" in capsys.readouterr().err


def test_emulator_refuses_sizes_the_cpu_cannot_hold(capsys):
    """--emulator --seqlens 64m was a 512 GiB MemoryError traceback."""
    with pytest.raises(SystemExit) as e:
        bench.main(["--emulator", "--seqlens", "64m", "--out", "/tmp/fdpp-never-written.csv"])
    assert e.value.code == 2 and "--emulator runs on the CPU" in capsys.readouterr().err


def test_default_out_name():
    p = bench.default_out(bench.Shape("llama3-70b-tp8", 8, 1, 128), "fp16", "NVIDIA H200")
    assert p == Path("results/attn_llama3-70b-tp8_fp16_nvidia-h200.csv")
    shape = bench.Shape("llama3-8b", 32, 8, 128)
    names = set()
    for argv in ([], ["--kv-dtype", "int4"], ["--kv-dtype", "int4", "--int4-group", "32"], ["--kv-dtype", "fp8_e4m3"],
                 ["--page-size", "0,16"], ["--page-size", "16"], ["--kv-layout", "HND"]):
        _, parser = bench.build_parser()
        args = parser.parse_args(argv)
        names.add(bench.default_out(shape, "fp16", "NVIDIA H200", args).name)
    assert "attn_llama3-8b_fp16_nvidia-h200.csv" in names  # the plain run keeps its name
    assert "attn_llama3-8b_fp16_int4g64_nvidia-h200.csv" in names and "attn_llama3-8b_fp16_p0-16_nvidia-h200.csv" in names
    assert len(names) == 7  # another KV format, page sizes or layout never overwrites another run's file


# ---- plot -----------------------------------------------------------------------------------
def test_fixture_has_bench_schema():
    _check_schema(pd.read_csv(FIXTURE))


def test_plot_fixture(tmp_path):
    import matplotlib.image as mpimg

    assert plot.main([str(FIXTURE), "--out-dir", str(tmp_path)]) == 0
    pngs = sorted(tmp_path.glob("*.png"))
    kinds = {p.stem.rsplit("_", 1)[1] for p in pngs}
    assert kinds == {"latency", "speedup", "floor"} and len(pngs) == 3
    for p in pngs:
        assert p.stat().st_size > 10_000
        h, w = mpimg.imread(p).shape[:2]
        assert 800 <= w <= 1000 and h >= 400


def test_plot_says_why_a_group_has_no_speedup_figure(tmp_path, capsys):
    """Two fdpp rows and no plain one (paged rows of two page sizes): no subject for the speedup
    figure, and stderr says so rather than leaving the figure out silently."""
    df = pd.read_csv(FIXTURE)
    two = pd.concat([df.assign(impl=df["impl"].replace("fdpp", "fdpp-a")),
                     df[df["impl"] == "fdpp"].assign(impl="fdpp-b")])
    csv = tmp_path / "two.csv"
    two.to_csv(csv, index=False)
    assert plot.main([str(csv), "--out-dir", str(tmp_path)]) == 0
    assert not list(tmp_path.glob("*_speedup.png")) and len(list(tmp_path.glob("*.png"))) == 2
    err = capsys.readouterr().err
    assert "no speedup figure" in err and "fdpp-a" in err and "fdpp-b" in err


def test_plot_says_when_a_csv_has_only_host_cost_rows(tmp_path, capsys):
    """A CSV of eager host-cost rows alone once wrote nothing and exited 0 without a word; the
    plan/run host-cost rows were drawn as one-point curves."""
    df = pd.read_csv(FIXTURE)
    eager = df[df["impl"].str.endswith("-eager")]
    assert not eager.empty
    csv = tmp_path / "eager.csv"
    eager.to_csv(csv, index=False)
    assert plot.main([str(csv), "--out-dir", str(tmp_path)]) == 1
    assert "only eager host-cost rows" in capsys.readouterr().err and not list(tmp_path.glob("*.png"))
    assert plot.host_cost("fdpp-plan-run") and plot.host_cost("fdpp-plan-run-torch") and not plot.host_cost("fdpp-paged")


def test_plot_of_a_quantized_run_names_its_kv_format(tmp_path, monkeypatch):
    """An INT4 run's figures were titled "B=1, fp16" and its floors of every page size merged into one
    curve; the title now names the K/V format and each page size's floor is its own series."""
    df = pd.read_csv(FIXTURE)
    df = df[df["impl"].isin(["fdpp", "floor"])]
    quant = pd.concat([df.assign(kv_dtype="int4_g64", page_size=p) for p in (0, 16)])
    csv = tmp_path / "int4.csv"
    quant.to_csv(csv, index=False)
    titles, series = [], set()
    real = plot._finish

    def spy(fig, ax, title, *a, **k):
        titles.append(title)
        series.update(line.get_label() for line in ax.get_lines())
        return real(fig, ax, title, *a, **k)

    monkeypatch.setattr(plot, "_finish", spy)
    assert plot.plot_csv(csv, tmp_path)
    assert titles and all("K/V int4_g64" in t for t in titles)
    assert "floor (streaming read), pages of 16" in series
    assert not any(str(x).startswith("vs floor") for x in series)  # the floors are no speedup curve


def test_plot_rejects_other_csv(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert plot.main([str(bad), "--out-dir", str(tmp_path)]) == 1
    assert "missing columns" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        plot.main([str(tmp_path / "nope.csv")])
    assert e.value.code != 0


def test_summary_table_from_fixture():
    rows = pd.read_csv(FIXTURE).to_dict("records")
    text = bench.summary_table(rows)
    assert "B=1  time_us" in text and "1k" in text and "64k" in text and "torch-cudnn-eager" in text


# ---- bench: the GPU path's glue, driven with NumPy stand-ins ---------------------------------
def _numpy_cupy() -> types.ModuleType:
    """A NumPy-backed stand-in for the few CuPy calls fdpp.bench's GPU path makes itself."""

    class Device:
        def __init__(self, i=0):
            self.id = i or 0

        def use(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    props = {"name": b"Fake GPU", "major": 9, "minor": 0, "multiProcessorCount": 132,
             "l2CacheSize": 60 << 20, "totalGlobalMem": 141 << 30}
    mod = types.ModuleType("cupy")
    mod.__version__ = "stand-in"
    mod.cuda = types.SimpleNamespace(
        Device=Device,
        runtime=types.SimpleNamespace(memGetInfo=lambda: (64 << 30, 141 << 30), deviceSynchronize=lambda: None,
                                      getDeviceProperties=lambda i: props, driverGetVersion=lambda: 13000,
                                      runtimeGetVersion=lambda: 13000))
    mod.asarray, mod.asnumpy, mod.empty_like, mod.empty, mod.stack = (np.asarray, np.asarray, np.empty_like,
                                                                     np.empty, np.stack)
    mod.random = types.SimpleNamespace(default_rng=np.random.default_rng)
    mod.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    return mod


def test_gpu_path_glue_with_stand_ins(monkeypatch, tmp_path):
    """Runs run_gpu end to end with CuPy, the kernels and the timers replaced by NumPy stand-ins: no
    timing is real, but argument plumbing, rotation, reference picks, rows and metadata are."""
    import fdpp
    import fdpp.api
    import fdpp.registry
    from fdpp.configs import SM90
    from fdpp.reference import split_kv_emulator

    monkeypatch.setitem(sys.modules, "cupy", _numpy_cupy())
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    monkeypatch.setattr(fdpp.api, "gpu_available", lambda: True)
    monkeypatch.setattr(fdpp.registry, "device_limits", lambda d=0: SM90)
    calls = {"n": 0}

    def fake_time(impls, *, calls_per_replay=20, warmup=3, repeats=7):  # every implementation of a point at once
        out = []
        for fns, *_ in impls:
            for f in fns:
                f()
            calls["n"] += len(fns)
            out.append(timing.Timing.from_samples([2.0, 2.5, 3.0][:repeats]))
        calls["groups"] = calls.get("groups", 0) + 1
        return out

    monkeypatch.setattr(timing, "l2_bytes", lambda d=None: 1 << 20)
    monkeypatch.setattr(timing, "time_round_robin", fake_time)
    monkeypatch.setattr(timing, "stream_read_gbps", lambda nbytes=0, **kw: 4500.0)
    monkeypatch.setattr(timing, "time_stream_read", lambda nbytes, **kw: timing.Timing.from_samples([1.0]))
    monkeypatch.setattr(timing, "host_call_us", lambda fn, n=2000: (fn(), 9.5)[1])
    monkeypatch.setattr(bench._Sets, "ptr", lambda self, i: 0)
    monkeypatch.setattr(bench, "MAX_SETS", 3)

    def emulated(q, k, v, *, kv_layout="NHD", out=None, **kw):
        o = split_kv_emulator(q, k, v, kv_layout=kv_layout, chunk=32)[0].astype(q.dtype)
        if out is None:
            return o
        out[...] = o
        return out

    def broken(*a, **kw):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(fdpp, "decode_attention", emulated)
    monkeypatch.setattr(fdpp, "decode_attention_nosplit", broken)
    out = tmp_path / "gpu.csv"
    rc = bench.main(["attn", "--heads", "4/2", "--head-dim", "64", "--seqlens", "64,100", "--batch", "1,3",
                     "--repeats", "3", "--out", str(out)])
    assert rc == 0 and calls["n"] > 0 and calls["groups"] == 4  # one interleaved timing per point
    df = pd.read_csv(out)
    _check_schema(df)
    # nosplit failed, its rows are missing; plan/run goes through the real API (not the stand-in),
    # which cannot run on these stand-in arrays, so its row is missing too
    others = {f"fdpp-eager-{var}" for var in bench.host_variants()}  # the other launch paths (no plan/run here)
    assert set(df["impl"]) == {"floor", "fdpp", "fdpp-two-launch", "fdpp-prefetch", "fdpp-eager", *others}
    fd = df[df["impl"] == "fdpp"]
    assert len(fd) == 4 and (fd["max_rel_err"] < DTYPES["fp16"].rtol).all()
    assert np.allclose(fd["pct_floor"], 100.0 / 2.5)
    meta = json.loads(out.with_name(out.name + ".meta.json").read_text())
    assert "kernel exploded" in meta["failed_impls"]["fdpp-nosplit"]
    assert meta["failed_counts"]["fdpp-nosplit"] == 4
    assert set(meta["rotation_sets"].values()) <= {1, 2, 3} and meta["peak_read_gbps"] == 4500.0
    assert set(meta["skipped_impls"]) == {"torch-cudnn", "torch-flash", "flashinfer"}


def test_time_round_robin_interleaves_and_rotates(monkeypatch):
    """Implementations are timed in rounds, each round starting one later; warm-up rounds first;
    each implementation's samples are its own (µs per call of its own call count)."""
    fake = _fake_cupy(elapsed_ms=3.0)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    order = []

    def mk(name):
        def f():
            order.append(name)
        return f

    ts = timing.time_round_robin([([mk("a")], "cupy-eager"), ([mk("b"), mk("B")], "cupy-eager"),
                                  ([mk("c")], "cupy-eager")], calls_per_replay=1, warmup=1, repeats=3)
    eager_once = ["a", "b", "B", "c"]
    rounds = [["a", "bB", "c"], ["a", "bB", "c"], ["bB", "c", "a"], ["c", "a", "bB"]]  # warm-up, then 3 timed
    want = eager_once + [x for r in rounds for name in r for x in name]
    assert order == want
    assert [t.median_us for t in ts] == [pytest.approx(3000.0), pytest.approx(1500.0), pytest.approx(3000.0)]
    assert all(len(t.samples) == 3 for t in ts)
    assert timing.rotation(3, 4) == [1, 2, 0]
    with pytest.raises(ValueError, match="kind"):
        timing.time_round_robin([([mk("a")], "jax")])
    with pytest.raises(ValueError, match="at least one"):
        timing.time_round_robin([])


def test_bench_times_a_points_impls_together_and_isolates_one_that_cannot_be_captured(monkeypatch):
    """_Sweep.time_impls: one interleaved timing of every checked implementation; when that fails,
    each alone, and only the one that fails loses its timing (noted as a failure)."""
    gb = types.SimpleNamespace(args=types.SimpleNamespace(impls=None), errors={}, skipped={})
    sw = bench._Sweep.__new__(bench._Sweep)
    sw.gb, sw.tkw, sw.fails, sw.timed_alone = gb, {"warmup": 1, "repeats": 3}, {}, {}
    pt = bench._Point(1, 1024, 0)
    good, bad = (bench._Impl([lambda: None], "cupy") for _ in range(2))
    seen = []

    def rr(impls, **kw):
        seen.append(len(impls))
        if any(im[0] is bad.calls for im in impls):
            raise RuntimeError("capture failed")
        return [timing.Timing.from_samples([1.0 + i]) for i in range(len(impls))]

    monkeypatch.setattr(timing, "time_round_robin", rr)
    ts = sw.time_impls(pt, [("a", good, 0.0), ("c", good, 0.0)], cpr=20)
    assert seen == [2] and [t.median_us for t in ts] == [1.0, 2.0]
    seen.clear()
    ts = sw.time_impls(pt, [("a", good, 0.0), ("b", bad, 0.0)], cpr=20)
    assert seen == [2, 1, 1] and ts[0].median_us == 1.0 and ts[1] is None
    assert sw.fails == {"b": 1} and "capture failed" in gb.errors["b"]
    assert list(sw.timed_alone) == [pt.label]  # the meta says which points were not interleaved
    assert sw.time_impls(pt, [], cpr=20) == []


def test_plot_refuses_what_it_cannot_read_or_write(tmp_path, capsys):
    """Each once ended in a traceback, or said that an existing directory "does not exist"."""
    with pytest.raises(SystemExit) as e:
        plot.main([str(tmp_path), "--out-dir", str(tmp_path / "png")])
    assert e.value.code == 2 and "is a directory" in capsys.readouterr().err
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert plot.main([str(empty), "--out-dir", str(tmp_path / "png")]) == 1
    assert "empty file" in capsys.readouterr().err
    words = tmp_path / "words.csv"
    words.write_text(FIXTURE.read_text().replace(",4096,", ",abc,", 1))
    assert plot.main([str(words), "--out-dir", str(tmp_path / "png")]) == 1
    err = capsys.readouterr().err
    assert "non-numbers" in err and "'abc'" in err  # the offending value, not the column's first
    blocked = tmp_path / "file"
    blocked.write_text("x")
    assert plot.main([str(FIXTURE), "--out-dir", str(blocked)]) == 1
    assert "cannot write into" in capsys.readouterr().err


def test_python_m_fdpp_lists_the_commands(capsys):
    """`python -m fdpp` was "No module named fdpp.__main__"."""
    import fdpp
    import fdpp.__main__ as entry

    assert entry.main() == 0
    out = capsys.readouterr().out
    assert out.startswith(f"fdpp {fdpp.__version__}") and all(cmd in out for cmd, _ in entry.COMMANDS)


@pytest.mark.parametrize("script, want", [("run.sh", "-m pip install -q -e .[{extra},torch]"),
                                          ("test.sh", "-m pip install -q -e .[test,{extra},torch]")])
@pytest.mark.parametrize("cuda, smi_rc, extra", [("12.8", 0, "cuda12"), ("13.0", 0, "cuda13"), ("12.4", 3, "cuda12"),
                                                ("N/A", 0, "cuda13")])
def test_scripts_install_cupy_for_the_drivers_cuda(tmp_path, script, want, cuda, smi_rc, extra):
    """scripts/run.sh and test.sh with a GPU pick the CuPy wheel of the driver's CUDA major version
    (scripts/cuda_extra.sh; both always installed cuda13), also when nvidia-smi exits non-zero after
    printing (set -e / pipefail once stopped run.sh there without a word). nvidia-smi, the venv's
    python and ruff are stand-ins that log their calls."""
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n[ \"$1\" = -L ] && echo 'GPU 0: Stand-in' && exit 0\n"
                   f"echo '| NVIDIA-SMI 580.1   Driver Version: 580.1   CUDA Version: {cuda}     |'\nexit {smi_rc}\n")
    stubs = [smi]
    for name in ("python", "ruff"):
        stub = venv / "bin" / name
        stub.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
        stubs.append(stub)
    for f in stubs:
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FDPP_VENV": str(venv)}
    env.pop("FDPP_CUDA_EXTRA", None)
    root = Path(__file__).resolve().parent.parent
    res = subprocess.run(["bash", str(root / "scripts" / script), "--collect-only"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert want.format(extra=extra) in log.read_text()
