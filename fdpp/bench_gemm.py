"""``python -m fdpp.bench gemm --model llama3-8b``: decode-phase linear layers against cuBLAS and the floor.

For every projection of the model (``fdpp.models``: qkv, o, gate_up, down; per GPU under ``--tp``)
and every M (batch) the benchmark makes random weights rotated over enough sets to exceed 4x the L2
(``fdpp.timing.rotation_count``), then times, by CUDA-graph replay in this one process, every
implementation of the point interleaved round by round (``fdpp.timing.time_round_robin``: each
timed round replays each implementation's graph once, starting one implementation later than the
round before, on one stream), so a slow phase of the GPU hits all of them alike:

- ``fdpp``          fdpp.flat_gemm with the dispatcher's plan (tuned table, else heuristic)
- ``fdpp-flat`` / ``fdpp-gemv``  the heuristic flat-GEMM plan / a GEMV plan, forced (``--paths``)
- ``cublas``        torch.addmm (cuBLAS through PyTorch, on the same memory) when torch imports;
                    else cupy.matmul + add, eagerly (CuPy refuses cuBLAS inside graph capture)
- ``floor``         the stream_read kernel reading the same bytes (w + x + bias + y)
- ``fdpp-fp8``      (``--weights fp8``) fdpp.flat_gemm on FP8 E4M3 weights with a scale per row
                    (W8A16, :func:`fdpp.quantize_weight` of the same kind of random weights); its
                    ``floor_us`` / ``pct_floor`` are those of its own bytes (codes + scales + x + bias
                    + y), its ``speedup`` is over cuBLAS on the 16-bit weights, and its reference is
                    float64 x times the dequantised weights (no peer takes FP8 weights with 16-bit x)

``pct_floor`` = floor time / time; ``speedup`` = cuBLAS time / time. Each
implementation's output (an eager call on the first set, output poisoned with NaN first) is checked
against a float64 NumPy reference: ``max_rel_err``. Rows go to a CSV (``COLUMNS``) plus a
``.meta.json`` sidecar, and ``--plot`` draws % of floor per layer and M.

``--tune`` first runs :func:`fdpp.gemm_tune.tune_gemm` over the same shapes and Ms and merges the tuned
entries into the user table (``<GPU>_gemm.json`` in ``--out-dir``, else ``$FDPP_TUNING_DIR``, else the
user cache dir), which overrides the shipped ``tuning/<GPU>_gemm.json`` entry by entry in the
``fdpp`` rows, as the attention tables do; ``--out-dir tuning`` updates the shipped table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fdpp.bench import _positive, check_out
from fdpp.dtypes import get_dtype
from fdpp.models import MODELS, get_model

log = logging.getLogger("fdpp.bench_gemm")

COLUMNS = ["impl", "model", "layer", "M", "N", "K", "dtype", "time_us", "p10_us", "p90_us", "gbps",
           "pct_floor", "max_rel_err", "gpu", "floor_us", "speedup", "plan"]
DEFAULT_MS = (1, 2, 4, 8, 16)
PATHS = ("fdpp", "fdpp-flat", "fdpp-gemv", "cublas")
ANCHOR_TBPS = 4.49  # ANCHORS.md streaming read on the H200, for the console summary only


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default="llama3-8b", choices=sorted(MODELS),
                   help="model preset whose projection shapes (N, K) are measured")
    p.add_argument("--tp", type=_positive, default=1, help="tensor-parallel degree (shapes per GPU)")
    p.add_argument("--layers", default=None,
                   help="comma-separated subset of qkv,o,gate_up,down (default: all)")
    p.add_argument("--m", default=",".join(map(str, DEFAULT_MS)),
                   help="comma-separated batch sizes M (1..64)")
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    p.add_argument("--weights", default="fp16", choices=("fp16", "fp8"),
                   help="fp8: also time fdpp on FP8 E4M3 weights (W8A16, row fdpp-fp8; fp16 x); "
                        "with --tune, tune those too")
    p.add_argument("--paths", default="fdpp,cublas",
                   help=f"comma-separated implementations to time, from {','.join(PATHS)}")
    p.add_argument("--repeats", type=_positive, default=7, help="timed graph replays per point (median)")
    p.add_argument("--calls-per-replay", type=_positive, default=20, help="calls captured in one graph")
    p.add_argument("--tune", action="store_true",
                   help="run fdpp.gemm_tune.tune_gemm over these shapes and Ms first, write the table")
    p.add_argument("--out-dir", default=None,
                   help="directory of the user table <GPU>_gemm.json (read over the shipped one, and "
                        "merged into by --tune); default $FDPP_TUNING_DIR, else the user cache dir; "
                        "'tuning' updates the table shipped in the source tree")
    p.add_argument("--sweep", action="store_true",
                   help="also time every tuner candidate (impl = its variant key) for diagnosis")
    p.add_argument("--out", default=None,
                   help="CSV path (default results/gemm_<model>_<gpu>.csv); .meta.json beside it")
    p.add_argument("--plot", action="store_true", help="also write <out>.png (%% of floor per layer and M)")
    p.add_argument("--no-floor", action="store_true", help="skip the measured floor (use 4.49 TB/s)")
    p.add_argument("--eager", action="store_true",
                   help="host cost of one eager call instead (o projection, M=1): fdpp on CuPy and torch "
                        "arrays, torch.mm (cuBLAS); prints µs per call, and with --out also writes them "
                        "as CSV rows (time_us = host µs per call, p10/p90 = min/max of 3 runs)")
    p.add_argument("--summarize", metavar="CSV", default=None,
                   help="print the summary of a CSV written earlier and exit (no GPU needed)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(
        prog="python -m fdpp.bench gemm",
        description="Time fdpp.flat_gemm against cuBLAS and the memory floor on a model's "
                    "decode-phase projection shapes; write a CSV and a .meta.json sidecar."))


def _slug(s: str) -> str:
    import re

    return re.sub(r"[^0-9A-Za-z]+", "_", s).strip("_").lower()


def _ints(s: str) -> list[int]:
    return [int(t) for t in str(s).split(",") if t.strip()]


_FLOORS: dict[tuple[int, int, str], tuple[int, float]] = {}


def _floor_us(key: tuple[int, int, str], nbytes: int, args: argparse.Namespace) -> float:
    """The stream-read floor of ``nbytes``: measured once per ``key`` ((N, K, weight format)); x and
    y (< 0.5 % of the bytes here) scale it for each M. ``--no-floor``: bytes / ANCHOR_TBPS."""
    if args.no_floor:
        return nbytes / (ANCHOR_TBPS * 1e12) * 1e6
    from fdpp import timing

    if key not in _FLOORS:
        _FLOORS[key] = (nbytes, timing.time_stream_read(nbytes, repeats=args.repeats).median_us)
    b0, t0 = _FLOORS[key]
    return t0 * nbytes / b0


@dataclass
class _Group:
    """The rows of one point that read the same inputs: (impl, plan) pairs, the rotated input
    sets, their float64 reference, the bytes a call must read and the floor of those bytes."""

    todo: list[tuple[str, Any]]
    sets: list
    ref: Any
    nbytes: int
    floor_us: float


def _timed_rows(groups: Sequence[_Group], base: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (impl, plan) of the groups: each checked against its group's reference on set 0,
    then every plan that ran graph-timed together, interleaved round by round
    (:func:`fdpp.timing.time_interleaved`: a slow phase of the GPU hits every row alike; if that
    fails, each alone, its rows marked so); a plan that fails is reported and skipped."""
    from fdpp import gemm_tune, timing
    from fdpp.reference import max_rel_err

    def failed(impl: str, e: Exception) -> None:
        log.error("%s failed at %s M=%d: %s", impl, base["layer"], base["M"], e)
        print(f"fdpp.bench_gemm: {impl} failed at {base['layer']} M={base['M']}: {e}", file=sys.stderr)

    checked = []
    for g in groups:
        for impl, plan in g.todo:
            try:
                checked.append((impl, plan, max_rel_err(gemm_tune.run_plan(plan, g.sets[0]), g.ref), g))
            except Exception as e:  # noqa: BLE001 - report and go on with the other rows
                failed(impl, e)
    impls, hows = gemm_tune.plan_impls([(p, g.sets) for _, p, _, g in checked])
    timed, why = timing.time_interleaved(impls, repeats=args.repeats, calls_per_replay=args.calls_per_replay)
    alone = ""
    if why is not None:
        alone = " [timed alone]"  # said in the row's plan column: not interleaved with the others
        print(f"fdpp.bench_gemm: interleaved timing failed at {base['layer']} M={base['M']} ({why}); "
              "timed each implementation alone", file=sys.stderr)
    rows = []
    for (impl, _, err, g), t, how in zip(checked, timed, hows, strict=True):
        if isinstance(t, Exception):
            failed(impl, t)
            continue
        rows.append({**base, "impl": impl, "floor_us": round(g.floor_us, 3), "time_us": round(t.median_us, 3),
                     "p10_us": round(t.p10_us, 3), "p90_us": round(t.p90_us, 3),
                     "gbps": round(g.nbytes / (t.median_us * 1e-6) / 1e9, 1),
                     "pct_floor": round(100.0 * g.floor_us / t.median_us, 1), "max_rel_err": err,
                     "plan": how + alone})
    return rows


