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
import pytest

from fdpp import bench, bench_gemm, launch, timing
from fdpp.dtypes import DTYPES

sys.path.insert(0, str(Path(__file__).parent))
from test_timing_bench_plot import _check_schema, _numpy_cupy  # noqa: E402

#: Every name an eager host-cost row of the attention bench may carry.
EAGER_IMPLS = {"fdpp-eager", "fdpp-eager-torch", "fdpp-plan-run", "fdpp-plan-run-torch", "flashinfer-eager",
               "torch-cudnn-eager"} | {f"fdpp-{call}-{var}" for call in ("eager", "plan-run") for var in bench.host_variants()}


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
    monkeypatch.setattr(timing, "time_round_robin", lambda impls, **kw: [
        ([f() for f in im[0]], timing.Timing.from_samples([2.0, 2.5, 3.0]))[1] for im in impls])
    monkeypatch.setattr(timing, "stream_read_gbps", lambda nbytes=0, **kw: 4500.0)
    monkeypatch.setattr(timing, "time_stream_read", lambda nbytes, **kw: timing.Timing.from_samples([1.0]))
    counts: dict[int, int] = {}

    def host_us(fn, n=2000):  # each candidate's samples: 9.0, 9.5, 10.0, 9.0, ...
        fn()
        i = counts[id(fn)] = counts.get(id(fn), -1) + 1
        return (9.0, 9.5, 10.0)[i % 3]

    monkeypatch.setattr(timing, "host_call_us", host_us)
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
    # CuPy arrays without torch or flashinfer: fdpp eager and plan/run, each also with PDL off
    # through every launcher
    others = {f"fdpp-{call}-{var}" for call in ("eager", "plan-run") for var in bench.host_variants()}
    assert {"fdpp-plan-run-plain-cupy-driver", "fdpp-eager-plain-bindings"} <= others
    assert len(others) == 2 * len(launch.LAUNCHERS)
    assert set(eager["impl"]) == {"fdpp-eager", "fdpp-plan-run", *others}, set(df["impl"])
    b, n = bench.EAGER_POINT
    assert (eager["batch"] == b).all() and (eager["seqlen"] == n).all() and (eager["page_size"] == 0).all()
    # time_us = median of the EAGER_ROUNDS host_call_us samples, p10/p90 = their min/max
    assert (eager["time_us"] == 9.5).all() and (eager["p10_us"] == 9.0).all() and (eager["p90_us"] == 10.0).all()
    assert (eager["max_rel_err"] < DTYPES["fp16"].rtol).all()
    assert eager["gpu"].nunique() == 1 and eager["gpu"].iloc[0] and eager["dtype"].eq("fp16").all()
    meta = json.loads(out.with_name(out.name + ".meta.json").read_text())
    assert "eager" not in meta.get("failed_impls", {})


def test_eager_rows_are_timed_round_robin(monkeypatch, tmp_path):
    """Every candidate is sampled EAGER_ROUNDS times, one sample per round, each round starting
    one candidate later; a host getting steadily slower (the stand-in timer counts up) moves
    every candidate's median alike instead of penalising the last rows."""
    _stand_ins(monkeypatch)
    order = []
    clock = iter(range(1, 10_000))
    monkeypatch.setattr(timing, "host_call_us", lambda fn, n=2000: (order.append(fn), float(next(clock)))[1])
    out = tmp_path / "eager.csv"
    assert bench.main(["attn", "--impls", "eager", "--heads", "4/2", "--head-dim", "64", "--seqlens", "64",
                       "--batch", "1", "--repeats", "3", "--out", str(out)]) == 0
    df = pd.read_csv(out)
    eager = df[df["impl"].isin(EAGER_IMPLS)]
    n = len(eager)
    assert len(order) == n * bench.EAGER_ROUNDS
    rounds = [order[r * n:(r + 1) * n] for r in range(bench.EAGER_ROUNDS)]
    assert all(len(set(map(id, rd))) == n for rd in rounds)  # each candidate once a round
    assert len({id(rd[0]) for rd in rounds}) == bench.EAGER_ROUNDS  # a different one first each round
    assert rounds[1][-1] is rounds[0][0]  # the rotation: round r starts one later
    # a drift of one unit per sample: the medians lie within one round's width of each other
    assert eager["time_us"].max() - eager["time_us"].min() <= n


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


def test_host_variant_sets_and_restores_the_launch_path(monkeypatch):
    monkeypatch.setattr(launch, "PDL", frozenset(launch.PDL_FAMILIES))
    monkeypatch.setattr(launch, "LAUNCHER", "cupy-driver")
    with bench.host_variant("plain-bindings"):
        assert launch.PDL == frozenset() and launch.LAUNCHER == "bindings"
    with bench.host_variant("pdl"):
        assert launch.PDL == frozenset(launch.PDL_FAMILIES) and launch.LAUNCHER == "cupy-driver"
    assert launch.PDL == frozenset(launch.PDL_FAMILIES) and launch.LAUNCHER == "cupy-driver"
    with pytest.raises(ValueError, match="unknown host variant 'pdl-ctypes'"), bench.host_variant("pdl-ctypes"):
        pass
