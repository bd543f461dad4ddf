"""``python -m fdpp.bench``: decode-attention latency against the memory floor and the peers.

Subcommands: ``attn`` (the default when none is given), ``gemm`` (``fdpp.bench_gemm``) and ``e2e``
(``fdpp.bench_e2e``: a whole model's decode step).

For every (batch, context length) point the attention benchmark makes random inputs, rotated over
enough sets to exceed 4x the L2 (``fdpp.timing.rotation_count``), then times each implementation
by CUDA-graph replay in this one process:

- ``fdpp``          fdpp.decode_attention, the dispatcher's plan (tuned table or heuristic)
- ``fdpp-two-launch`` fdpp.decode_attention with the dispatcher's plan forced to its two-launch
  form (same phase-1 kernel and splits, then decode_combine): what a fused plan is measured against
- ``fdpp-nosplit``  fdpp.decode_attention_nosplit (one CTA per query head, no sequence split)
- ``fdpp-umax``     fdpp.decode_attention with ``softmax_mode="unified_max"``, phi from
  ``fdpp.calibrate_unified_max`` on request 0's first 4,096 tokens of the point's first set
- ``fdpp-prefetch`` fdpp.decode_attention with the opt-in L2 prefetch before the PDL wait on
  (``fdpp.launch.L2_PREFETCH_BYTES``: ``FDPP_L2_PREFETCH_MB``, or 4 MiB when that is 0, while its
  calls are captured): the same plan, for an A/B
- ``floor``         the stream_read kernel reading the same K and V bytes (fdpp.timing)
- ``torch-cudnn``   torch SDPA, cuDNN backend, enable_gqa=True (when torch imports)
- ``torch-flash``   torch SDPA, flash backend, enable_gqa=True (when torch imports)
- ``flashinfer``    single_decode_with_kv_cache at B=1, BatchDecodeWithPagedKVCacheWrapper
                    (page 16, NHD) otherwise (when flashinfer imports)

With ``--page-size`` (a comma list; 0 = the contiguous points above, the default) each page size
adds paged points: K/V pools of ceil(N / page) pages per request in a random order (one seeded
permutation of the pool per point, shared by its rotated sets and both implementations), rows with
that ``page_size``:

- ``fdpp-paged``        fdpp.paged_decode_attention through that block table
- ``flashinfer-paged``  BatchDecodeWithPagedKVCacheWrapper (tensor cores, NHD) on the same pool and
                        table (paged_kv_indptr / indices / last_page_len), planned once per point

and, at B=1, N=1k, the host cost of one eager call: ``fdpp-eager`` and ``torch-cudnn-eager``.
Rows go to a long-format CSV (``COLUMNS``) with a ``.meta.json`` sidecar describing the machine and
the run (rewritten after every point, so a run cut short still leaves its rows); ``python -m
fdpp.plot`` draws them.

Examples::

    python -m fdpp.bench --model llama3-8b --batch 1,8            # 1k..256k, all implementations
    python -m fdpp.bench --model llama3-70b --tp 8 --batch 1      # one GPU's share of a TP-8 model
    python -m fdpp.bench --heads 32/8 --head-dim 128 --seqlens 1k..64k --impls fdpp,floor --quick
    python -m fdpp.bench --model llama3-8b --batch 1,8,64 --seqlens 1k,4k,16k,64k --page-size 0,16
    python -m fdpp.bench --emulator                               # no GPU: the NumPy emulator
    python -m fdpp.plot results/attn_llama3-8b_fp16_nvidia-h200.csv

Correctness: each implementation's output is checked once per point, from an eager call on the
first input set, against the float64 ``fdpp.reference.attention_reference`` (CuPy on the GPU, or
NumPy on the CPU where the reference takes only NumPy) for a subset: batch rows {0, B-1} x query
heads {0, Hq-1}, so the first and last KV head and request are covered (the full float64 reference
of a 256k-token batch would not fit); at paged points the request's pages are gathered through the
block table. ``max_rel_err`` is that check; rows over the dtype's rtol are
flagged on stderr, in the sidecar's ``flagged`` list and, with ``--strict``, in the exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import functools
import importlib
import json
import logging
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fdpp.configs import HEAD_DIMS, PAGE_SIZES
from fdpp.dtypes import DTYPES, KV_FORMATS
from fdpp.models import MODELS

log = logging.getLogger("fdpp.bench")

#: Descale of the benchmark's and the tuner's FP8 inputs: codes of N(0, 1) data / FP8_DESCALE.
FP8_DESCALE = 1.0 / 64

COLUMNS = ["impl", "model", "hq", "hkv", "head_dim", "batch", "seqlen", "dtype", "kv_dtype", "page_size",
           "time_us", "p10_us", "p90_us", "gbps", "pct_floor", "max_rel_err", "gpu"]
IMPLS = ("fdpp", "fdpp-two-launch", "fdpp-nosplit", "fdpp-umax", "fdpp-prefetch", "floor", "torch-cudnn", "torch-flash",
         "flashinfer")
#: ``fdpp-prefetch``'s L2 prefetch budget when ``FDPP_L2_PREFETCH_MB`` leaves it off: 4 MiB, the
#: largest calls that gained in run T2 (fdpp.launch.L2_PREFETCH_BYTES)
BENCH_PREFETCH_BYTES = 4 << 20
PAGED_IMPLS = ("fdpp-paged", "flashinfer-paged")  # what runs at --page-size > 0 points
SELECTABLE = (*IMPLS, *PAGED_IMPLS, "eager")
DEFAULT_SEQLENS = tuple(1024 << i for i in range(9))  # 1k .. 256k
EMULATOR_SEQLENS = (256, 1024, 4096)
#: --emulator refuses points whose float64 K and V would pass this (the reference holds them in memory)
EMULATOR_MAX_BYTES = 4 << 30
EAGER_POINT = (1, 1024)  # (batch, seqlen) of the eager host-cost rows
ROTATE_FACTOR = 4  # rotated sets total >= 4 x L2 ...
MAX_SETS = 256  # ... unless that needs more than this many sets
FLASHINFER_PAGE = 16
MEM_FRACTION = 0.7  # of free device memory the rotated inputs may take
EXIT_NO_GPU = 2
EXIT_FLAGGED = 3


# ---- argument parsing ------------------------------------------------------------------------
def _int_token(tok: str) -> int:
    t = tok.strip().lower()
    mult = 1
    if t.endswith("k"):
        mult, t = 1024, t[:-1]
    elif t.endswith("m"):
        mult, t = 1024 * 1024, t[:-1]
    return int(t) * mult


def parse_seqlens(text: str) -> list[int]:
    """``"1k,4k,16384"`` or ``"1k..256k"`` (powers of two from A to B) -> sorted token counts."""
    try:
        out: set[int] = set()
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if ".." in part:
                lo, hi = (_int_token(x) for x in part.split("..", 1))
                if lo < 1 or hi < lo or lo & (lo - 1) or hi & (hi - 1):  # the ends powers of two
                    raise ValueError
                n = lo
                while n <= hi:
                    out.add(n)
                    n *= 2
            else:
                out.add(_int_token(part))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a comma list of token counts (e.g. 1k,4k,16384) or a range "
            f"of powers of two like 1k..256k") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: context lengths must be positive integers")
    return sorted(out)


def parse_batches(text: str) -> list[int]:
    try:
        vals = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of batch sizes, e.g. 1,8") from None
    if not vals or vals[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch sizes must be positive integers")
    return vals


def parse_heads(text: str) -> tuple[int, int]:
    """``"32/8"`` -> (32 query heads, 8 KV heads)."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected QHEADS/KVHEADS, e.g. 32/8")
    hq, hkv = int(m.group(1)), int(m.group(2))
    if hq < 1 or hkv < 1 or hq % hkv:
        raise argparse.ArgumentTypeError(f"{text!r}: query heads must be a positive multiple of KV heads")
    return hq, hkv


def parse_impls(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in vals if x not in SELECTABLE]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"unknown implementation(s) {bad or text!r}; choose from "
                                         f"{', '.join(SELECTABLE)}")
    return vals


def parse_page_sizes(text: str) -> list[int]:
    """``"0,16"`` -> [0, 16]: KV caches to run, 0 = contiguous, else pages of that many tokens (a
    power of two in 1..256, as ``fdpp.paged_decode_attention`` takes). Sorted, deduplicated."""
    try:
        vals = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        vals = []
    bad = [v for v in vals if v != 0 and v not in PAGE_SIZES]
    if not vals or bad:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a comma list of page sizes, each 0 (contiguous) or a power of two in "
            f"1..256, e.g. 0,16")
    return vals


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``low``."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= {low}")
        return v
    return parse


_positive, _nonnegative = _int_at_least(1), _int_at_least(0)