# ---- one point ------------------------------------------------------------------------------
def bench_point(layer: str, n: int, k: int, m: int, dt: Any, args: argparse.Namespace,
                paths: Sequence[str], gpu: str, model: str) -> list[dict[str, Any]]:
    import cupy

    from fdpp import gemm, gemm_tune, registry, timing

    dev = cupy.cuda.Device().id
    limits = registry.device_limits(dev)
    l2 = timing.l2_bytes(dev)
    sets = gemm_tune._rotated_inputs(n, k, m, dt, l2)
    ref = gemm_tune._reference(sets[0])
    nbytes = (n * k + m * k + n + m * n) * dt.itemsize
    floor_us = _floor_us((n, k, dt.name), nbytes, args)
    base = {"model": model, "layer": layer, "M": m, "N": n, "K": k, "dtype": dt.name, "gpu": gpu}

    todo: list[tuple[str, Any]] = []
    if "fdpp" in paths:
        todo.append(("fdpp", gemm.choose(m, n, k, limits, dt.name)))
    if "fdpp-flat" in paths:
        todo.append(("fdpp-flat", gemm.heuristic_plan(m, n, k, dt.name, limits)))
    if "fdpp-gemv" in paths and m <= max(gemm.GEMV_M):
        todo.append(("fdpp-gemv", gemm.GemmPlan("gemv", gemm.GemvConfig(dt.name, 8, 2, 2, gemm.m_max_for(m)))))
    if "cublas" in paths:
        todo.append(("cublas", gemm.GemmPlan("cublas")))
    if args.sweep:
        for p in gemm_tune.tune_candidates(m, dt.name, limits):
            if p.config is not None:
                todo.extend((q.describe(), q) for q in gemm_tune.expand_grids(p, n, k, dev))
    groups = [_Group(todo, sets, ref, nbytes, floor_us)]
    if getattr(args, "weights", "fp16") == "fp8" and dt.name == "fp16":
        groups.append(_fp8_group(n, k, m, dt, args, limits, l2))
    rows = _timed_rows(groups, base, args)  # every row interleaved with every other, cuBLAS's too
    del groups, sets
    blas = min((r["time_us"] for r in rows if r["impl"] == "cublas"), default=math.nan)
    for r in rows:
        r["speedup"] = round(blas / r["time_us"], 3) if blas == blas else math.nan
    return rows


