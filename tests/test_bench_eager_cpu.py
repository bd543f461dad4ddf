"""The eager host-cost rows on a CPU: ``fdpp.bench --impls eager`` and ``fdpp.bench gemm --eager``
driven with the stand-in GPU of test_timing_bench_plot (CuPy replaced by NumPy, timers and kernels
replaced): the CSV columns, the implementation names and the row values the plots and summaries
read. No timing is real."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pandas as pd

from fdpp import bench, bench_gemm, launch, timing
from fdpp.dtypes import DTYPES

sys.path.insert(0, str(Path(__file__).parent))
from test_timing_bench_plot import _check_schema, _numpy_cupy  # noqa: E402

#: Every name an eager host-cost row of the attention bench may carry.
EAGER_IMPLS = {"fdpp-eager", "fdpp-eager-torch", "fdpp-plan-run", "fdpp-plan-run-torch", "flashinfer-eager",
               "torch-cudnn-eager"} | {f"fdpp-eager-{name}" for name in launch.LAUNCHERS}


def _stand_ins(monkeypatch):
    import fdpp
    import fdpp.api
    import fdpp.registry
    from fdpp.configs import SM90
    from fdpp.reference import split_kv_emulator

    monkeypatch.setitem(sys.modules, "cupy", _numpy_cupy())
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    monkeypatch.setattr(fdpp.api, "gpu_available", lambda: True)
    monkeypatch.setattr(fdpp.registry, "device_limits", lambda d=0: SM90)
    monkeypatch.setattr(timing, "l2_bytes", lambda d=None: 1 << 20)
    monkeypatch.setattr(timing, "time_calls", lambda fns, **kw: ([f() for f in fns],
                                                                 timing.Timing.from_samples([2.0, 2.5, 3.0]))[1])
    monkeypatch.setattr(timing, "stream_read_gbps", lambda nbytes=0, **kw: 4500.0)
    monkeypatch.setattr(timing, "time_stream_read", lambda nbytes, **kw: timing.Timing.from_samples([1.0]))
    host_us = iter([9.0, 9.5, 10.0] * 100)
    monkeypatch.setattr(timing, "host_call_us", lambda fn, n=2000: (fn(), next(host_us))[1])
    monkeypatch.setattr(bench._Sets, "ptr", lambda self, i: 0)
    monkeypatch.setattr(bench, "MAX_SETS", 2)

    def emulated(q, k, v, *, kv_layout="NHD", out=None, **kw):
        return split_kv_emulator(q, k, v, kv_layout=kv_layout, chunk=64)[0].astype(q.dtype)

    class Plan:  # DecodePlan's stand-in: run() is the emulated call
        def __init__(self, batch, hq, hkv, d, n, *, dtype="fp16", kv_layout="NHD", **kw):
            assert (batch, n) == bench.EAGER_POINT and dtype == "fp16"
            self.kv_layout = kv_layout

        def run(self, q, k, v):
            return emulated(q, k, v, kv_layout=self.kv_layout)

    monkeypatch.setattr(fdpp, "decode_attention", emulated)
    monkeypatch.setattr(fdpp, "DecodePlan", Plan)


def test_attention_eager_rows_schema(monkeypatch, tmp_path):
    _stand_ins(monkeypatch)
    out = tmp_path / "eager.csv"
    rc = bench.main(["attn", "--impls", "eager", "--heads", "4/2", "--head-dim", "64", "--seqlens", "64",
                     "--batch", "1", "--repeats", "3", "--out", str(out)])
    assert rc == 0
    df = pd.read_csv(out)
    _check_schema(df)
    eager = df[df["impl"].isin(EAGER_IMPLS)]
    # CuPy arrays without torch or flashinfer: fdpp eager, plan/run, the other launchers
    others = {f"fdpp-eager-{name}" for name in launch.LAUNCHERS if name != launch.LAUNCHER}
    assert len(others) == len(launch.LAUNCHERS) - 1 and set(eager["impl"]) == {"fdpp-eager", "fdpp-plan-run", *others}, set(df["impl"])
    b, n = bench.EAGER_POINT
    assert (eager["batch"] == b).all() and (eager["seqlen"] == n).all() and (eager["page_size"] == 0).all()
    # time_us = median of 3 host_call_us runs, p10/p90 = their min/max
    assert (eager["time_us"] == 9.5).all() and (eager["p10_us"] == 9.0).all() and (eager["p90_us"] == 10.0).all()
    assert (eager["max_rel_err"] < DTYPES["fp16"].rtol).all()
    assert eager["gpu"].nunique() == 1 and eager["gpu"].iloc[0] and eager["dtype"].eq("fp16").all()
    meta = json.loads(out.with_name(out.name + ".meta.json").read_text())
    assert "eager" not in meta.get("failed_impls", {})


def _gemm_cupy() -> types.ModuleType:
    mod = types.ModuleType("cupy")
    mod.float32 = np.float32
    rng = np.random.default_rng(0)
    mod.random = types.SimpleNamespace(standard_normal=lambda shape, dtype=np.float32: rng.standard_normal(shape)
                                       .astype(dtype))
    return mod


def test_gemm_eager_rows_schema(monkeypatch, tmp_path, capsys):
    import fdpp
    import fdpp.api

    monkeypatch.setitem(sys.modules, "cupy", _gemm_cupy())
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(fdpp.api, "gpu_available", lambda: True)
    monkeypatch.setattr(bench_gemm, "_environment", lambda: {"gpu": "Fake GPU", "date": "today"})
    seen = []
    monkeypatch.setattr(fdpp, "flat_gemm", lambda x, w: seen.append((x.shape, w.shape)) or x @ w.T)
    runs = iter([12.0, 11.0, 13.0])
    monkeypatch.setattr(timing, "host_call_us", lambda fn, n=2000: (fn(), next(runs))[1])
    out = tmp_path / "gemm_eager.csv"
    assert bench_gemm.main(["--eager", "--model", "llama3-8b", "--out", str(out)]) == 0
    assert "fdpp-eager: 12.00 us per eager call" in capsys.readouterr().out
    df = pd.read_csv(out)
    assert list(df.columns) == bench_gemm.COLUMNS
    assert list(df["impl"]) == ["fdpp-eager"]  # torch absent: no fdpp-eager-torch / torch-mm-eager rows
    r = df.iloc[0]
    assert (r["layer"], r["M"], r["N"], r["K"], r["dtype"]) == ("o", 1, 4096, 4096, "fp16")
    assert (r["time_us"], r["p10_us"], r["p90_us"]) == (12.0, 11.0, 13.0) and r["gpu"] == "Fake GPU"
    assert seen[0] == ((1, 4096), (4096, 4096))
    meta = json.loads(out.with_name(out.name + ".meta.json").read_text())
    assert meta["benchmark"] == "flat_gemm eager host cost"
    # without --out it prints and writes nothing (the old behaviour)
    monkeypatch.setattr(timing, "host_call_us", lambda fn, n=2000: 5.0)
    assert bench_gemm.main(["--eager", "--model", "llama3-8b"]) == 0
    assert not list(Path.cwd().glob("gemm_eager*"))
