"""``python -m fdpp.bench e2e``: inter-token latency of a whole Llama-family decode step.

For every (batch B, context N) point and implementation, a model with random weights (one set
per run, shared by every point: :class:`fdpp.models.llama.LlamaDecoder`'s ``weights=``) gets a
random context of N - 1 tokens (``prefill_random``, no prefill run), its step is captured in one
CUDA graph (the capture's warm-up step makes the context N tokens), the cache is advanced once,
and the graph is replayed: each replay decodes position N again (attending over N + 1 keys and
rewriting that one KV slot), so every sample sees the same length. Implementations:

- ``fdpp``          LlamaDecoder: flat_gemm, PagedKVCache (page 16), paged_decode_attention (split-KV);
                    one row per ``--kv`` format (fp8 / int4 go to ``PagedKVCache(kv_format=...)``; a
                    format this fdpp lacks is skipped with the reason printed)
- ``fdpp-w8``       ``fdpp`` with the layers' projections on FP8 weights (W8A16,
                    ``LlamaDecoder(weight_format="fp8_e4m3")``: a scale per output row; embedding and LM
                    head 16-bit; fp16 models on sm_90); one row per ``--kv`` format too
- ``fdpp-fused``    ``fdpp`` with ``fuse_norms=True``: the RMSNorms in the GEMMs' prologues and the
                    residual adds in the o / down epilogues instead of ``add_rmsnorm`` kernels (native
                    KV only): what the fusion saves or costs
- ``fdpp-rope2``    ``fdpp`` with ``fuse_rope_append=False``: RoPE and the KV append as two launches per
                    layer instead of one (native KV only): what that fusion saves
- ``fdpp-nosplit``  the same model with a contiguous cache and decode_attention_nosplit (the seed's
                    no-split contrast; native KV only)
- ``torch-ref``     fdpp.models.torch_ref.TorchReference: cuBLAS linears, SDPA (enable_gqa) over
                    the first N + 1 slots of a contiguous cache, graph-captured (native KV only)

Timing: ``--warmup`` untimed replays, then ``--repeats`` samples; a sample is a pair of CUDA
events around ``k`` back-to-back replays (k chosen so a sample takes >= 20 ms), divided by k.
``time_us`` is the median (p10 / p90 beside it); ``tokens_per_s = B / ITL``.

Per-op breakdown (fdpp rows): after the step, the program's ops of one kind (``OP_GROUPS``:
attention, qkv, o_proj, gate_up, down, lm_head, rope_append (or rope and kv_append), silu_mul, embed; and in the
unfused program norms (layer 0's lone RMSNorm) and residual_norm (each residual add fused with
the RMSNorm after it)), all layers, are captured alone into one graph and timed the same way: the
time one token spends in that kind of op (its kernels on the same buffers, without the rest of the
step; so the ops' sum misses the gaps between kinds and the overlap of neighbours' tails; in the
fused program the o_proj / down groups add into the residual stream at every replay, so its values
drift there, which the memory-bound kernels' time does not depend on). Rows with ``op`` = the
group; ``op = "step"`` is the whole step.

CSV (``COLUMNS``, long format) + ``.meta.json`` sidecar (machine, arguments, skipped points with
reasons) + a plot of ITL vs N per implementation (``.png`` beside the CSV).

Example::

    python -m fdpp.bench e2e --model llama3-8b --seqlens 4k..128k --batch 1,8 --kv fp16,fp8,int4 \\
        --out results/e2e_llama3-8b_h200.csv
"""

from __future__ import annotations

import argparse
import gc
import inspect
import logging
import math
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fdpp.bench import (
    EXIT_NO_GPU,
    HelpFormatter,
    _nonnegative,
    _positive,
    check_out,
    environment,
    parse_batches,
    parse_seqlens,
    slug,
    write_results,
)
from fdpp.models.presets import MODELS

log = logging.getLogger("fdpp.bench_e2e")

COLUMNS = ["impl", "model", "tp", "layers", "batch", "seqlen", "dtype", "kv", "op", "time_us", "p10_us",
           "p90_us", "tokens_per_s", "replays", "gpu"]
IMPLS = ("fdpp", "fdpp-w8", "fdpp-fused", "fdpp-rope2", "fdpp-nosplit", "torch-ref")
DEFAULT_IMPLS = ("fdpp", "fdpp-nosplit", "torch-ref")  # the other fdpp rows on request (--impls)
GROUPS = ("attention", "qkv", "o_proj", "gate_up", "down", "lm_head", "norms", "residual_norm", "rope",
          "kv_append", "rope_append", "silu_mul", "embed")