def _fp8_group(n: int, k: int, m: int, dt: Any, args: argparse.Namespace, limits: Any, l2: int) -> _Group:
    """The ``fdpp-fp8`` row (and with ``--sweep`` every w8 candidate): FP8 weights, own floor."""
    from fdpp import gemm, gemm_tune

    sets = gemm_tune._rotated_inputs(n, k, m, dt, l2, wfmt="e4m3")
    ref = gemm_tune._reference(sets[0])
    nbytes = n * k + 4 * n + (m * k + n + m * n) * dt.itemsize
    floor_us = _floor_us((n, k, "e4m3"), nbytes, args)
    todo = [("fdpp-fp8", gemm.choose(m, n, k, limits, dt.name, wfmt="e4m3"))]
    if args.sweep:
        import cupy

        for p in gemm_tune.tune_candidates(m, dt.name, limits, "e4m3"):
            todo.extend((q.describe(), q) for q in gemm_tune.expand_grids(p, n, k, cupy.cuda.Device().id))
    return _Group(todo, sets, ref, nbytes, floor_us)


# ---- driver ---------------------------------------------------------------------------------
def _environment() -> dict[str, Any]:
    try:
        from fdpp.bench import environment

        return environment(0)
    except Exception:  # noqa: BLE001 - metadata is best effort
        import cupy

        p = cupy.cuda.runtime.getDeviceProperties(0)
        name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
        return {"gpu": name, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


def summary(rows: list[dict[str, Any]]) -> str:
    """fdpp vs cuBLAS per (layer, M): time, % floor, speedup, and the median speedup.

    ``ceiling`` is cuBLAS time / floor time: the most any kernel that reads the same bytes no
    faster than the floor could gain over cuBLAS at that point.
    """
    by: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["layer"], int(r["M"])), {})[r["impl"]] = r
    lines = [f"{'layer':8s} {'M':>3s} {'fdpp_us':>8s} {'cublas_us':>9s} {'floor_us':>8s} "
             f"{'%floor':>6s} {'speedup':>7s} {'ceiling':>7s} {'max_rel_err':>11s}  plan"]
    sp, ceil, same = [], [], []
    for (layer, m), d in by.items():
        f = d.get("fdpp")
        if f is None:
            continue
        cb = float(d.get("cublas", {}).get("time_us", math.nan))
        c = cb / float(f["floor_us"])
        sp.append(float(f["speedup"]))
        if f["plan"] == d.get("cublas", {}).get("plan"):
            same.append(float(f["speedup"]))
        if math.isfinite(c):
            ceil.append(c)
        lines.append(f"{layer:8s} {m:3d} {f['time_us']:8.2f} {cb:9.2f} {f['floor_us']:8.2f} "
                     f"{f['pct_floor']:6.1f} {f['speedup']:7.3f} {c:7.3f} {f['max_rel_err']:11.2e}  {f['plan']}")
    if sp:
        lines.append(f"median speedup over cuBLAS: {float(np.median(sp)):.3f}; min {min(sp):.3f}")
    if ceil:
        lines.append(f"median ceiling (cuBLAS / floor): {float(np.median(ceil)):.3f}")
    if same:  # both rows ran the same call: their ratio is the comparator's own run-to-run spread
        lines.append(f"fdpp dispatched to cuBLAS at {len(same)} points; speedup there "
                     f"{min(same):.3f}..{max(same):.3f} (same call timed twice)")
    fp8 = [(key, d) for key, d in by.items() if "fdpp-fp8" in d]
    if fp8:
        lines.append(f"{'layer':8s} {'M':>3s} {'fp8_us':>8s} {'floor8':>8s} {'%floor':>6s} {'x cuBLAS':>8s} "
                     f"{'x fdpp16':>8s} {'max_rel_err':>11s}  plan   (FP8 weights, W8A16)")
        for (layer, m), d in fp8:
            e = d["fdpp-fp8"]
            f16 = float(d.get("fdpp", {}).get("time_us", math.nan))
            lines.append(f"{layer:8s} {m:3d} {e['time_us']:8.2f} {e['floor_us']:8.2f} {e['pct_floor']:6.1f} "
                         f"{e['speedup']:8.3f} {f16 / float(e['time_us']):8.3f} {e['max_rel_err']:11.2e}  {e['plan']}")
    return "\n".join(lines)


