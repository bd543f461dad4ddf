"""fdpp.bench e2e without a GPU: argument parsing, the points it plans, the CSV schema, the summary
and the plot. The timings here are made up (``FAKE_TIMINGS_FOR_SCHEMA_TEST``): they only fill the
schema; nothing here measures anything."""

import csv

import pytest

from fdpp import bench, bench_e2e
from fdpp.api import gpu_available
from fdpp.bench_e2e import COLUMNS, Point, Timed, build_parser, make_rows, plan_points, plot, summary


def _args(*extra):
    return build_parser().parse_args(["--model", "llama3-8b", "--seqlens", "4k..128k", "--batch", "1,8", *extra])


def test_parse_the_issue_command_line(tmp_path):
    a = _args("--kv", "fp16,fp8,int4", "--out", str(tmp_path / "e2e.csv"))
    assert a.seqlens == [4096, 8192, 16384, 32768, 65536, 131072]
    assert a.batch == [1, 8] and a.kv == ["fp16", "fp8", "int4"] and a.dtype == "fp16"
    assert a.impls == ["fdpp", "fdpp-nosplit", "torch-ref"] and a.out == tmp_path / "e2e.csv"
    for bad in (["--impls", "fdpp,vllm"], ["--kv", ","], ["--batch", "0"], ["--seqlens", "8k..4k"]):
        with pytest.raises(SystemExit):
            _args(*bad)


def test_planned_points_skip_unavailable_kv_formats():
    a = _args("--kv", "fp16,fp8,int4", "--seqlens", "4k,8k", "--batch", "1")
    pts, msgs = plan_points(a, kv_supported=False)
    assert [(p.impl, p.seqlen, p.kv) for p in pts] == [
        ("fdpp", 4096, "fp16"), ("fdpp-nosplit", 4096, "fp16"), ("torch-ref", 4096, "fp16"),
        ("fdpp", 8192, "fp16"), ("fdpp-nosplit", 8192, "fp16"), ("torch-ref", 8192, "fp16")]
    assert len(msgs) == 2 and "'fp8' unavailable" in msgs[0] and "'int4' unavailable" in msgs[1]
    pts, msgs = plan_points(a, kv_supported=True)
    assert not msgs and [p.kv for p in pts if p.impl == "fdpp"] == ["fp16", "fp8", "int4"] * 2
    assert {p.kv for p in pts if p.impl != "fdpp"} == {"fp16"}


FAKE_TIMINGS_FOR_SCHEMA_TEST = {
    "fdpp": {"step": Timed(10_000.0, 9_900.0, 10_200.0, 2), "attention": Timed(2_000.0, 1_990.0, 2_010.0, 10)},
    "torch-ref": {"step": Timed(20_000.0, 19_000.0, 21_000.0, 1)},
}


def test_csv_schema_summary_and_plot(tmp_path):
    a = _args()
    rows = []
    for impl, t in FAKE_TIMINGS_FOR_SCHEMA_TEST.items():
        for n in (4096, 8192):
            rows += make_rows(a, 32, Point(impl, 8, n, "fp16"), t, "fake-gpu")
    out = tmp_path / "e2e.csv"
    bench.write_results(rows, out, {"columns": COLUMNS}, columns=COLUMNS)
    with out.open() as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == COLUMNS and len(got) == 6
    step = next(r for r in got if r["impl"] == "fdpp" and r["op"] == "step")
    assert float(step["time_us"]) == 10_000.0 and float(step["tokens_per_s"]) == 800.0  # 8 tokens / 10 ms
    assert step["layers"] == "32" and step["kv"] == "fp16" and step["replays"] == "2"
    assert next(r for r in got if r["op"] == "attention")["tokens_per_s"] == ""
    text = summary(rows)
    assert "2.00x" in text and "10.000" in text and "20.000" in text
    png = plot(rows, tmp_path / "e2e.png")
    assert png is not None and png.stat().st_size > 1000


def test_cli_is_wired_into_fdpp_bench(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["e2e", "--help"])
    assert e.value.code == 0 and "inter-token latency" in capsys.readouterr().out.lower()
    if not gpu_available():
        assert bench.main(["e2e", "--seqlens", "4k"]) == bench.EXIT_NO_GPU
        assert "needs a CUDA GPU" in capsys.readouterr().err
    assert bench_e2e.main(["--backend", "cupy", "--dtype", "bf16"]) == 2