def check_out(p: argparse.ArgumentParser, out: Path | str | None) -> None:
    """``--out`` checked before any timing (``p.error`` if not), so that a run cannot end in a path it
    cannot write: not a directory, and its nearest existing folder a writable directory (the missing
    ones are made only when the results are written: a run that stops early leaves none behind)."""
    if out is None:
        return
    out = Path(out)
    if out.is_dir():
        p.error(f"argument --out: {out} is a directory; give the CSV's path")
    base = out.absolute().parent
    while not os.path.lexists(base) and base != base.parent:  # a dangling link stops the walk (and fails)
        base = base.parent
    try:  # a folder made and removed at once: os.access says yes to root even where nothing can be made
        if not base.is_dir():
            raise NotADirectoryError(f"{base} is not a directory")
        os.rmdir(tempfile.mkdtemp(prefix=".fdpp-out-check-", dir=base))
    except OSError as e:
        p.error(f"argument --out: cannot create {out.parent}: {base} is not a writable directory ({e.strerror or e})")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter without "(default: None)": a flag whose default is computed says
    so in its own help text."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The top-level parser and the ``attn`` subparser."""
    top = argparse.ArgumentParser(
        prog="python -m fdpp.bench",
        description="Benchmarks against the memory floor and the peers. 'attn' (decode attention) is "
                    "the default subcommand; see 'python -m fdpp.bench attn --help'.")
    sub = top.add_subparsers(dest="command", metavar="{attn,gemm,e2e}")
    p = sub.add_parser(
        "attn", help="decode attention latency vs context length (default)",
        description="Time decode attention (fdpp, its no-split baseline, the streaming-read floor, "
                    "PyTorch SDPA cuDNN/flash and FlashInfer when importable) over context lengths and "
                    "batch sizes; write a long-format CSV and a .meta.json sidecar.",
        formatter_class=HelpFormatter)
    sub.add_parser("gemm", help="flat GEMM benchmark (fdpp.bench_gemm; its own flags)", add_help=False)
    sub.add_parser("e2e", help="decode step of a whole model (fdpp.bench_e2e; its own flags)", add_help=False)

    g = p.add_argument_group("problem")
    g.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="head configuration from a model preset (default llama3-8b unless --heads)")
    g.add_argument("--tp", type=_positive, default=1,
                   help="tensor-parallel degree: benchmark one GPU's share of a --model's heads")
    g.add_argument("--heads", type=parse_heads, default=None, metavar="HQ/HKV",
                   help="explicit query/KV heads, e.g. 32/8 (instead of --model)")
    g.add_argument("--head-dim", type=int, choices=HEAD_DIMS, default=128, help="head dim with --heads")
    g.add_argument("--seqlens", type=parse_seqlens, default=None, metavar="LIST",
                   help="context lengths: comma list with k suffix (1k,4k) or a power-of-two range "
                        "1k..256k; default 1k..256k (256,1k,4k with --emulator, 4k,16k,64k with --kv-dtype int4)")
    g.add_argument("--batch", type=parse_batches, default=None, metavar="LIST",
                   help="batch sizes, comma list; default 1,8 (1 with --emulator)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="fp16", help="q/K/V/out element type")
    g.add_argument("--kv-dtype", choices=("same", *sorted(KV_FORMATS), "int4"), default="same",
                   help="K/V element type: q's (same) or an FP8 format (fdpp, fdpp-paged, flashinfer and "
                        "flashinfer-paged rows; codes of N(0, 1) data at descale 1/64; needs torch), or int4 "
                        "(fdpp.bench_int4: fdpp INT4 rows, their floor and fdpp's fp16 time; no peer exists)")
    g.add_argument("--int4-group", type=int, choices=(32, 64, 128), default=64,
                   help="--kv-dtype int4: quantisation group along head_dim")
    g.add_argument("--kv-layout", choices=("NHD", "HND"), default="NHD",
                   help="KV cache layout: [B,N,Hkv,D] (NHD) or [B,Hkv,N,D] (HND); the same storage is "
                        "given to every implementation (paged pools: [pages,page,Hkv,D] or [pages,Hkv,page,D])")
    g.add_argument("--page-size", type=parse_page_sizes, default="0", metavar="LIST",
                   help="KV caches: comma list of page sizes, 0 = contiguous, else a power of two in 1..256: "
                        "paged points with shuffled pages, timed as fdpp-paged (fdpp.paged_decode_attention) "
                        "and flashinfer-paged (its paged batch decode), e.g. 0,16")

    r = p.add_argument_group("run")
    r.add_argument("--impls", type=parse_impls, default=None, metavar="LIST",
                   help=f"implementations to run, comma list of {', '.join(SELECTABLE)} ('eager' = the "
                        "host-cost rows); floor always runs; unavailable peers are skipped; at paged points "
                        "fdpp and flashinfer stand for fdpp-paged and flashinfer-paged")
    r.add_argument("--out", type=Path, default=None,
                   help="CSV path (default results/attn_<model>_<dtype>_<gpu>.csv)")
    r.add_argument("--repeats", type=_positive, default=None, help="timed graph replays per point (default 7, "
                   "3 with --quick)")
    r.add_argument("--warmup", type=_nonnegative, default=None, help="untimed replays (default 3, 1 with --quick)")
    r.add_argument("--calls-per-replay", type=_positive, default=None,
                   help="most calls captured per graph (fewer for long calls; default 20, 10 with --quick)")
    r.add_argument("--quick", action="store_true", help="fewer repeats and calls: a fast, noisier sweep")
    r.add_argument("--fdpp-arrays", choices=("auto", "cupy", "torch"), default="auto",
                   help="array type given to fdpp: CuPy views of the inputs (timed with CuPy graphs) or "
                        "the torch tensors themselves (torch graphs); auto = cupy, torch for bf16")
    r.add_argument("--device", type=int, default=0, help="CUDA device index")
    r.add_argument("--emulator", action="store_true",
                   help="no GPU needed: time the NumPy split-KV emulator on small sizes (same CSV schema, "
                        "gpu=cpu-emulator)")
    r.add_argument("--strict", action="store_true",
                   help=f"exit {EXIT_FLAGGED} when a row's max_rel_err exceeds the dtype tolerance")
    r.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return top, p


@dataclass(frozen=True)
class Shape:
    """Head configuration of a run."""

    model: str  # label written to the CSV (preset name, "-tp<N>" suffix, or custom-<hq>x<hkv>-d<d>)
    hq: int
    hkv: int
    head_dim: int

    @property
    def ratio(self) -> int:
        return self.hq // self.hkv


def resolve_shape(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Shape:
    if args.heads is not None:
        if args.model is not None:
            parser.error("argument --heads: not allowed with --model (give one head configuration)")
        if args.tp != 1:
            parser.error("argument --tp: applies to --model presets; give --heads per GPU instead")
        hq, hkv = args.heads
        return Shape(f"custom-{hq}x{hkv}-d{args.head_dim}", hq, hkv, args.head_dim)
    name = args.model or "llama3-8b"
    try:
        hq, hkv, d = MODELS[name].heads(args.tp)
    except ValueError as e:
        parser.error(f"argument --tp: {e}")
    return Shape(name if args.tp == 1 else f"{name}-tp{args.tp}", hq, hkv, d)


@dataclass(frozen=True)
class RunSettings:
    repeats: int
    warmup: int
    calls_per_replay: int
    host_calls: int
    quick: bool


def run_settings(args: argparse.Namespace) -> RunSettings:
    q = args.quick
    return RunSettings(
        repeats=args.repeats or (3 if q else 7),
        warmup=args.warmup if args.warmup is not None else (1 if q else 3),
        calls_per_replay=args.calls_per_replay or (10 if q else 20),
        host_calls=500 if q else 2000,
        quick=q,
    )


def calls_per_replay_for(kv_bytes: int, cap: int) -> int:
    """Calls per graph: about 2 ms of estimated work per replay, between 3 and ``cap``."""
    est_us = 3.0 + kv_bytes / 4.0e6  # ~4 TB/s plus a launch
    return max(min(3, cap), min(cap, math.ceil(2000.0 / est_us)))


# ---- rows, CSV, metadata --------------------------------------------------------------------
def make_row(impl: str, shape: Shape, batch: int, seqlen: int, dtype: str, page_size: int,
             time_us: float, p10_us: float, p90_us: float, kv_bytes: int, floor_us: float,
             max_rel_err: float, gpu: str, kv_dtype: str | None = None) -> dict[str, Any]:
    t = float(time_us)
    return {
        "impl": impl, "model": shape.model, "hq": shape.hq, "hkv": shape.hkv, "head_dim": shape.head_dim,
        "batch": int(batch), "seqlen": int(seqlen), "dtype": dtype, "kv_dtype": kv_dtype or dtype,
        "page_size": int(page_size), "time_us": t, "p10_us": float(p10_us), "p90_us": float(p90_us),
        "gbps": kv_bytes / t / 1e3 if t > 0 else math.nan,
        "pct_floor": 100.0 * floor_us / t if t > 0 and math.isfinite(floor_us) else math.nan,
        "max_rel_err": float(max_rel_err), "gpu": gpu,
    }


def kv_bytes_of(shape: Shape, batch: int, seqlen: int, dtype: str, kv_dtype: str | None = None) -> int:
    """K+V bytes a call must read (FP8: the codes and the float32 descales of every (request, KV head))."""
    if kv_dtype in KV_FORMATS:
        return 2 * batch * seqlen * shape.hkv * shape.head_dim * KV_FORMATS[kv_dtype].itemsize + 8 * batch * shape.hkv
    return 2 * batch * seqlen * shape.hkv * shape.head_dim * DTYPES[dtype].itemsize


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower() or "unknown"


def git_commit() -> str:
    env = os.environ.get("FDPP_GIT_COMMIT")
    if env:
        return env
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - metadata is best effort
        return None


def environment(device_id: int | None = 0) -> dict[str, Any]:
    """Machine and software description for the ``.meta.json`` sidecar (best effort; None where
    unknown). ``device_id=None``: no GPU queried."""
    import fdpp

    env: dict[str, Any] = {
        "fdpp_version": fdpp.__version__,
        "git_commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command_line": shlex.join([Path(sys.executable).name, "-m", "fdpp.bench", *sys.argv[1:]]),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "host": platform.node(),
        # what changes how fdpp launches (fdpp.launch), as set for this run
        "fdpp_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("FDPP_")},
    }
    cupy = _try(lambda: importlib.import_module("cupy"))
    env["cupy"] = getattr(cupy, "__version__", None)
    torch = _try(lambda: importlib.import_module("torch"))
    env["torch"] = getattr(torch, "__version__", None)
    if torch is not None:
        env["torch_cuda"] = _try(lambda: torch.version.cuda)
        env["cudnn"] = _try(lambda: torch.backends.cudnn.version())
    fi = _try(lambda: importlib.import_module("flashinfer"))
    env["flashinfer"] = getattr(fi, "__version__", None) if fi is not None else None
    if device_id is not None and cupy is not None:
        rt = cupy.cuda.runtime

        def ver(v: int) -> str:
            return f"{v // 1000}.{v % 1000 // 10}"

        props = _try(lambda: rt.getDeviceProperties(device_id)) or {}
        name = props.get("name", b"")
        env["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
        env["compute_capability"] = f"{props.get('major')}.{props.get('minor')}"
        env["sm_count"] = props.get("multiProcessorCount")
        env["l2_bytes"] = props.get("l2CacheSize")
        env["memory_bytes"] = props.get("totalGlobalMem")
        env["cuda_driver_api"] = _try(lambda: ver(rt.driverGetVersion()))
        env["cuda_runtime"] = _try(lambda: ver(rt.runtimeGetVersion()))
        env["nvidia_driver"] = _try(lambda: subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", str(device_id)],
            capture_output=True, text=True, timeout=15).stdout.strip() or None)
    return env


def write_results(rows: list[dict[str, Any]], out: Path, meta: dict[str, Any],
                  columns: Sequence[str] = COLUMNS) -> Path:
    """Write ``rows`` to ``out`` (CSV, ``columns`` in order) and ``meta`` to ``<out>.meta.json``."""
    import pandas as pd

    out.parent.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows, columns=list(columns))
    df.to_csv(out, index=False)
    meta_path = out.with_name(out.name + ".meta.json")
    meta_path.write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return meta_path


def _fmt_n(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def series_name(impl: str, page_size: Any) -> str:
    """``impl``, with `` p<page_size>`` for the paged implementations (one series per page size)."""
    page = int(page_size) if page_size == page_size else 0  # NaN-safe
    return f"{impl} p{page}" if "-paged" in impl and page else impl


def shuffled_table(rng: np.random.Generator, batch: int, pages_per_seq: int) -> np.ndarray:
    """Block table [batch, pages_per_seq] int32 over a pool of batch x pages_per_seq pages in a
    random order (a permutation): consecutive pages of a request are not neighbours in memory."""
    return rng.permutation(batch * pages_per_seq).astype(np.int32).reshape(batch, pages_per_seq)


def summary_table(rows: list[dict[str, Any]]) -> str:
    """time_us and % of floor per implementation (rows) and context length (columns), per batch."""
    import pandas as pd

    if not rows:
        return "(no rows)"
    df = pd.DataFrame(rows, columns=COLUMNS)
    df["impl"] = [series_name(i, p) for i, p in zip(df["impl"], df["page_size"], strict=True)]
    parts = []
    for b, sub in df.groupby("batch", sort=True):
        for col, fmt in (("time_us", "{:.2f}"), ("pct_floor", "{:.0f}")):
            t = sub.pivot_table(index="impl", columns="seqlen", values=col, aggfunc="first")
            t = t.rename(columns=_fmt_n)
            order = [i for i in (*IMPLS, "fdpp-emulator", "reference") if i in t.index]
            t = t.reindex(order + [i for i in t.index if i not in order])
            def cell(x: Any, f: str = fmt) -> str:
                return "" if pd.isna(x) else f.format(x)

            body = (t.map(cell) if hasattr(t, "map") else t.applymap(cell)).to_string()
            parts.append(f"B={b}  {col}\n{body}")
    return "\n\n".join(parts)


# ---- CPU emulator run -----------------------------------------------------------------------
def run_emulator(args: argparse.Namespace, shape: Shape, rs: RunSettings) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Time the NumPy split-KV emulator, the float64 reference and a NumPy streaming read (the CPU
    'floor') on small sizes; rows in the GPU schema with gpu='cpu-emulator'. With ``--page-size``
    > 0, the same K/V scattered into shuffled pages: ``fdpp-paged-emulator`` (the NumPy path of
    ``fdpp.paged_decode_attention``) and ``reference-paged`` rows."""
    from tqdm import tqdm

    seqlens = args.seqlens or list(EMULATOR_SEQLENS)
    batches = args.batch or [1]
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    gpu = "cpu-emulator"

    pts = [(b, n) for b in batches for n in seqlens]
    for b, n in tqdm(pts, desc="fdpp.bench --emulator", unit="point", file=sys.stderr):
        rows.extend(_emulate_point(args, shape, rs, b, n, rng))
    meta = {"mode": "emulator", "gpu": gpu, "page_sizes": list(args.page_size),
            "note": "NumPy on the CPU: 'floor' is np.bitwise_xor.reduce over the K and V bytes, "
                    "'fdpp-emulator' fdpp.reference.split_kv_emulator (chunk from the heuristic's split "
                    "count), 'reference' the float64 attention_reference; max_rel_err against it, full "
                    "batch and heads. Paged rows: the same K/V in pages of page_size tokens in a random "
                    "order (block table of shuffled page ids), 'fdpp-paged-emulator' = "
                    "fdpp.paged_decode_attention on NumPy arrays (the emulator without a GPU), "
                    "'reference-paged' = paged_attention_reference (max_rel_err: against 'reference')."}
    return rows, meta


def _emulate_point(args: argparse.Namespace, shape: Shape, rs: RunSettings, b: int, n: int,
                   rng: np.random.Generator) -> list[dict[str, Any]]:
    from fdpp.configs import SM90, DecodeProblem, default_config
    from fdpp.reference import attention_reference, max_rel_err, split_kv_emulator
    from fdpp.timing import time_cpu_calls

    dt = DTYPES[args.dtype]
    layout = args.kv_layout
    kvshape = (b, n, shape.hkv, shape.head_dim) if layout == "NHD" else (b, shape.hkv, n, shape.head_dim)
    kv = rng.standard_normal((2, *kvshape), dtype=np.float32).astype(dt.np_dtype)
    q = rng.standard_normal((b, shape.hq, shape.head_dim), dtype=np.float32).astype(dt.np_dtype)
    k, v = kv[0], kv[1]
    prob = DecodeProblem(b, shape.hq, shape.hkv, shape.head_dim, n, dt.name)
    chunk = max(1, math.ceil(n / default_config(prob, SM90).num_splits))
    nbytes = kv_bytes_of(shape, b, n, dt.name)
    words = kv.reshape(-1).view(np.uint8)[: nbytes - nbytes % 8].view(np.uint64)

    ref, _ = attention_reference(q, k, v, kv_layout=layout)
    kw = {"warmup": rs.warmup, "repeats": rs.repeats}
    t_floor = time_cpu_calls([lambda: np.bitwise_xor.reduce(words)], **kw)
    fl = t_floor.median_us
    timed = [("floor", 0, t_floor, math.nan)]
    if 0 in args.page_size:
        emu, _ = split_kv_emulator(q, k, v, kv_layout=layout, chunk=chunk)
        t_emu = time_cpu_calls([lambda: split_kv_emulator(q, k, v, kv_layout=layout, chunk=chunk)], **kw)
        t_ref = time_cpu_calls([lambda: attention_reference(q, k, v, kv_layout=layout)], **kw)
        timed += [("fdpp-emulator", 0, t_emu, max_rel_err(emu, ref)), ("reference", 0, t_ref, 0.0)]
    for page in (p for p in args.page_size if p):
        timed += _emulate_paged(q, k, v, ref, page, layout, kw)
    return [make_row(impl, shape, b, n, dt.name, page, t.median_us, t.p10_us, t.p90_us, nbytes, fl, err,
                     "cpu-emulator")
            for impl, page, t, err in timed]


def paged_copy(cache: np.ndarray, table: np.ndarray, page: int, kv_layout: str = "NHD") -> np.ndarray:
    """The page pool holding a contiguous cache [B, N, Hkv, D] (NHD; [B, Hkv, N, D] for HND) through
    ``table`` [B, ceil(N / page)]: pool [B x pages, page, Hkv, D] ([.., Hkv, page, D] for HND),
    token t of request r in page table[r, t // page] at slot t % page; slots past N are zero."""
    nhd = cache if kv_layout == "NHD" else cache.transpose(0, 2, 1, 3)
    b, n, hkv, d = nhd.shape
    pps = table.shape[1]
    padded = np.zeros((b, pps * page, hkv, d), dtype=cache.dtype)
    padded[:, :n] = nhd
    pool = np.empty((b * pps, page, hkv, d), dtype=cache.dtype)
    pool[table.reshape(-1)] = padded.reshape(b * pps, page, hkv, d)
    return pool if kv_layout == "NHD" else np.ascontiguousarray(pool.transpose(0, 2, 1, 3))


def _emulate_paged(q: np.ndarray, k: np.ndarray, v: np.ndarray, ref: np.ndarray, page: int, layout: str,
                   kw: dict[str, int]) -> list[tuple[str, int, Any, float]]:
    """(impl, page, timing, max_rel_err) of the paged emulator rows of one point (its own seeded
    permutation: the data of every point is the same whatever --page-size asks for)."""
    import warnings

    import fdpp
    from fdpp.reference import max_rel_err, paged_attention_reference
    from fdpp.timing import time_cpu_calls

    b, n = q.shape[0], k.shape[1] if layout == "NHD" else k.shape[2]
    table = shuffled_table(np.random.default_rng([b, n, page]), b, -(-n // page))
    kp, vp = paged_copy(k, table, page, layout), paged_copy(v, table, page, layout)
    lens = np.full(b, n, dtype=np.int32)

    def fd() -> Any:
        return fdpp.paged_decode_attention(q, kp, vp, table, lens, kv_layout=layout)

    def pref() -> Any:
        return paged_attention_reference(q, kp, vp, table, lens, kv_layout=layout)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "no GPU: the NumPy emulator" is the point here
        pr, out = pref()[0], fd()
        t_fd = time_cpu_calls([fd], **kw)
    t_ref = time_cpu_calls([pref], **kw)
    return [("fdpp-paged-emulator", page, t_fd, max_rel_err(out, pr)),
            ("reference-paged", page, t_ref, max_rel_err(pr, ref))]


# ---- GPU run --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Point:
    """One point of the sweep: batch, context length and cache (page 0 = contiguous)."""

    batch: int
    seqlen: int
    page: int = 0

    @property
    def key(self) -> str:
        return f"B{self.batch}_N{self.seqlen}" + (f"_P{self.page}" if self.page else "")

    @property
    def label(self) -> str:
        return f"B={self.batch} N={self.seqlen}" + (f" page={self.page}" if self.page else "")


@dataclass
class _Sets:
    """Rotated input sets of one point. ``store`` is one allocation [sets, 2, *kvshape]: contiguous
    caches, or page pools ([num_pages, page, Hkv, D] for NHD, [num_pages, Hkv, page, D] for HND)
    read through ``table``."""

    store: Any
    q: Any  # [sets, B, Hq, D]
    kind: str  # "torch" | "cupy"
    page: int = 0
    table: Any = None  # int32 [B, pages per request] on the device: shuffled pages, shared by the sets
    lens: Any = None  # int32 [B] on the device: every request at seqlen (paged)
    seqlen: int = 0

    def __len__(self) -> int:
        return int(self.store.shape[0])

    def k(self, i: int) -> Any:
        return self.store[i, 0]

    def v(self, i: int) -> Any:
        return self.store[i, 1]

    def ptr(self, i: int) -> int:
        x = self.store[i]
        return int(x.data_ptr()) if self.kind == "torch" else int(x.data.ptr)


@dataclass
class _Impl:
    calls: list[Callable[[], Any]]
    kind: str  # how fdpp.timing runs the calls: "cupy" (CuPy graphs) or "torch" (torch graphs)
    context: Callable[[], Any] = contextlib.nullcontext
    to_numpy: Callable[[Any], np.ndarray] | None = None  # result of calls[0]() -> [B, Hq, D]
    page_size: int = 0
    keep: Any = None  # objects the closures need alive (workspaces, planned wrappers)


def _same(x: Any) -> Any:
    return x


class _GpuBench:
    """State of one GPU benchmark run (imports, device, settings)."""

    def __init__(self, args: argparse.Namespace, shape: Shape, rs: RunSettings):
        import cupy

        self.cupy = cupy
        self.args, self.shape, self.rs = args, shape, rs
        self.dev = args.device
        cupy.cuda.Device(self.dev).use()
        self.dt = DTYPES[args.dtype]
        self.kv = KV_FORMATS.get(getattr(args, "kv_dtype", "same"))  # FP8 format, or None
        self.kv_name = self.kv.name if self.kv else None
        self.kv_itemsize = self.kv.itemsize if self.kv else self.dt.itemsize
        self.errors: dict[str, str] = {}  # impl -> first failure
        self.skipped: dict[str, str] = {}  # impl -> why not run at all
        self.torch = self._import_torch()
        if self.torch is None and self.kv is not None:
            raise SystemExit("fdpp.bench: --kv-dtype fp8_* needs torch (its FP8 tensors hold the codes)")
        if self.torch is None and self.dt.name == "bf16":
            raise SystemExit("fdpp.bench: --dtype bf16 needs torch (CuPy has no bfloat16 arrays)")
        mode = args.fdpp_arrays
        if mode == "auto":
            mode = "torch" if (self.torch is not None and self.dt.name == "bf16") else "cupy"
        if mode == "torch" and self.torch is None:
            raise SystemExit("fdpp.bench: --fdpp-arrays torch needs torch")
        if mode == "cupy" and self.dt.name == "bf16":
            raise SystemExit("fdpp.bench: --fdpp-arrays cupy cannot hold bf16; use torch")
        self.fdpp_arrays = mode
        from fdpp import registry
        from fdpp.timing import l2_bytes

        self.limits = registry.device_limits(self.dev)
        self.gpu = self.limits.name
        self.l2 = l2_bytes(self.dev)
        self.flashinfer = self._import_flashinfer()
        self.use_gpu_reference = True

    # -- optional peers
    def _import_torch(self) -> Any:
        try:
            import torch
        except ImportError:
            for i in ("torch-cudnn", "torch-flash"):
                self.skipped[i] = "torch not importable"
            return None
        if not torch.cuda.is_available():
            for i in ("torch-cudnn", "torch-flash"):
                self.skipped[i] = "torch sees no CUDA device"
            return None
        torch.cuda.set_device(self.dev)
        return torch

    def _import_flashinfer(self) -> Any:
        if self.torch is None:
            for i in ("flashinfer", "flashinfer-paged"):
                self.skipped[i] = "needs torch"
            return None
        try:
            import flashinfer
        except Exception as e:  # noqa: BLE001 - ImportError, or a broken install
            for i in ("flashinfer", "flashinfer-paged"):
                self.skipped[i] = f"not importable ({type(e).__name__}: {e})"[:200]
            return None
        return flashinfer

    # -- data
    def kvshape(self, b: int, n: int, page: int = 0) -> tuple[int, int, int, int]:
        """Shape of one K (or V): the cache [B, N, Hkv, D] / [B, Hkv, N, D], or with ``page`` the pool
        of B x ceil(N / page) pages."""
        s = self.shape
        rows, n = (b * -(-n // page), page) if page else (b, n)
        return (rows, n, s.hkv, s.head_dim) if self.args.kv_layout == "NHD" else (rows, s.hkv, n, s.head_dim)

    def free_bytes(self) -> int:
        self.release()
        return int(self.cupy.cuda.runtime.memGetInfo()[0])

    def release(self) -> None:
        self.cupy.get_default_memory_pool().free_all_blocks()
        if self.torch is not None:
            self.torch.cuda.empty_cache()

    def make_sets(self, b: int, n: int, sets: int, page: int = 0) -> _Sets:
        """``sets`` random input sets; with ``page``, page pools and one shuffled block table
        (:func:`shuffled_table`, seeded by the point) that every set and implementation uses."""
        kvs = self.kvshape(b, n, page)
        seed = 1234 + b * 7919 + n
        data = self._torch_sets(kvs, b, sets, seed) if self.torch is not None else \
            self._cupy_sets(kvs, b, sets, seed, -(-n // page) if page else 1)
        if page:
            table = shuffled_table(np.random.default_rng([b, n, page]), b, -(-n // page))
            data.page, data.seqlen = page, n
            data.table = self._device_int32(data.kind, table)
            data.lens = self._device_int32(data.kind, np.full(b, n, dtype=np.int32))
        return data

    def _torch_sets(self, kvs: tuple[int, ...], b: int, sets: int, seed: int) -> _Sets:
        torch, s = self.torch, self.shape
        tdt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[self.dt.name]
        g = torch.Generator(device=f"cuda:{self.dev}")
        g.manual_seed(seed)
        if self.kv is not None:  # FP8 codes of N(0, 1) data at descale FP8_DESCALE
            store = torch.empty((sets, 2, *kvs), dtype=getattr(torch, self.kv.torch_name), device=f"cuda:{self.dev}")
            for i in range(sets):
                for j in range(2):
                    x = torch.randn(kvs, dtype=torch.float16, device=f"cuda:{self.dev}", generator=g)
                    store[i, j].copy_((x * (1.0 / FP8_DESCALE)).to(store.dtype))
        else:
            store = torch.empty((sets, 2, *kvs), dtype=tdt, device=f"cuda:{self.dev}")
            for i in range(sets):  # per set: bounded temporaries
                store[i].normal_(generator=g)
        q = torch.randn((sets, b, s.hq, s.head_dim), dtype=tdt, device=f"cuda:{self.dev}", generator=g)
        torch.cuda.synchronize()
        return _Sets(store, q, "torch")

    def _cupy_sets(self, kvs: tuple[int, ...], b: int, sets: int, seed: int, step: int) -> _Sets:
        """CuPy inputs, ``step`` rows of the first K/V dim at a time (a request, or its pages): float32
        temporaries stay small."""
        cp, s, npdt = self.cupy, self.shape, self.dt.np_dtype
        rng = cp.random.default_rng(seed)
        store = cp.empty((sets, 2, *kvs), dtype=npdt)
        for i in range(sets):
            for j in range(2):
                for lo in range(0, kvs[0], step):
                    hi = min(kvs[0], lo + step)
                    store[i, j, lo:hi] = rng.standard_normal((hi - lo, *kvs[1:]), dtype=np.float32).astype(npdt)
        q = rng.standard_normal((sets, b, s.hq, s.head_dim), dtype=np.float32).astype(npdt)
        cp.cuda.runtime.deviceSynchronize()
        return _Sets(store, q, "cupy")

    def _device_int32(self, kind: str, x: np.ndarray) -> Any:
        if kind == "torch":
            return self.torch.from_numpy(np.ascontiguousarray(x, dtype=np.int32)).to(f"cuda:{self.dev}")
        return self.cupy.asarray(np.ascontiguousarray(x, dtype=np.int32))

    def to_numpy(self, x: Any) -> np.ndarray:
        if type(x).__module__.split(".")[0] == "torch":
            y = x.detach().float().cpu().numpy()
            return y * np.float32(FP8_DESCALE) if self._is_fp8(x) else y
        return self.cupy.asnumpy(x).astype(np.float32)

    def as_cupy(self, x: Any) -> Any:
        if type(x).__module__.split(".")[0] == "cupy":
            return x
        return self.cupy.asarray(x)  # __cuda_array_interface__: zero-copy view of torch memory

    # -- reference subset
    def picks(self, b: int) -> list[tuple[int, int]]:
        return sorted({(0, 0), (0, self.shape.hq - 1), (b - 1, 0), (b - 1, self.shape.hq - 1)})

    def kv_rows(self, sets: _Sets, bi: int, kvh: int) -> tuple[Any, Any]:
        """K and V of request ``bi``, KV head ``kvh`` in set 0 as [N, D] (paged: its pages gathered
        through the block table, in order, cut to N tokens)."""
        nhd = self.args.kv_layout == "NHD"
        if not sets.page:
            k0, v0 = sets.k(0), sets.v(0)
            return (k0[bi, :, kvh, :], v0[bi, :, kvh, :]) if nhd else (k0[bi, kvh], v0[bi, kvh])
        ids = sets.table[bi].long() if sets.kind == "torch" else sets.table[bi]

        def rows(pool: Any) -> Any:
            x = (pool[:, :, kvh, :] if nhd else pool[:, kvh])[ids]  # [pages, page, D]
            return x.reshape(-1, x.shape[-1])[:sets.seqlen]

        return rows(sets.k(0)), rows(sets.v(0))

    def reference(self, sets: _Sets, b: int) -> tuple[list[tuple[int, int]], np.ndarray]:
        """float64 reference of set 0 for the picked (batch row, q head) pairs: [picks, D].

        Computed with CuPy on the GPU where ``attention_reference`` takes CuPy arrays, else with
        NumPy on the CPU (slices copied to the host)."""
        from fdpp.reference import attention_reference

        picks = self.picks(b)
        r = self.shape.ratio
        groups: dict[tuple[int, int], list[int]] = {}
        for bi, h in picks:
            groups.setdefault((bi, h // r), []).append(h)
        refs: dict[tuple[int, int], np.ndarray] = {}
        q0 = sets.q[0]
        for (bi, kvh), hs in groups.items():
            ks, vs = self.kv_rows(sets, bi, kvh)
            qs = [q0[bi, h] for h in hs]
            out = None
            if self.use_gpu_reference:
                try:
                    cp = self.cupy
                    kc, vc = self.f32_cupy(ks), self.f32_cupy(vs)  # [N, D]
                    qc = cp.stack([self.f32_cupy(x) for x in qs])  # [len(hs), D]
                    o, _ = attention_reference(qc[None], kc[None, :, None, :], vc[None, :, None, :],
                                               kv_layout="NHD")
                    out = cp.asnumpy(o)
                except Exception as e:  # noqa: BLE001 - a NumPy-only reference: use the CPU
                    log.info("GPU reference unavailable (%s); computing it on the CPU", _reason(e))
                    self.use_gpu_reference = False
                    self.release()
            if out is None:
                kn, vn = self.to_numpy(ks), self.to_numpy(vs)  # [N, D]
                qn = np.stack([self.to_numpy(x) for x in qs])  # [len(hs), D]
                out, _ = attention_reference(qn[None], kn[None, :, None, :], vn[None, :, None, :],
                                             kv_layout="NHD")
            for j, h in enumerate(hs):
                refs[(bi, h)] = np.asarray(out)[0, j]
        return picks, np.stack([refs[p] for p in picks])

    def f32_cupy(self, x: Any) -> Any:
        """A float32 CuPy copy of a device array (torch or CuPy), for the reference (FP8 codes:
        dequantised, code * FP8_DESCALE)."""
        if type(x).__module__.split(".")[0] == "torch":
            y = x.float()
            return self.cupy.asarray((y * FP8_DESCALE if self._is_fp8(x) else y).contiguous()).copy()
        return x.astype(np.float32)

    def _is_fp8(self, x: Any) -> bool:
        return self.kv is not None and str(x.dtype).removeprefix("torch.") == self.kv.torch_name

    # -- implementations
    def build(self, impl: str, sets: _Sets, b: int, n: int) -> _Impl | None:
        """The timed calls of ``impl`` over ``sets`` (None: its library is missing)."""
        builders = {"fdpp": self._build_fdpp, "fdpp-nosplit": self._build_fdpp, "fdpp-paged": self._build_fdpp,
                    "fdpp-two-launch": self._build_fdpp, "fdpp-umax": self._build_fdpp, "fdpp-prefetch": self._build_fdpp,
                    "torch-cudnn": self._build_sdpa, "torch-flash": self._build_sdpa,
                    "flashinfer": self._build_flashinfer, "flashinfer-paged": self._build_flashinfer}
        if impl not in builders:
            raise ValueError(f"unknown implementation {impl!r}")
        return builders[impl](impl, sets, b, n)

    def _build_fdpp(self, impl: str, sets: _Sets, b: int, n: int) -> _Impl:
        """fdpp on CuPy views of the inputs (CuPy graphs) or on the torch tensors (torch graphs);
        ``fdpp-paged``: paged_decode_attention through the point's block table."""
        import fdpp

        layout, m = self.args.kv_layout, len(sets)
        if self.fdpp_arrays == "cupy":
            conv, empty, kind = self.as_cupy, self.cupy.empty_like, "cupy"
        else:
            conv, empty, kind = _same, self.torch.empty_like, "torch"
        kconv = conv
        kw: dict[str, Any] = {"kv_layout": layout}
        if self.kv is not None:  # FP8: CuPy sees the codes as uint8 and is told the format
            kw.update(kv_dtype=self.kv.name, k_descale=FP8_DESCALE, v_descale=FP8_DESCALE)
            if impl == "fdpp-nosplit":
                raise _Skip("the no-split baseline reads unquantised caches only")
            kconv = (lambda x: conv(x.view(self.torch.uint8))) if self.fdpp_arrays == "cupy" else conv
        qs = [conv(sets.q[i]) for i in range(m)]
        ks = [kconv(sets.k(i)) for i in range(m)]
        vs = [kconv(sets.v(i)) for i in range(m)]
        outs = [empty(x) for x in qs]
        if impl == "fdpp-umax":
            kw.update(softmax_mode="unified_max", unified_max=self._unified_max(sets))
        if impl == "fdpp-paged":
            table, lens = conv(sets.table), conv(sets.lens)

            def mk(i: int) -> Callable[[], Any]:
                q, k, v, o = qs[i], ks[i], vs[i], outs[i]
                return lambda: fdpp.paged_decode_attention(q, k, v, table, lens, out=o, **kw)
        elif impl == "fdpp-two-launch":
            from fdpp import dispatch

            forced = self._two_launch_plan(qs[0], ks[0], b, n)

            def mk(i: int) -> Callable[[], Any]:
                q, k, v, o = qs[i], ks[i], vs[i], outs[i]

                def call() -> Any:
                    with dispatch.forced_plan(forced):
                        return fdpp.decode_attention(q, k, v, out=o, **kw)
                return call
        elif impl == "fdpp-prefetch":
            from fdpp import launch

            def mk(i: int) -> Callable[[], Any]:
                q, k, v, o = qs[i], ks[i], vs[i], outs[i]

                def call() -> Any:  # records are keyed on the budget: this call gets its own
                    saved = launch.L2_PREFETCH_BYTES
                    launch.L2_PREFETCH_BYTES = saved or BENCH_PREFETCH_BYTES
                    try:
                        return fdpp.decode_attention(q, k, v, out=o, **kw)
                    finally:
                        launch.L2_PREFETCH_BYTES = saved
                return call
        else:
            fn = fdpp.decode_attention_nosplit if impl == "fdpp-nosplit" else fdpp.decode_attention

            def mk(i: int) -> Callable[[], Any]:
                q, k, v, o = qs[i], ks[i], vs[i], outs[i]
                return lambda: fn(q, k, v, out=o, **kw)

        return _Impl([mk(i) for i in range(m)], kind, to_numpy=self.to_numpy, page_size=sets.page)

    def _unified_max(self, sets: _Sets) -> float:
        """phi for ``fdpp-umax``: calibrated on request 0's first 4,096 tokens of set 0 (dequantised)."""
        import fdpp

        k = sets.k(0)[:1]
        k = k[:, :4096] if self.args.kv_layout == "NHD" else k[:, :, :4096]
        k = k.float() * (FP8_DESCALE if self.kv is not None else 1.0)
        return fdpp.calibrate_unified_max(sets.q[0][:1], k, kv_layout=self.args.kv_layout)

    def _two_launch_plan(self, q: Any, k: Any, b: int, n: int) -> Any:
        """The dispatcher's plan for this point, with its splits merged by a second launch."""
        from fdpp import dispatch, registry
        from fdpp.configs import DecodeProblem, LaunchPlan, combine_config

        hq, d = q.shape[1], q.shape[2]
        hkv = k.shape[2] if self.args.kv_layout == "NHD" else k.shape[1]
        prob = DecodeProblem(b, hq, hkv, d, n, self.args.dtype, self.kv_name or "")
        p = dispatch.select_plan(prob, registry.device_limits(self.args.device))
        return LaunchPlan.split_kv(dataclasses.replace(p.split, cluster=1), p.effective_splits(n),
                                   combine_config(prob.dtype, d, b * hq, registry.device_limits(self.args.device)),
                                   source="bench")

    def _build_sdpa(self, impl: str, sets: _Sets, b: int, n: int) -> _Impl | None:
        if self.torch is None:
            return None
        if self.kv is not None:
            raise _Skip("SDPA takes no FP8 K/V")
        from torch.nn.attention import SDPBackend, sdpa_kernel


        layout = self.args.kv_layout
        backend = SDPBackend.CUDNN_ATTENTION if impl == "torch-cudnn" else SDPBackend.FLASH_ATTENTION
        sdpa = self.torch.nn.functional.scaled_dot_product_attention

        def bhnd(x: Any) -> Any:  # [B, Hkv, N, D] view of the cache
            return x.transpose(1, 2) if layout == "NHD" else x

        def mk(i: int) -> Callable[[], Any]:
            q, k, v = sets.q[i].unsqueeze(2), bhnd(sets.k(i)), bhnd(sets.v(i))
            return lambda: sdpa(q, k, v, enable_gqa=True)

        return _Impl([mk(i) for i in range(len(sets))], "torch", lambda: sdpa_kernel([backend]),
                     to_numpy=lambda o: self.to_numpy(o.squeeze(2)))

    def _build_flashinfer(self, impl: str, sets: _Sets, b: int, n: int) -> _Impl | None:
        """``flashinfer``: single_decode_with_kv_cache at B=1, else the batch wrapper over the
        contiguous cache cut in FLASHINFER_PAGE-token pages in order; ``flashinfer-paged``: the
        batch wrapper over the point's page pool and shuffled block table."""
        if self.flashinfer is None:
            return None

        fi, torch, s, layout = self.flashinfer, self.torch, self.shape, self.args.kv_layout
        if impl == "flashinfer" and b == 1 and self.kv is None:  # FP8: the batch wrapper (its single decode
            def mk1(i: int) -> Callable[[], Any]:                  # faulted on FP8 caches, run E1)
                q, k, v = sets.q[i][0], sets.k(i)[0], sets.v(i)[0]
                return lambda: fi.single_decode_with_kv_cache(q, k, v, kv_layout=layout, use_tensor_cores=True)

            return _Impl([mk1(i) for i in range(len(sets))], "torch",
                         to_numpy=lambda o: self.to_numpy(o)[None])
        if impl == "flashinfer-paged":
            if layout != "NHD":
                raise _Skip("paged batch decode benchmarked only for NHD pages")
            return self._flashinfer_batch(sets, b, n, sets.page, sets.table.reshape(-1),
                                          lambda i: (sets.k(i), sets.v(i)))
        if layout != "NHD" or n % FLASHINFER_PAGE:
            raise _Skip(f"batch decode benchmarked only for NHD and N % {FLASHINFER_PAGE} == 0")
        page, per = FLASHINFER_PAGE, n // FLASHINFER_PAGE
        indices = torch.arange(b * per, dtype=torch.int32, device=sets.q.device)

        def pages(i: int) -> tuple[Any, Any]:
            return (sets.k(i).reshape(b * per, page, s.hkv, s.head_dim),
                    sets.v(i).reshape(b * per, page, s.hkv, s.head_dim))

        return self._flashinfer_batch(sets, b, n, page, indices, pages)

    def _flashinfer_batch(self, sets: _Sets, b: int, n: int, page: int, indices: Any,
                          kv: Callable[[int], tuple[Any, Any]]) -> _Impl:
        """BatchDecodeWithPagedKVCacheWrapper (tensor cores, NHD), planned once here, outside the
        timed calls: request r holds pages ``indices[r * P:(r + 1) * P]`` (P = ceil(n / page)) of
        the pool ``kv(i)`` = (K, V) [pages, page, Hkv, D], its last page ((n - 1) % page) + 1 tokens."""

        fi, torch, s = self.flashinfer, self.torch, self.shape
        tdev = sets.q.device
        ws = torch.empty(128 << 20, dtype=torch.uint8, device=tdev)
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        indptr = torch.arange(b + 1, dtype=torch.int32, device=tdev) * -(-n // page)
        last = torch.full((b,), (n - 1) % page + 1, dtype=torch.int32, device=tdev)
        wrapper.plan(indptr, indices, last, s.hq, s.hkv, s.head_dim, page,
                     q_data_type=sets.q.dtype, kv_data_type=sets.store.dtype)
        scales = {"k_scale": FP8_DESCALE, "v_scale": FP8_DESCALE} if self.kv is not None else {}

        def mk(i: int) -> Callable[[], Any]:
            q, cache = sets.q[i], kv(i)
            return lambda: wrapper.run(q, cache, **scales)

        return _Impl([mk(i) for i in range(len(sets))], "torch", to_numpy=self.to_numpy,
                     page_size=page, keep=(ws, wrapper, indptr, indices, last))

    def fdpp_plan(self, b: int, n: int, page: int = 0) -> str | None:
        def get() -> str:
            from fdpp import dispatch
            from fdpp.configs import DecodeProblem

            s = self.shape
            n_max = -(-n // page) * page if page else n
            prob = DecodeProblem(b, s.hq, s.hkv, s.head_dim, n_max, self.dt.name, self.kv_name or "", page)
            plan = dispatch.select_plan(prob, self.limits)
            return f"{plan.split.key} splits={plan.num_splits} ({plan.source})"
        return _try(get)


class _Skip(Exception):
    """An implementation does not apply to this point (not an error)."""


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def paged_name(impl: str) -> str:
    """The implementation run at paged points for ``impl`` (``fdpp`` -> ``fdpp-paged``), or ''."""
    return {"fdpp": "fdpp-paged", "flashinfer": "flashinfer-paged"}.get(impl, impl if impl in PAGED_IMPLS else "")


def wanted_impls(impls: Sequence[str], page: int) -> list[str]:
    """Timed implementations at a point (floor apart): the contiguous ones asked for, or at a paged
    point the paged ones asked for by name or by their contiguous name (fdpp -> fdpp-paged)."""
    if not page:
        return [i for i in IMPLS if i in impls and i != "floor"]
    asked = {paged_name(i) for i in impls}
    return [i for i in PAGED_IMPLS if i in asked]


class _Sweep:
    """One GPU sweep: its points run one at a time (:meth:`run_point`), the rows so far, and what
    went wrong, for the ``.meta.json`` sidecar (:meth:`meta`)."""

    def __init__(self, gb: _GpuBench, rs: RunSettings, points: list[_Point]) -> None:
        from fdpp.timing import STREAM_READ_VARIANTS

        self.gb, self.rs, self.points = gb, rs, points
        self.variants = STREAM_READ_VARIANTS[:2] if rs.quick else STREAM_READ_VARIANTS
        self.tkw = {"warmup": rs.warmup, "repeats": rs.repeats}
        impls = gb.args.impls
        self.wanted = {p.page: wanted_impls(impls, p.page) for p in points}
        self.rows: list[dict[str, Any]] = []
        self.flagged: list[str] = []
        self.plans: dict[str, Any] = {}
        self.rotation: dict[str, int] = {}
        self.skipped_points: list[str] = []
        self.fails: dict[str, int] = {}
        self.floors: dict[tuple[int, int], float] = {}  # (batch, seqlen) -> floor µs (timed once)
        self.timed_alone: dict[str, str] = {}  # point label -> why its implementations were timed one by one
        self.peak, self.peak_bytes = math.nan, 0

    def impls(self, page: int) -> list[str]:
        return [i for i in self.wanted[page] if i not in self.gb.skipped]

    def runs_per_point(self, pt: _Point) -> int:
        return len(self.impls(pt.page)) + 1

    def measure_peak(self) -> None:
        from fdpp import timing

        gb = self.gb
        self.peak_bytes = int(min(2 << 30, gb.free_bytes() * 0.25)) // 256 * 256
        try:
            self.peak = timing.stream_read_gbps(self.peak_bytes, device_id=gb.dev, variants=self.variants, **self.tkw)
            print(f"fdpp.bench: peak streaming read {self.peak:.0f} GB/s ({self.peak_bytes / 2**30:.2f} GiB, "
                  f"best of {len(self.variants)} stream_read variants)", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - time the attention anyway; floor columns become NaN
            gb.errors["floor"] = f"peak read: {_reason(e)}"
            print(f"fdpp.bench: the streaming-read kernel failed ({_reason(e)}); floor and pct_floor will be "
                  "missing", file=sys.stderr)
            log.debug("%s", traceback.format_exc())

    def record(self, impl: str, pt: _Point, t: Any, nbytes: int, floor_us: float, err: float, page: int) -> None:
        from tqdm import tqdm

        dt = self.gb.dt
        self.rows.append(make_row(impl, self.gb.shape, pt.batch, pt.seqlen, dt.name, page, t.median_us, t.p10_us,
                                  t.p90_us, nbytes, floor_us, err, self.gb.gpu, self.gb.kv_name))
        if not (err <= dt.rtol) and not math.isnan(err):
            msg = f"{impl} {pt.label}: max_rel_err {err:.3g} > {dt.name} tolerance {dt.rtol:g}"
            self.flagged.append(msg)
            tqdm.write(f"fdpp.bench: WARNING {msg}", file=sys.stderr)

    def fail(self, impl: str, pt: _Point, e: BaseException) -> None:
        from tqdm import tqdm

        self.fails[impl] = self.fails.get(impl, 0) + 1
        if impl not in self.gb.errors:
            self.gb.errors[impl] = f"{pt.label}: {_reason(e)}"
            tqdm.write(f"fdpp.bench: {impl} failed at {pt.label}: {_reason(e)}", file=sys.stderr)
            log.debug("%s", traceback.format_exc())

    def inputs(self, pt: _Point) -> tuple[_Sets, int, int]:
        """The point's rotated sets (enough to exceed 4 x L2, within free memory), K+V bytes read
        per call and calls per graph replay."""
        gb, s, dt = self.gb, self.gb.shape, self.gb.dt
        nbytes = kv_bytes_of(s, pt.batch, pt.seqlen, dt.name, gb.kv_name)
        kv = 2 * math.prod(gb.kvshape(pt.batch, pt.seqlen, pt.page)) * gb.kv_itemsize
        set_bytes = kv + 2 * pt.batch * s.hq * s.head_dim * dt.itemsize
        sets = rotation_sets(set_bytes, gb.l2, gb.free_bytes())
        if sets < 1:
            raise _Skip(f"{set_bytes / 2**30:.1f} GiB of inputs > {MEM_FRACTION:.0%} of free memory")
        self.rotation[pt.key] = sets
        return gb.make_sets(pt.batch, pt.seqlen, sets, pt.page), nbytes, calls_per_replay_for(nbytes, self.rs.calls_per_replay)

    def floor(self, pt: _Point, data: _Sets, nbytes: int, cpr: int) -> float:
        """Floor µs of the point's K+V bytes: timed (and a row written) once per (batch, seqlen),
        on the first point's sets; paged points of the same size reuse it."""
        from fdpp import timing

        key = (pt.batch, pt.seqlen)
        if key not in self.floors:
            self.floors[key] = math.nan
            try:  # reads the K/V store of each set (FP8: nbytes also counts the descales, not in the store)
                read = min(nbytes, 2 * math.prod(self.gb.kvshape(pt.batch, pt.seqlen)) * self.gb.kv_itemsize)
                t = timing.time_stream_read(read, ptrs=[data.ptr(i) for i in range(len(data))],
                                            variants=self.variants, device_id=self.gb.dev, calls_per_replay=cpr,
                                            **self.tkw)
                if read < nbytes:  # the descales' share, at the same bandwidth
                    t = timing.Timing.from_samples([x * nbytes / read for x in t.samples])
                self.floors[key] = t.median_us
                self.record("floor", pt, t, nbytes, t.median_us, math.nan, 0)
            except Exception as e:  # noqa: BLE001 - the rows of this point get pct_floor = NaN
                self.fails["floor"] = self.fails.get("floor", 0) + 1
                self.gb.errors.setdefault("floor", f"{pt.label}: {_reason(e)}")
        return self.floors[key]

    def run_point(self, pt: _Point, bar: Any) -> None:
        from tqdm import tqdm

        gb = self.gb
        data, nbytes, cpr = self.inputs(pt)
        floor_us = self.floor(pt, data, nbytes, cpr)
        bar.update(1)
        try:
            picks, ref = gb.reference(data, pt.batch)
        except Exception as e:  # noqa: BLE001 - time anyway; the rows get max_rel_err = NaN
            picks, ref = [], None
            tqdm.write(f"fdpp.bench: reference failed at {pt.label}: {_reason(e)}", file=sys.stderr)
        impls = self.impls(pt.page)
        if {"fdpp", "fdpp-paged"} & set(impls):
            self.plans[pt.key] = gb.fdpp_plan(pt.batch, pt.seqlen, pt.page)
        checked = []
        for impl in impls:
            c = self.check_impl(impl, pt, data, picks, ref)
            if c is not None:
                checked.append(c)
            bar.update(1)
        for (impl, spec, err), t in zip(checked, self.time_impls(pt, checked, cpr), strict=True):
            if t is not None:
                self.record(impl, pt, t, nbytes, floor_us, err, spec.page_size)

    def check_impl(self, impl: str, pt: _Point, data: _Sets, picks: list[tuple[int, int]],
                   ref: np.ndarray | None) -> tuple[str, _Impl, float] | None:
        """(impl, its calls, max_rel_err of one eager call on set 0 against the reference); None
        when it is skipped or fails (noted)."""
        from fdpp.reference import max_rel_err

        try:
            spec = self.gb.build(impl, data, pt.batch, pt.seqlen)
            if spec is None:
                return None
            with spec.context():
                out = spec.calls[0]()
                err = math.nan
                if ref is not None:
                    got = spec.to_numpy(out)
                    err = max_rel_err(np.stack([got[p] for p in picks]), ref)
                del out
            return impl, spec, err
        except _Skip as e:
            self.gb.skipped.setdefault(impl, str(e))
        except Exception as e:  # noqa: BLE001 - one failing peer must not end the sweep
            self.fail(impl, pt, e)
        return None

    def time_impls(self, pt: _Point, checked: list[tuple[str, _Impl, float]], cpr: int) -> list[Any]:
        """Timings of the checked implementations, interleaved round by round on one stream
        (:func:`fdpp.timing.time_round_robin`: a slow phase of the GPU hits every one alike); if
        that fails, each alone, so that only the one that cannot be captured loses its row (None)."""
        from fdpp import timing

        got, why = timing.time_interleaved([(s.calls, s.kind, s.context) for _, s, _ in checked],
                                           calls_per_replay=cpr, **self.tkw)
        if why is not None:
            self.timed_alone[pt.label] = why  # the .meta.json says which points were not interleaved
        out: list[Any] = []
        for (impl, _, _), t in zip(checked, got, strict=True):
            if isinstance(t, Exception):  # one failing peer must not end the sweep
                self.fail(impl, pt, t)
                t = None
            out.append(t)
        return out

    def run(self, checkpoint: Callable[[list[dict[str, Any]], str], None] | None) -> None:
        """Every point in turn; a point that cannot run (out of memory, …) is skipped and noted."""
        from tqdm import tqdm

        gb = self.gb
        bar = tqdm(total=sum(self.runs_per_point(p) for p in self.points), desc="fdpp.bench", unit="run",
                   file=sys.stderr, mininterval=2.0)
        for pt in self.points:
            bar.set_postfix_str(f"B={pt.batch} N={_fmt_n(pt.seqlen)}" + (f" p{pt.page}" if pt.page else ""))
            left = bar.n + self.runs_per_point(pt)
            try:
                self.run_point(pt, bar)
            except Exception as e:  # noqa: BLE001 - out of memory, a broken input set: skip the point
                msg = f"{pt.label}: {_reason(e)}"
                self.skipped_points.append(msg)
                tqdm.write(f"fdpp.bench: skipping point {msg}", file=sys.stderr)
                log.debug("%s", traceback.format_exc())
                bar.update(max(0, left - bar.n))
            gb.release()
            if checkpoint is not None:
                try:
                    checkpoint(self.rows, gb.gpu)
                except OSError as e:
                    log.warning("could not write the partial CSV: %s", e)
        bar.close()

    def eager(self) -> None:
        from fdpp.timing import host_call_us

        try:
            self.rows.extend(_eager_rows(self.gb, self.rs, host_call_us, self.variants, self.tkw,
                                         record_flag=self.flagged))
        except Exception as e:  # noqa: BLE001 - keep the sweep's rows
            self.gb.errors.setdefault("eager", _reason(e))
            print(f"fdpp.bench: eager host-cost rows failed: {_reason(e)}", file=sys.stderr)
            log.debug("%s", traceback.format_exc())

    def meta(self) -> dict[str, Any]:
        gb, args = self.gb, self.gb.args
        wanted = {i for v in self.wanted.values() for i in v}
        return {
            "mode": "gpu",
            "gpu_name": gb.gpu,
            "peak_read_gbps": self.peak,
            "peak_read_bytes": self.peak_bytes,
            "stream_read_variants": [dataclasses.asdict(v) | {"key": v.key} for v in self.variants],
            "fdpp_arrays": gb.fdpp_arrays,
            "kv_layout": args.kv_layout,
            "page_sizes": list(args.page_size),
            "settings": dataclasses.asdict(self.rs),
            "rotation_sets": self.rotation,
            "rotation_rule": f"sets = ceil({ROTATE_FACTOR} x L2 / set bytes), at most {MAX_SETS} and "
                             f"{MEM_FRACTION:.0%} of free memory",
            "method": "CUDA graph of max(calls_per_replay, sets) calls cycling over the rotated sets, one per "
                      "implementation; the implementations of a point timed interleaved on one stream "
                      "(fdpp.timing.time_round_robin: warm-up rounds, then `repeats` rounds, each timing every "
                      "implementation once with CUDA events, each starting one implementation later); "
                      "time = replay / calls. "
                      "calls_per_replay ~ 2 ms of work per replay, 3..cap. fdpp with CuPy arrays: CuPy graph "
                      "capture; torch tensors, torch peers and FlashInfer: torch.cuda.CUDAGraph.",
            "floor": "kernels_cu/stream_read.cu reading the same K/V storage as each point's sets (best "
                     "variant per point; timed once per batch and seqlen, paged rows share it); pct_floor = "
                     "floor time / time * 100; gbps = K+V bytes / time (the tokens, not whole pages)",
            "reference_check": "eager call on set 0; float64 attention_reference (CuPy on the GPU, else "
                               "NumPy on the CPU) for (batch row, q head) in {0, B-1} x {0, Hq-1}; "
                               "max_rel_err = max|out-ref| / max|ref|; paged points: the request's pages "
                               "gathered through the block table",
            "reference_on_gpu": gb.use_gpu_reference,
            "tolerance_rtol": gb.dt.rtol,
            "flagged": self.flagged,
            "fdpp_plans": self.plans,
            "skipped_impls": {i: why for i, why in gb.skipped.items() if i in wanted or i not in PAGED_IMPLS},
            "failed_impls": gb.errors,
            "failed_counts": self.fails,
            "skipped_points": self.skipped_points,
            "timed_alone": self.timed_alone,
            "page_size_note": "0 = contiguous cache; flashinfer batch rows (B > 1) view it as pages of "
                              f"{FLASHINFER_PAGE} in order. Paged points (--page-size): pools of ceil(N / "
                              "page) pages per request in a random order (one seeded permutation per "
                              "point, shared by its rotated sets and by fdpp-paged and flashinfer-paged: "
                              "FlashInfer's plan() holds one block table), every request at N tokens",
        }


def rotation_sets(set_bytes: int, l2: int, free: int) -> int:
    """Input sets of ``set_bytes`` to rotate: 4 x L2 over them (at most MAX_SETS), within
    MEM_FRACTION of ``free`` device memory (0: not even one fits)."""
    from fdpp.timing import rotation_count

    sets = rotation_count(set_bytes, l2, factor=ROTATE_FACTOR, max_sets=MAX_SETS)
    return min(sets, int(free * MEM_FRACTION // set_bytes))


def run_gpu(args: argparse.Namespace, shape: Shape, rs: RunSettings,
            checkpoint: Callable[[list[dict[str, Any]], str], None] | None = None,
            ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The attention sweep on the GPU; ``checkpoint(rows, gpu_name)`` is called after each point."""
    gb = _GpuBench(args, shape, rs)
    points = [_Point(b, n, page) for b in (args.batch or [1, 8]) for n in (args.seqlens or list(DEFAULT_SEQLENS))
              for page in args.page_size]
    sweep = _Sweep(gb, rs, points)
    print(f"fdpp.bench: {gb.gpu}, L2 {gb.l2 / 2**20:.0f} MiB, {shape.model} (Hq={shape.hq}, Hkv={shape.hkv}, "
          f"D={shape.head_dim}), {gb.dt.name}, {args.kv_layout}; fdpp arrays: {gb.fdpp_arrays}", file=sys.stderr)
    wanted = {i for v in sweep.wanted.values() for i in v}
    for i, why in gb.skipped.items():
        if i in wanted:
            print(f"fdpp.bench: skipping {i}: {why}", file=sys.stderr)
    sweep.measure_peak()
    sweep.run(checkpoint)
    if "eager" in args.impls:
        sweep.eager()
    for i, why in gb.errors.items():
        print(f"fdpp.bench: {i} failed at {sweep.fails.get(i, 1)} point(s) (first: {why}); those rows are missing",
              file=sys.stderr)
    return sweep.rows, sweep.meta()


#: Rounds of the eager rows' round-robin timing (one ``host_call_us`` sample per candidate each).
EAGER_ROUNDS = 5


def _eager_rows(gb: _GpuBench, rs: RunSettings, host_call_us: Callable[..., float], variants: Any,
                tkw: dict[str, Any], record_flag: list[str]) -> list[dict[str, Any]]:
    """Host cost of one eager call at B=1, N=1k: fdpp (and fdpp with torch tensors when fdpp ran on
    CuPy views) and torch SDPA cuDNN. time_us = median of :data:`EAGER_ROUNDS` measurements of
    ``host_call_us`` taken round-robin over the candidates, p10/p90 = their min/max."""
    import fdpp
    from fdpp.reference import max_rel_err
    from fdpp.timing import Timing, time_stream_read

    b, n = EAGER_POINT
    shape, dt = gb.shape, gb.dt
    nbytes = kv_bytes_of(shape, b, n, dt.name)
    data = gb.make_sets(b, n, 1)
    picks, ref = gb.reference(data, b)
    # its own rotated buffers (cold L2), like every other floor row
    try:
        floor_us = time_stream_read(nbytes, variants=variants, device_id=gb.dev, max_sets=MAX_SETS,
                                    **tkw).median_us
    except Exception:  # noqa: BLE001 - reported by the sweep already
        floor_us = math.nan
    layout = gb.args.kv_layout
    cands: list[tuple[str, Callable[[], Any], Callable[[], Any], Callable[[Any], np.ndarray]]] = []
    q, k, v = data.q[0], data.k(0), data.v(0)
    if gb.fdpp_arrays == "cupy":
        cq, ck, cv = gb.as_cupy(q), gb.as_cupy(k), gb.as_cupy(v)
        cands.append(("fdpp-eager", lambda: fdpp.decode_attention(cq, ck, cv, kv_layout=layout),
                      contextlib.nullcontext, gb.to_numpy))
    if gb.torch is not None:
        name = "fdpp-eager" if gb.fdpp_arrays == "torch" else "fdpp-eager-torch"
        cands.append((name, lambda: fdpp.decode_attention(q, k, v, kv_layout=layout),
                      contextlib.nullcontext, gb.to_numpy))
    cands += _host_path_cands(gb, q, k, v, layout)
    if gb.torch is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa = gb.torch.nn.functional.scaled_dot_product_attention
        qt = q.unsqueeze(2)
        kt, vt = (k.transpose(1, 2), v.transpose(1, 2)) if layout == "NHD" else (k, v)
        cands.append(("torch-cudnn-eager", lambda: sdpa(qt, kt, vt, enable_gqa=True),
                      lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), lambda o: gb.to_numpy(o.squeeze(2))))
    live, errs = [], {}
    for name, fn, ctx, conv in cands:  # each candidate checked once against the reference
        try:
            with ctx():
                got = conv(fn())
                errs[name] = max_rel_err(np.stack([got[p] for p in picks]), ref)
            live.append((name, fn, ctx))
        except Exception as e:  # noqa: BLE001
            gb.errors.setdefault(name, _reason(e))
            print(f"fdpp.bench: {name} failed: {_reason(e)}", file=sys.stderr)
    # then timed round-robin, each round starting one candidate later: a slow phase of the host
    # (clock ramp, a neighbour's load) or the warm-up of the first rows hits every candidate alike
    samples: dict[str, list[float]] = {name: [] for name, _, _ in live}
    for r in range(EAGER_ROUNDS):
        for i in range(len(live)):
            name, fn, ctx = live[(i + r) % len(live)]
            if name not in samples:
                continue
            try:
                with ctx():
                    samples[name].append(host_call_us(fn, rs.host_calls))
            except Exception as e:  # noqa: BLE001
                gb.errors.setdefault(name, _reason(e))
                print(f"fdpp.bench: {name} failed: {_reason(e)}", file=sys.stderr)
                del samples[name]
    rows = []
    for name, _, _ in live:
        got_us = samples.get(name)
        if not got_us:
            continue
        t = Timing(float(np.median(got_us)), min(got_us), max(got_us), tuple(got_us))
        rows.append(make_row(name, shape, b, n, dt.name, 0, t.median_us, t.p10_us, t.p90_us, nbytes,
                             floor_us, errs[name], gb.gpu))
        if errs[name] > dt.rtol:
            record_flag.append(f"{name} B={b} N={n}: max_rel_err {errs[name]:.3g} > {dt.rtol:g}")
    del data
    gb.release()
    return rows


def _host_path_cands(gb: _GpuBench, q: Any, k: Any, v: Any, layout: str) -> list[tuple]:
    """Eager host-cost candidates of the host fast path (issue: eager calls faster than cuDNN's):
    plan/run on CuPy and torch arrays, fdpp's other launchers, FlashInfer's single decode and
    (flat_gemm's eager cost: ``python -m fdpp.bench gemm --eager``)."""
    import fdpp

    b, hq, d = (int(x) for x in q.shape)
    n = int(k.shape[1] if layout == "NHD" else k.shape[2])
    hkv = int(k.shape[2] if layout == "NHD" else k.shape[1])
    plan = fdpp.DecodePlan(b, hq, hkv, d, n, dtype=gb.dt.name, kv_layout=layout)
    out: list[tuple] = []
    if gb.fdpp_arrays == "cupy":
        cq, ck, cv = gb.as_cupy(q), gb.as_cupy(k), gb.as_cupy(v)
        out.append(("fdpp-plan-run", lambda: plan.run(cq, ck, cv), contextlib.nullcontext, gb.to_numpy))
        for var in host_variants():  # the same calls launched another way (a fresh plan: it keeps its launch)
            vplan = fdpp.DecodePlan(b, hq, hkv, d, n, dtype=gb.dt.name, kv_layout=layout)
            ctx = functools.partial(host_variant, var)
            out.append((f"fdpp-eager-{var}", lambda: fdpp.decode_attention(cq, ck, cv, kv_layout=layout), ctx,
                        gb.to_numpy))
            out.append((f"fdpp-plan-run-{var}", lambda p=vplan: p.run(cq, ck, cv), ctx, gb.to_numpy))
    if gb.torch is not None:
        out.append(("fdpp-plan-run-torch", lambda: plan.run(q, k, v), contextlib.nullcontext, gb.to_numpy))
    if gb.flashinfer is not None and b == 1:
        fi = gb.flashinfer
        out.append(("flashinfer-eager", lambda: fi.single_decode_with_kv_cache(q[0], k[0], v[0], kv_layout=layout,
                                                                               use_tensor_cores=True),
                    contextlib.nullcontext, lambda o: gb.to_numpy(o[None])))
    return out


def host_variants() -> list[str]:
    """The launch paths the eager rows compare besides the default (:mod:`fdpp.launch`): PDL off
    and the kernel launched by each of :data:`fdpp.launch.LAUNCHERS` ("plain-<launcher>"; with
    PDL on, every launch is ``cuda.bindings``' ``cuLaunchKernelEx`` whatever the launcher)."""
    from fdpp import launch

    return [f"plain-{name}" for name in launch.LAUNCHERS]


@contextlib.contextmanager
def host_variant(var: str) -> Any:
    """Launch as :func:`host_variants`' ``var`` says inside the block ("pdl": the default PDL
    launch). A launch record keys on :data:`fdpp.launch.PDL` (so PDL off finds its own) and reads
    the launcher at each launch."""
    from fdpp import launch

    old = launch.PDL, launch.LAUNCHER
    if var.startswith("plain-"):
        launch.PDL, launch.LAUNCHER = frozenset(), var[len("plain-"):]
    elif var != "pdl":
        raise ValueError(f"unknown host variant {var!r}: pdl or one of {', '.join(host_variants())}")
    try:
        yield
    finally:
        launch.PDL, launch.LAUNCHER = old


# ---- entry point ----------------------------------------------------------------------------
def _run_gemm(rest: list[str]) -> int:
    try:
        mod = importlib.import_module("fdpp.bench_gemm")
    except ModuleNotFoundError as e:
        if e.name not in ("fdpp.bench_gemm", "fdpp"):
            raise
        print("fdpp.bench gemm: the flat-GEMM benchmark (fdpp/bench_gemm.py) is not part of this checkout",
              file=sys.stderr)
        return 2
    return int(mod.main(rest) or 0)


def default_out(shape: Shape, dtype: str, gpu: str, args: argparse.Namespace | None = None) -> Path:
    """results/attn_<model>_<dtype>[_<kv>][_p<pages>][_hnd]_<gpu>.csv: runs of another KV format,
    page sizes or layout get files of their own instead of overwriting the plain run's."""
    parts = [f"attn_{slug(shape.model)}", dtype]
    if args is not None:
        kv = getattr(args, "kv_dtype", "same")
        if kv == "int4":
            parts.append(f"int4g{args.int4_group}")
        elif kv != "same":
            parts.append(kv)
        pages = list(getattr(args, "page_size", [0]))
        if pages != [0]:
            parts.append("p" + "-".join(map(str, pages)))
        if getattr(args, "kv_layout", "NHD") == "HND":
            parts.append("hnd")
    return Path("results") / ("_".join([*parts, slug(gpu)]) + ".csv")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "gemm":
        return _run_gemm(argv[1:])
    if argv and argv[0] == "e2e":
        from fdpp import bench_e2e

        return int(bench_e2e.main(argv[1:]) or 0)
    if not argv or argv[0] not in ("attn", "-h", "--help"):
        argv = ["attn", *argv]
    top, p = build_parser()
    args = top.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    shape = resolve_shape(args, p)
    if args.emulator and args.kv_dtype != "same":
        p.error(f"argument --kv-dtype: --emulator times caches in q's dtype only, got {args.kv_dtype!r}")
    if args.kv_dtype == "int4" and args.dtype != "fp16":  # found only once a GPU was, before
        p.error("argument --dtype: --kv-dtype int4 rows run fp16 q (bf16 q works in the API)")
    if args.emulator and args.impls is not None:
        p.error("argument --impls: --emulator times its own rows (fdpp-emulator, reference, floor)")
    if args.emulator:
        most = max(args.batch or [1]) * max(args.seqlens or EMULATOR_SEQLENS) * shape.hkv * shape.head_dim * 2 * 8
        if most > EMULATOR_MAX_BYTES:  # the float64 reference holds K and V: a MemoryError traceback otherwise
            p.error(f"argument --seqlens/--batch: --emulator runs on the CPU; its largest point needs "
                    f"{most / 2**30:.1f} GiB for the float64 reference's K and V (at most "
                    f"{EMULATOR_MAX_BYTES >> 30} GiB): pick smaller sizes, or time on a GPU")
    if args.impls is None:
        args.impls = list(SELECTABLE)
    check_out(p, args.out)
    rs = run_settings(args)

    if args.kv_dtype == "int4" and not args.emulator:
        from fdpp import bench_int4
        from fdpp.api import gpu_available

        if not gpu_available():
            print("fdpp.bench --kv-dtype int4: no GPU found", file=sys.stderr)
            return EXIT_NO_GPU
        rows, meta = bench_int4.run(args, shape, rs)
        env = environment(args.device)
        gpu = meta.get("gpu_name") or "gpu"
    elif args.emulator:
        rows, meta = run_emulator(args, shape, rs)
        env = environment(None)
        gpu = "cpu-emulator"
    else:
        from fdpp.api import gpu_available

        if not gpu_available():
            print("fdpp.bench: no GPU found (CuPy sees no CUDA device), so nothing can be timed. Run it on "
                  "a CUDA machine, or pass --emulator to time the NumPy emulator on small sizes.",
                  file=sys.stderr)
            return EXIT_NO_GPU
        def checkpoint(partial: list[dict[str, Any]], gpu_name: str) -> None:
            """After each point: the rows so far, so a run cut short still leaves a CSV."""
            path = args.out or default_out(shape, args.dtype, gpu_name, args)
            write_results(partial, path, {"partial": True, "command_line": shlex.join(sys.argv)})

        rows, meta = run_gpu(args, shape, rs, checkpoint)
        env = environment(args.device)
        gpu = meta.get("gpu_name") or env.get("gpu") or "gpu"

    out = args.out or default_out(shape, args.dtype, gpu, args)
    meta = {**env, "model": shape.model, "hq": shape.hq, "hkv": shape.hkv, "head_dim": shape.head_dim,
            "dtype": args.dtype, "columns": COLUMNS, "rows": len(rows), **meta}
    try:
        meta_path = write_results(rows, out, meta)
    except OSError as e:
        print(f"fdpp.bench: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(summary_table(rows))
    print(f"\nfdpp.bench: wrote {out} ({len(rows)} rows) and {meta_path}")
    flagged = meta.get("flagged") or []
    if flagged:
        print(f"fdpp.bench: {len(flagged)} row(s) over the {args.dtype} tolerance:\n  " + "\n  ".join(flagged))
        if args.strict:
            return EXIT_FLAGGED
    return 0


if __name__ == "__main__":
    sys.exit(main())