def summarize_csv(path: str | Path) -> str:
    """The console summary of a CSV this benchmark wrote; needs no GPU."""
    import csv

    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows or not {"impl", "layer", "M", "time_us", "floor_us", "speedup"} <= set(rows[0]):
        raise ValueError(f"{path}: not a CSV written by 'python -m fdpp.bench gemm' "
                         f"(expected columns {COLUMNS})")
    num = {"time_us", "floor_us", "pct_floor", "speedup", "max_rel_err"}
    parsed = []
    for line, r in enumerate(rows, start=2):
        try:
            parsed.append({k: (float(v) if k in num else v) for k, v in r.items()})
        except (TypeError, ValueError):
            bad = {k: r.get(k) for k in num}
            raise ValueError(f"{path}, line {line}: numeric columns must hold numbers, got {bad}") from None
    return summary(parsed)


def main(argv_or_args: Sequence[str] | argparse.Namespace | None = None) -> int:
    """Entry point for ``python -m fdpp.bench gemm`` (argv list) or a parsed Namespace."""
    parser = build_parser()
    if isinstance(argv_or_args, argparse.Namespace):
        args = parser.parse_args([])
        vars(args).update({k: v for k, v in vars(argv_or_args).items() if v is not None})
    else:
        args = parser.parse_args(list(sys.argv[1:] if argv_or_args is None else argv_or_args))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    if args.summarize:
        given = [f for f, on in (("--tune", args.tune), ("--eager", args.eager), ("--out", args.out)) if on]
        if given:  # --summarize only reads a CSV: a flag of a timing run would be silently ignored
            parser.error(f"argument --summarize: reads a CSV and times nothing; drop {', '.join(given)}")
        try:
            print(summarize_csv(args.summarize))
        except (OSError, ValueError) as e:
            print(f"fdpp.bench gemm --summarize: {e}", file=sys.stderr)
            return 1
        return 0
    # every argument is checked before the GPU is looked for: a bad flag is named on any machine
    from fdpp import gemm

    model = get_model(args.model)
    try:
        shapes = model.linear_shapes(args.tp)
    except ValueError as e:
        parser.error(f"argument --tp: {e}")
    layers = [x.strip() for x in args.layers.split(",") if x.strip()] if args.layers else list(shapes)
    if not layers:  # "--layers ,": as the other lists, empty items are dropped, and none left is an error
        parser.error(f"argument --layers: no layer named; choose from {list(shapes)}")
    for ly in layers:
        if ly not in shapes:
            parser.error(f"argument --layers: unknown layer {ly!r}; choose from {list(shapes)}")
    try:
        ms = _ints(args.m)
    except ValueError:
        ms = []
    if not ms or any(not 1 <= m <= gemm.MAX_M for m in ms):
        parser.error(f"argument --m: batch sizes are a comma list of integers in 1..{gemm.MAX_M}, got {args.m!r}")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths:
        parser.error(f"argument --paths: no implementation named; choose from {PATHS}")
    for p in paths:
        if p not in PATHS:
            parser.error(f"argument --paths: unknown implementation {p!r}; choose from {PATHS}")
    dt = get_dtype(args.dtype)
    if args.weights == "fp8" and dt.name != "fp16":
        parser.error("argument --weights: FP8 weights (W8A16) take fp16 activations; use --dtype fp16")
    check_out(parser, args.out)
    if args.eager and args.tune:
        parser.error("argument --eager: times the host cost of eager calls only; --tune belongs to a timing run")
    from fdpp.api import gpu_available

    if not gpu_available():
        print("fdpp.bench gemm: no CUDA GPU (CuPy sees no device); nothing to time", file=sys.stderr)
        return 2
    if args.eager:
        return eager_host_cost(args)
    import os

    from fdpp import gemm_tune, registry, tables

    if args.out_dir:
        os.environ[tables.ENV_DIR] = str(args.out_dir)  # the user layer, read and written
    env = _environment()
    gpu = env.get("gpu") or registry.device_limits(0).name
    if args.tune:
        for wfmt in ("", "e4m3") if args.weights == "fp8" else ("",):
            gemm_tune.tune_gemm([shapes[ly] for ly in layers], ms, dtype=dt.name, repeats=args.repeats,
                                wfmt=wfmt)
    out = Path(args.out) if args.out else Path("results") / f"gemm_{args.model}_{_slug(gpu)}.csv"
    meta = {**env, "benchmark": "flat_gemm", "model": args.model, "tp": args.tp, "dtype": dt.name,
            "weights": args.weights,
            "layers": {ly: shapes[ly] for ly in layers}, "Ms": ms,
            "method": "CUDA-graph replay of calls_per_replay calls, median of repeats; weights "
                      "rotated over >= 4x L2; floor = stream_read of the same bytes",
            "calls_per_replay": args.calls_per_replay, "repeats": args.repeats,
            "table": [str(t) for t in gemm.table_paths(gpu)],
            "command_line": "python -m fdpp.bench gemm " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["gemm"]
                                                                    else sys.argv[1:])}
    rows: list[dict[str, Any]] = []
    for ly in layers:
        n, k = shapes[ly]
        for m in ms:
            pt = bench_point(ly, n, k, m, dt, args, paths, gpu, args.model)
            rows.extend(pt)
            _write(rows, out, meta)
            best = min(pt, key=lambda r: r["time_us"] if r["impl"] != "cublas" else math.inf,
                       default=None)
            print(f"{ly} M={m}: " + "  ".join(f"{r['impl']} {r['time_us']:.2f}" for r in pt
                                               if r["impl"] in ("fdpp", "fdpp-flat", "fdpp-gemv", "cublas", "fdpp-fp8"))
                  + (f"  best {best['plan']} {best['time_us']:.2f} ({best['pct_floor']}%)" if best else "")
                  + f"  floor {pt[0]['floor_us'] if pt else math.nan:.2f}", flush=True)  # after every point: a run cut short keeps what it measured
    print(summary(rows))
    print(f"wrote {out}")
    if args.plot:
        png = plot(rows, out.with_suffix(".png"))
        if png:
            print(f"wrote {png}")
    return 0


