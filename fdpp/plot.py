"""``python -m fdpp.plot <csv> [--out-dir results/]``: figures from an ``fdpp.bench`` CSV.

For each (model, batch, dtype) in the CSV, three PNGs (about 900 px wide, for a README):

- ``<stem>_<model>_b<B>_<dtype>_latency.png``  time per call vs context length, log-log, one line
  per implementation (the floor dashed);
- ``..._speedup.png``  fdpp's speedup over each other implementation (their time / fdpp's time). Where
  the CSV has no plain ``fdpp`` row, its one fdpp row (``fdpp-emulator`` in an emulator CSV) is the
  subject; with none, or several (pages of 16 and 64), no figure, and stderr says so;
- ``..._floor.png``    % of the floor (floor time / time) per implementation.

Eager host-cost rows (``*-eager``, ``fdpp-plan-run*``, one point each) are left out of the curves. Paged rows
(``fdpp-paged``, ``flashinfer-paged``, ...) get a curve per page size (``fdpp-paged p16``). Works anywhere
(matplotlib's Agg backend; no GPU, no CuPy).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator  # noqa: E402

REQUIRED = ("impl", "model", "batch", "seqlen", "dtype", "time_us", "pct_floor", "gpu")
FIGSIZE = (9.0, 5.4)  # inches, at DPI -> 900 x 540 px
DPI = 100
STYLE = {  # impl -> (color, linestyle, marker, label)
    "fdpp": ("#d62728", "-", "o", "fdpp (split-KV)"),
    "fdpp-nosplit": ("#ff9896", "-", "v", "fdpp no split"),
    "fdpp-umax": ("#9467bd", ":", "P", "fdpp unified max"),
    "fdpp-prefetch": ("#8c564b", ":", "v", "fdpp, L2 prefetch"),
    "torch-cudnn": ("#1f77b4", "-", "s", "PyTorch SDPA cuDNN"),
    "torch-flash": ("#17becf", "-", "D", "PyTorch SDPA flash"),
    "flashinfer": ("#2ca02c", "-", "^", "FlashInfer"),
    "floor": ("#000000", "--", "", "floor (streaming read)"),
    "fdpp-emulator": ("#d62728", "-", "o", "fdpp NumPy emulator"),
    "reference": ("#7f7f7f", "-", "x", "float64 reference"),
    # paged rows: one series per page size ("fdpp-paged p16"), a marker per page size
    "fdpp-paged": ("#8c1c13", "-.", "o", "fdpp paged"),
    "flashinfer-paged": ("#1a6b1a", "-.", "^", "FlashInfer paged"),
    "fdpp-paged-emulator": ("#8c1c13", "-.", "o", "fdpp paged, NumPy emulator"),
    "reference-paged": ("#7f7f7f", "-.", "x", "float64 reference, paged"),
}
ORDER = list(STYLE)
PAGE_MARKERS = ("o", "s", "D", "v", "P", "X", "*", "h", "<")  # by log2(page size)


def _style(impl: str) -> dict:
    base, _, page = impl.partition(" p")
    color, ls, marker, label = STYLE.get(base, (None, "-", ".", base))
    if page.isdigit():
        marker = PAGE_MARKERS[int(page).bit_length() % len(PAGE_MARKERS)]
        label = f"{label}, pages of {page}"
    kw = {"linestyle": ls, "marker": marker or None, "label": label, "markersize": 5, "linewidth": 1.8}
    if color:
        kw["color"] = color
    return kw


def _tokens(x: float, _pos: object = None) -> str:
    x = int(round(x))
    if x >= 1024 and x % 1024 == 0:
        return f"{x // 1024}k"
    return str(x)


def host_cost(impl: object) -> bool:
    """An eager host-cost row (one point: ``*-eager``, ``*-eager-*``, ``fdpp-plan-run*``), not a curve."""
    i = str(impl)
    return i.endswith("-eager") or "-eager-" in i or i.startswith("fdpp-plan-run")


def _is_floor(impl: object) -> bool:
    """The floor's series: "floor", or "floor p16" where a quantized run times it per page size."""
    return str(impl).split(" ")[0] == "floor"


def _impls(df: pd.DataFrame) -> list[str]:
    present = [i for i in df["impl"].unique() if not host_cost(i)]
    return [i for i in ORDER if i in present] + sorted(i for i in present if i not in ORDER)