SAMPLE_MS = 20.0  # a timed sample lasts at least this long
MEM_SLACK = 4 << 30  # bytes kept free beyond a point's KV cache


#: ``--kv`` short names of PagedKVCache formats.
KV_ALIASES = {"fp8": "fp8_e4m3"}


def parse_kv(text: str) -> list[str]:
    """``--kv``: the model's dtype (a 16-bit cache; checked against --dtype in main), a
    PagedKVCache format (fdpp.quant.FORMATS) or an alias (KV_ALIASES), comma-separated."""
    from fdpp.dtypes import DTYPES
    from fdpp.quant import FORMATS

    vals = [x.strip() for x in text.split(",") if x.strip()]
    known = (*DTYPES, *FORMATS, *KV_ALIASES)
    if not vals or any(x not in known for x in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of KV formats from {', '.join(known)}, "
                                         "e.g. fp16,fp8,int4")
    return list(dict.fromkeys(vals))


def parse_page_size(text: str) -> int:
    from fdpp.configs import PAGE_SIZES

    try:
        v = int(text)
    except ValueError:
        v = 0
    if v not in PAGE_SIZES:
        raise argparse.ArgumentTypeError(f"{text!r}: a page size is a power of two in 1..256")
    return v


def parse_impls(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in vals if x not in IMPLS]
    if not vals or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: implementations are a comma list of {', '.join(IMPLS)}")
    return list(dict.fromkeys(vals))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fdpp.bench e2e",
        description="Inter-token latency of a whole Llama-family decode step (CUDA-graph replay): fdpp "
                    "(split-KV, per KV format), fdpp with no-split attention and the PyTorch reference; "
                    "per-op breakdown; CSV, .meta.json and a plot.",
        formatter_class=HelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="llama3-8b", help="model preset")
    p.add_argument("--tp", type=_positive, default=1, help="one GPU's share of a TP-N model (no all-reduce)")
    p.add_argument("--layers", type=_positive, default=None, help="layers (default the preset's)")
    p.add_argument("--vocab", type=_positive, default=None, help="vocabulary (default the preset's)")
    p.add_argument("--seqlens", type=parse_seqlens, default=parse_seqlens("4k..128k"), metavar="LIST",
                   help="context lengths N: comma list (4k,16k) or power-of-two range 4k..128k")
    p.add_argument("--batch", type=parse_batches, default=[1, 8], metavar="LIST", help="batch sizes")
    p.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="weights and activations")
    p.add_argument("--kv", type=parse_kv, default=None, metavar="LIST",
                   help="KV formats of the fdpp rows (default: --dtype); others than --dtype go to "
                        "PagedKVCache(kv_format=...)")
    p.add_argument("--impls", type=parse_impls, default=list(DEFAULT_IMPLS), metavar="LIST",
                   help=f"comma list of {', '.join(IMPLS)}")
    p.add_argument("--page-size", type=parse_page_size, default=16, help="fdpp paged cache page size (a power of two in 1..256)")
    p.add_argument("--backend", choices=("torch", "cupy"), default="torch",
                   help="fdpp front end (torch-ref always uses torch; cupy needs fp16)")
    p.add_argument("--no-breakdown", action="store_true", help="skip the per-op rows")
    p.add_argument("--repeats", type=_positive, default=7, help="timed samples per row")
    p.add_argument("--warmup", type=_nonnegative, default=3, help="untimed replays before the samples")
    p.add_argument("--out", type=Path, default=None, help="CSV path (default results/e2e_<model>_<gpu>.csv)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", type=_nonnegative, default=0, help="CUDA device index")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


# ---- rows, CSV, plot (no GPU needed) ------------------------------------------------------------
@dataclass(frozen=True)
class Point:
    impl: str
    batch: int
    seqlen: int
    kv: str


@dataclass(frozen=True)
class Timed:
    """Median, p10, p90 (µs) of one measured op, and the replays per sample."""

    median_us: float
    p10_us: float
    p90_us: float
    replays: int

    @classmethod
    def from_samples(cls, samples_us: Sequence[float], replays: int) -> Timed:
        s = [float(x) for x in samples_us]
        p10, p90 = np.percentile(s, [10, 90])
        return cls(float(statistics.median(s)), float(p10), float(p90), int(replays))