def eager_host_cost(args: argparse.Namespace) -> int:
    """Print the host cost (µs per call, median of 3 runs of ``timing.host_call_us``) of an eager
    flat_gemm at the model's o projection, M=1, on CuPy and torch arrays, beside torch.mm."""
    import cupy

    import fdpp
    from fdpp.timing import host_call_us

    n, k = get_model(args.model).linear_shapes(args.tp)["o"]
    dt = get_dtype(args.dtype).np_dtype
    x = cupy.random.standard_normal((1, k), dtype=cupy.float32).astype(dt)
    w = (cupy.random.standard_normal((n, k), dtype=cupy.float32) * 0.02).astype(dt)
    calls = {"fdpp-eager": lambda: fdpp.flat_gemm(x, w)}
    try:
        import torch

        xt, wt = torch.from_dlpack(x), torch.from_dlpack(w)
        calls["fdpp-eager-torch"] = lambda: fdpp.flat_gemm(xt, wt)
        calls["torch-mm-eager"] = lambda: torch.mm(xt, wt.t())
    except ImportError:
        pass
    rows = []
    env = _environment()
    gpu = env.get("gpu") or ""
    for name, fn in calls.items():
        runs = sorted(host_call_us(fn, 2000) for _ in range(3))
        us = runs[1]
        print(f"flat_gemm o {n}x{k} M=1 {name}: {us:.2f} us per eager call", flush=True)
        rows.append({"impl": name, "model": args.model, "layer": "o", "M": 1, "N": n, "K": k,
                     "dtype": get_dtype(args.dtype).name, "time_us": round(us, 3), "p10_us": round(runs[0], 3),
                     "p90_us": round(runs[-1], 3), "gpu": gpu, "plan": "eager host cost"})
    if args.out:
        out = Path(args.out)
        _write(rows, out, {**env, "benchmark": "flat_gemm eager host cost", "model": args.model,
                           "tp": args.tp, "method": "timing.host_call_us over 2000 calls, median of 3 runs"})
        print(f"wrote {out}")
    return 0


def _write(rows: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> None:
    import csv

    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    out.with_name(out.name + ".meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")


def plot(rows: list[dict[str, Any]], png: Path) -> Path | None:
    """Bars of % of floor for fdpp and cuBLAS per (layer, M)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    pts = sorted({(r["layer"], r["M"]) for r in rows}, key=lambda p: (p[0], p[1]))
    impls = [i for i in ("fdpp", "cublas") if any(r["impl"] == i for r in rows)]
    val = {(r["impl"], r["layer"], r["M"]): r["pct_floor"] for r in rows}
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(pts) * len(impls)), 4))
    w = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        ax.bar([i + j * w for i in range(len(pts))], [val.get((impl, ly, m), 0) for ly, m in pts],
               width=w, label=impl)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(pts))])
    ax.set_xticklabels([f"{ly}\nM={m}" for ly, m in pts], fontsize=7)
    ax.set_ylabel("% of memory floor")
    ax.axhline(100, color="k", lw=0.5)
    ax.legend()
    ax.set_title(f"flat GEMM, {rows[0]['model']} {rows[0]['dtype']} on {rows[0]['gpu']}" if rows else "")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


if __name__ == "__main__":
    sys.exit(main())