def _finish(fig: plt.Figure, ax: plt.Axes, title: str, ylabel: str, path: Path, logx: bool = True) -> Path:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=2))
    ax.xaxis.set_major_formatter(FuncFormatter(_tokens))
    ax.set_xlabel("context length N (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11)
    ax.grid(True, which="major", alpha=0.35)
    ax.legend(fontsize=9, loc="best", framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _heads(sub: pd.DataFrame) -> str:
    if {"hq", "hkv", "head_dim"} <= set(sub.columns):
        r = sub.iloc[0]
        return f" ({int(r['hq'])}q/{int(r['hkv'])}kv heads, D={int(r['head_dim'])})"
    return ""


def plot_group(sub: pd.DataFrame, model: str, batch: int, dtype: str, stem: str, out_dir: Path) -> list[Path]:
    """The three figures of one (model, batch, dtype) group; returns the paths written."""
    gpu = ", ".join(sorted(str(g) for g in sub["gpu"].unique()))
    what = f"{model}{_heads(sub)}, B={batch}, {dtype}"
    if "kv_dtype" in sub.columns:  # a quantized-cache run: its K/V format in the title (fp16 rows say so in their name)
        kvs = sorted({str(k) for k in sub["kv_dtype"].dropna().unique()} - {dtype})
        if kvs:
            what += f", K/V {'/'.join(kvs)}"
    base = out_dir / f"{stem}_{model}_b{batch}_{dtype}"
    impls = _impls(sub)
    written = []
    t = sub.pivot_table(index="seqlen", columns="impl", values="time_us", aggfunc="median").sort_index()

    # latency
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for impl in impls:
        if impl in t:
            s = t[impl].dropna()
            ax.plot(s.index, s.values, **_style(impl))
    ax.set_yscale("log")
    written.append(_finish(fig, ax, f"Decode attention latency, {what}\n{gpu}", "time per call (µs, log)",
                           Path(f"{base}_latency.png")))

    # speedup of fdpp over each other implementation: the row "fdpp", else the one fdpp row there is
    # (fdpp-emulator in an emulator CSV; several paged fdpp rows have no single subject)
    mine = [i for i in impls if str(i).startswith("fdpp")]
    subject = "fdpp" if "fdpp" in t else (mine[0] if len(mine) == 1 and mine[0] in t else None)
    others = [i for i in impls if i != subject and not _is_floor(i) and i in t
              and subject is not None and (t[i] / t[subject]).notna().any()]
    if subject is None or not others:
        why = (f"no single fdpp row (rows: {', '.join(map(str, impls))})" if subject is None
               else f"nothing beside {subject} to compare with")
        print(f"fdpp.plot: {what}: no speedup figure, {why}", file=sys.stderr)
    else:
        fig, ax = plt.subplots(figsize=FIGSIZE)
        for impl in others:
            s = (t[impl] / t[subject]).dropna()  # where both were timed
            kw = _style(impl)
            kw["label"] = f"vs {kw['label']}"
            ax.plot(s.index, s.values, **kw)
        ax.axhline(1.0, color="#555555", linewidth=0.8)
        written.append(_finish(fig, ax, f"{subject} speedup (other time / {subject} time), {what}\n{gpu}",
                               "speedup (×)", Path(f"{base}_speedup.png")))

    # % of floor
    p = sub.pivot_table(index="seqlen", columns="impl", values="pct_floor", aggfunc="median").sort_index()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for impl in impls:
        if not _is_floor(impl) and impl in p:
            s = p[impl].dropna()
            ax.plot(s.index, s.values, **_style(impl))
    ax.axhline(100.0, **{k: v for k, v in _style("floor").items() if k in ("color", "linestyle")},
               linewidth=1.2, label="floor = 100 %")
    top = p.drop(columns=[c for c in p.columns if _is_floor(c)]).max().max()
    ax.set_ylim(0, max(110.0, float(top) * 1.05 if pd.notna(top) else 110.0))
    written.append(_finish(fig, ax, f"Share of the memory floor (floor time / time), {what}\n{gpu}",
                           "% of floor (higher is better)", Path(f"{base}_floor.png")))
    return written


def plot_csv(csv: Path, out_dir: Path) -> list[Path]:
    """Draw every (model, batch, dtype) group of ``csv`` into ``out_dir``; returns the PNG paths."""
    try:
        df = pd.read_csv(csv)
    except pd.errors.EmptyDataError:
        raise ValueError(f"{csv}: empty file, not an fdpp.bench CSV") from None
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise ValueError(f"{csv}: not an fdpp.bench CSV (missing columns {missing})")
    if df.empty:
        raise ValueError(f"{csv}: no rows")
    for c in ("batch", "seqlen", "time_us", "pct_floor"):
        if not pd.api.types.is_numeric_dtype(df[c]):
            bad = df[c][pd.to_numeric(df[c], errors="coerce").isna() & df[c].notna()]
            raise ValueError(f"{csv}: column {c} holds non-numbers (e.g. {bad.iloc[0]!r})")
    if "page_size" in df.columns:  # a curve per paged implementation and page size
        from fdpp.bench import series_name

        df["impl"] = [series_name(str(i), p) for i, p in zip(df["impl"], df["page_size"], strict=True)]
        paged_floor = (df["impl"] == "floor") & (df["page_size"].fillna(0) > 0)  # a quantized run's floors per page size
        df.loc[paged_floor, "impl"] = [f"floor p{int(x)}" for x in df.loc[paged_floor, "page_size"]]
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = csv.stem
    written: list[Path] = []
    curves = df[~df["impl"].map(host_cost)]
    if curves.empty:
        raise ValueError(f"{csv}: only eager host-cost rows ({', '.join(sorted(map(str, df['impl'].unique())))}), "
                         "no latency curve to draw")
    for (model, batch, dtype), sub in curves.groupby(["model", "batch", "dtype"], sort=True):
        written += plot_group(sub, str(model), int(batch), str(dtype), stem, out_dir)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fdpp.plot",
                                description="Latency, speedup and %-of-floor PNGs from an fdpp.bench CSV "
                                            "(one set per model, batch and dtype).")
    p.add_argument("csv", type=Path, help="CSV written by python -m fdpp.bench")
    p.add_argument("--out-dir", type=Path, default=Path("results"), help="where the PNGs go")
    args = p.parse_args(argv)
    if not args.csv.is_file():
        p.error(f"argument csv: {args.csv} " + ("is a directory, not a CSV" if args.csv.is_dir() else "does not exist"))
    try:
        paths = plot_csv(args.csv, args.out_dir)
    except ValueError as e:
        print(f"fdpp.plot: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # --out-dir not creatable or not writable
        print(f"fdpp.plot: cannot write into {args.out_dir}: {e.strerror or e}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