def make_rows(args: argparse.Namespace, layers: int, pt: Point, timings: dict[str, Timed], gpu: str) -> list[dict]:
    """CSV rows of one point: ``timings`` maps "step" and the breakdown groups to their times."""
    rows = []
    for op, t in timings.items():
        rows.append({
            "impl": pt.impl, "model": args.model, "tp": args.tp, "layers": layers, "batch": pt.batch,
            "seqlen": pt.seqlen, "dtype": args.dtype, "kv": pt.kv, "op": op,
            "time_us": round(t.median_us, 3), "p10_us": round(t.p10_us, 3), "p90_us": round(t.p90_us, 3),
            "tokens_per_s": round(pt.batch / (t.median_us * 1e-6), 2) if op == "step" else "",
            "replays": t.replays, "gpu": gpu,
        })
    return rows


def series(row: dict) -> str:
    if row["impl"] not in ("fdpp", "fdpp-w8") or row["kv"] == row["dtype"]:
        return row["impl"]
    return f"{row['impl']} ({row['kv']} KV)"


def summary(rows: list[dict]) -> str:
    """ITL (ms) per series and point, with the torch-ref / fdpp and nosplit / fdpp ratios."""
    steps = [r for r in rows if r["op"] == "step"]
    if not steps:
        return "(no rows)"
    names = list(dict.fromkeys(series(r) for r in steps))
    pts = sorted({(r["batch"], r["seqlen"]) for r in steps})
    itl = {(series(r), r["batch"], r["seqlen"]): r["time_us"] / 1e3 for r in steps}
    head = ["B", "N", *names, "ref/fdpp", "nosplit/fdpp"]
    lines = ["  ".join(f"{h:>14}" for h in head)]
    for b, n in pts:
        cells = [str(b), f"{n // 1024}k" if n % 1024 == 0 else str(n)]
        cells += [f"{itl[(s, b, n)]:.3f}" if (s, b, n) in itl else "-" for s in names]
        base = itl.get(("fdpp", b, n))
        for other in ("torch-ref", "fdpp-nosplit"):
            o = itl.get((other, b, n))
            cells.append(f"{o / base:.2f}x" if base and o else "-")
        lines.append("  ".join(f"{c:>14}" for c in cells))
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path | None:
    """ITL (ms) vs N, one line per series, one panel per batch size; returns the file or None."""
    steps = [r for r in rows if r["op"] == "step"]
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in steps})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        for name in dict.fromkeys(series(r) for r in steps):
            pts = sorted((r["seqlen"], r["time_us"] / 1e3) for r in steps if r["batch"] == b and series(r) == name)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length N (tokens)")
        ax.set_ylabel("inter-token latency (ms)")
        r0 = steps[0]
        tp = "" if r0["tp"] == 1 else f" (one GPU of TP {r0['tp']})"
        ax.set_title(f"{r0['model']}{tp}, {r0['layers']} layers, {r0['dtype']}, B={b}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plan_points(args: argparse.Namespace, kv_supported: bool) -> tuple[list[Point], list[str]]:
    """The points to measure, in order (batch, N, impl, KV format), and one message per KV format
    skipped because this fdpp's PagedKVCache has no ``kv_format`` (``kv_supported`` False).
    Only ``fdpp`` and ``fdpp-w8`` rows take other KV formats than ``--dtype``."""
    kvs = args.kv or [args.dtype]
    usable = [kv for kv in kvs if kv == args.dtype or kv_supported]
    msgs = [f"skip fdpp kv={kv}: KV format {kv!r} unavailable (this fdpp's PagedKVCache has no kv_format "
            "argument)" for kv in kvs if kv not in usable]
    pts = [Point(impl, b, n, kv) for b in args.batch for n in args.seqlens for impl in args.impls
           for kv in (usable if impl in ("fdpp", "fdpp-w8") else [args.dtype])]
    return pts, msgs


# ---- GPU measurement --------------------------------------------------------------------------
class _Runner:
    """Captures and times graphs on one front end."""

    def __init__(self, backend: str, device: int):
        self.backend, self.device = backend, device
        import torch

        self.torch = torch

    def capture(self, fns: Sequence[Callable[[], Any]], backend: str) -> Callable[[], None]:
        """One graph of ``fns`` (already run once eagerly on this process's streams)."""
        if backend == "torch":
            t = self.torch
            s = t.cuda.Stream(device=self.device)
            s.wait_stream(t.cuda.current_stream(self.device))
            with t.cuda.stream(s):
                for f in fns:  # eager once on the capture stream (fdpp's per-stream workspaces)
                    f()
            s.synchronize()
            g = t.cuda.CUDAGraph()
            with t.cuda.graph(g, stream=s, capture_error_mode="relaxed"):
                for f in fns:
                    f()
            t.cuda.current_stream(self.device).wait_stream(s)
            return g.replay
        import cupy

        s = cupy.cuda.Stream(non_blocking=True)
        s.wait_event(cupy.cuda.get_current_stream().record())  # the work queued before (inputs) first
        with s:
            for f in fns:
                f()
            s.synchronize()
            s.begin_capture()
            try:
                for f in fns:
                    f()
            finally:
                g = s.end_capture()
            g.upload(s)
        s.synchronize()

        def replay() -> None:
            g.launch(s)
            cupy.cuda.get_current_stream().wait_event(s.record())

        return replay

    def time(self, replay: Callable[[], None], warmup: int, repeats: int) -> Timed:
        t = self.torch
        sync = t.cuda.synchronize
        replay()
        sync()
        e0, e1 = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
        e0.record()
        replay()
        e1.record()
        sync()
        one_ms = max(e0.elapsed_time(e1), 1e-3)
        k = max(1, min(1000, math.ceil(SAMPLE_MS / one_ms)))
        for _ in range(warmup):
            replay()
        events = [(t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for a, b in events:
            a.record()
            for _ in range(k):
                replay()
            b.record()
        sync()
        return Timed.from_samples([a.elapsed_time(b) * 1e3 / k for a, b in events], k)


def _kv_supported() -> bool:
    import fdpp

    return "kv_format" in inspect.signature(fdpp.PagedKVCache).parameters


def _free_bytes(device: int) -> int:
    import torch

    return int(torch.cuda.mem_get_info(device)[0])


def run_gpu(args: argparse.Namespace) -> tuple[list[dict], dict[str, Any]]:
    import torch

    from fdpp.models.llama import OP_GROUPS, LlamaDecoder, memory_estimate
    from fdpp.models.torch_ref import TorchReference
    from fdpp.workspace import scoped as scoped_workspaces

    torch.cuda.set_device(args.device)
    gpu = torch.cuda.get_device_name(args.device)
    kvs = args.kv or [args.dtype]
    common = dict(tp=args.tp, dtype=args.dtype, vocab=args.vocab, num_layers=args.layers, seed=args.seed,
                  device=args.device)
    # the weights of every point: one set per front end in use (the same values on both)
    base = (LlamaDecoder(args.model, 1, 2, backend="torch", **common)
            if args.backend == "torch" or "torch-ref" in args.impls else None)
    cupy_base = (LlamaDecoder(args.model, 1, 2, backend="cupy", **common)
                 if args.backend == "cupy" and any(i != "torch-ref" for i in args.impls) else None)
    layers = (base or cupy_base).dims["layers"]
    runner = _Runner(args.backend, args.device)
    rows: list[dict] = []
    skipped: list[str] = []

    def skip(pt: Point, why: str) -> None:
        msg = f"skip {pt.impl} kv={pt.kv} B={pt.batch} N={pt.seqlen}: {why}"
        print(f"fdpp.bench e2e: {msg}", file=sys.stderr)
        skipped.append(msg)

    points, why_not = plan_points(args, _kv_supported())
    for msg in why_not:
        print(f"fdpp.bench e2e: {msg}", file=sys.stderr)
    skipped += why_not
    for pt in points:
        cache = "paged" if pt.impl in ("fdpp", "fdpp-w8", "fdpp-fused", "fdpp-rope2") else "contiguous"
        need = memory_estimate(args.model, pt.batch, pt.seqlen + 1, tp=args.tp, dtype=args.dtype, vocab=args.vocab,
                               num_layers=args.layers, page_size=args.page_size, cache=cache)["kv"]
        free = _free_bytes(args.device)
        if need + MEM_SLACK > free:
            skip(pt, f"the KV cache needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
            continue
        try:
            with scoped_workspaces():  # the attention partials of this point's capture streams
                timings = _measure(args, pt, base, cupy_base, runner, LlamaDecoder, TorchReference, OP_GROUPS)
        except Exception as e:  # noqa: BLE001 - a point that cannot run (an unknown KV format, OOM) is reported
            log.debug("point %s failed", pt, exc_info=True)
            skip(pt, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        rows += make_rows(args, layers, pt, timings, gpu)
        st = timings["step"]
        print(f"fdpp.bench e2e: {pt.impl:<13} kv={pt.kv:<5} B={pt.batch:<3} N={pt.seqlen:<7} "
              f"ITL {st.median_us / 1e3:8.3f} ms  {pt.batch / (st.median_us * 1e-6):9.1f} tok/s", flush=True)
    meta = {"gpu_name": gpu, "skipped": skipped, "layers": layers, "kv_formats": kvs, "impls": args.impls,
            "method": "CUDA-graph replay of one decode step at context N (attends N + 1 keys), CUDA events, "
                      f"median of {args.repeats} samples after {args.warmup} warm-up replays"}
    return rows, meta


def _measure(args: argparse.Namespace, pt: Point, base: Any, cupy_base: Any, runner: _Runner, decoder_cls: Any,
             ref_cls: Any, op_groups: dict[str, str]) -> dict[str, Timed]:
    """Build, fill, capture and time one point; returns {"step": ..., group: ...}."""
    n = pt.seqlen
    if pt.impl == "torch-ref":
        ref = ref_cls(base, max_seqlen=n + 1, batch=pt.batch)
        ref.prefill_random(n - 1)
        cap = ref.capture(dynamic=False)  # warm-up step (-> N), then the replayed position N
        out = {"step": runner.time(cap.replay, args.warmup, args.repeats)}
        del cap, ref
        return out
    backend = args.backend
    weights = (cupy_base if backend == "cupy" else base).weights
    m = decoder_cls(args.model, pt.batch, n + 1, tp=args.tp, dtype=args.dtype, vocab=args.vocab,
                    num_layers=args.layers, seed=args.seed, device=args.device, backend=backend,
                    kv_format=None if pt.kv == args.dtype else KV_ALIASES.get(pt.kv, pt.kv), page_size=args.page_size,
                    nosplit=pt.impl == "fdpp-nosplit", weights=weights,
                    weight_format="fp8_e4m3" if pt.impl == "fdpp-w8" else None,
                    fuse_norms=pt.impl == "fdpp-fused", fuse_rope_append=pt.impl != "fdpp-rope2")
    m.prefill_random(n - 1)
    cap = m.capture()  # one eager step: the context is N
    m.advance()  # the slot of position N, decoded again by every replay
    out = {"step": runner.time(cap.replay, args.warmup, args.repeats)}
    if not args.no_breakdown:
        for group in GROUPS:
            fns = [fn for name, fn in m.program if op_groups[name] == group]
            if fns:
                out[group] = runner.time(runner.capture(fns, backend), args.warmup, args.repeats)
    del cap, m
    return out


def default_out(model: str, gpu: str) -> Path:
    return Path("results") / f"e2e_{slug(model)}_{slug(gpu)}.csv"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    check_out(parser, args.out)
    try:
        MODELS[args.model].heads(args.tp)
    except ValueError as e:
        parser.error(f"argument --tp: {e}")
    from fdpp.dtypes import DTYPES

    other = [k for k in args.kv or [] if k in DTYPES and k != args.dtype]
    if other:
        parser.error(f"argument --kv: a 16-bit cache is the model's --dtype {args.dtype}, got {', '.join(other)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if args.backend == "cupy" and args.dtype != "fp16":
        print("fdpp.bench e2e: --backend cupy runs fp16 models only", file=sys.stderr)
        return 2
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    from fdpp.api import gpu_available

    if not (has_gpu and gpu_available()):
        print("fdpp.bench e2e: needs a CUDA GPU with torch and CuPy (the model, its graphs and the torch "
              "reference run there); nothing to time on this machine.", file=sys.stderr)
        return EXIT_NO_GPU
    rows, meta = run_gpu(args)
    out = args.out or default_out(args.model, meta["gpu_name"])
    meta = {**environment(args.device), "model": args.model, "tp": args.tp, "dtype": args.dtype,
            "command_line": shlex.join(["python", "-m", "fdpp.bench", "e2e", *(argv or sys.argv[1:])]),
            "columns": COLUMNS, "rows": len(rows), **meta}
    meta_path = write_results(rows, out, meta, columns=COLUMNS)
    png = plot(rows, out.with_suffix(".png"))
    print(summary(rows))
    print(f"\nfdpp.bench e2e: wrote {out} ({len(rows)} rows), {meta_path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
