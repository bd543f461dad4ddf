"""``python -m fdpp.bench``: decode-attention latency against the memory floor and the peers.

Subcommands: ``attn`` (the default when none is given) and ``gemm`` (``fdpp.bench_gemm``).

For every (batch, context length) point the attention benchmark makes random inputs, rotated over
enough sets to exceed 4x the L2 (``fdpp.timing.rotation_count``), then times each implementation
by CUDA-graph replay in this one process:

- ``fdpp``          fdpp.decode_attention, the dispatcher's plan (tuned table or heuristic)
- ``fdpp-nosplit``  fdpp.decode_attention_nosplit (one CTA per query head, no sequence split)
- ``floor``         the stream_read kernel reading the same K and V bytes (fdpp.timing)
- ``torch-cudnn``   torch SDPA, cuDNN backend, enable_gqa=True (when torch imports)
- ``torch-flash``   torch SDPA, flash backend, enable_gqa=True (when torch imports)
- ``flashinfer``    single_decode_with_kv_cache at B=1, BatchDecodeWithPagedKVCacheWrapper
                    (page 16, NHD) otherwise (when flashinfer imports)

and, at B=1, N=1k, the host cost of one eager call: ``fdpp-eager`` and ``torch-cudnn-eager``.
Rows go to a long-format CSV (``COLUMNS``) with a ``.meta.json`` sidecar describing the machine and
the run (rewritten after every point, so a run cut short still leaves its rows); ``python -m
fdpp.plot`` draws them.

Examples::

    python -m fdpp.bench --model llama3-8b --batch 1,8            # 1k..256k, all implementations
    python -m fdpp.bench --model llama3-70b --tp 8 --batch 1      # one GPU's share of a TP-8 model
    python -m fdpp.bench --heads 32/8 --head-dim 128 --seqlens 1k..64k --impls fdpp,floor --quick
    python -m fdpp.bench --emulator                               # no GPU: the NumPy emulator
    python -m fdpp.plot results/attn_llama3-8b_fp16_nvidia-h200.csv

Correctness: each implementation's output is checked once per point, from an eager call on the
first input set, against the float64 ``fdpp.reference.attention_reference`` (CuPy on the GPU, or
NumPy on the CPU where the reference takes only NumPy) for a subset: batch rows {0, B-1} x query
heads {0, Hq-1}, so the first and last KV head and request are covered (the full float64 reference
of a 256k-token batch would not fit). ``max_rel_err`` is that check; rows over the dtype's rtol are
flagged on stderr, in the sidecar's ``flagged`` list and, with ``--strict``, in the exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
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
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fdpp.configs import HEAD_DIMS
from fdpp.dtypes import DTYPES
from fdpp.models import MODELS

log = logging.getLogger("fdpp.bench")

COLUMNS = ["impl", "model", "hq", "hkv", "head_dim", "batch", "seqlen", "dtype", "kv_dtype", "page_size",
           "time_us", "p10_us", "p90_us", "gbps", "pct_floor", "max_rel_err", "gpu"]
IMPLS = ("fdpp", "fdpp-nosplit", "floor", "torch-cudnn", "torch-flash", "flashinfer")
SELECTABLE = (*IMPLS, "eager")
DEFAULT_SEQLENS = tuple(1024 << i for i in range(9))  # 1k .. 256k
EMULATOR_SEQLENS = (256, 1024, 4096)
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
                if lo < 1 or hi < lo:
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
            f"like 1k..256k") from None
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


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return v


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The top-level parser and the ``attn`` subparser."""
    top = argparse.ArgumentParser(
        prog="python -m fdpp.bench",
        description="Benchmarks against the memory floor and the peers. 'attn' (decode attention) is "
                    "the default subcommand; see 'python -m fdpp.bench attn --help'.")
    sub = top.add_subparsers(dest="command", metavar="{attn,gemm}")
    p = sub.add_parser(
        "attn", help="decode attention latency vs context length (default)",
        description="Time decode attention (fdpp, its no-split baseline, the streaming-read floor, "
                    "PyTorch SDPA cuDNN/flash and FlashInfer when importable) over context lengths and "
                    "batch sizes; write a long-format CSV and a .meta.json sidecar.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub.add_parser("gemm", help="flat GEMM benchmark (fdpp.bench_gemm; its own flags)", add_help=False)

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
                        "1k..256k; default 1k..256k (256,1k,4k with --emulator)")
    g.add_argument("--batch", type=parse_batches, default=None, metavar="LIST",
                   help="batch sizes, comma list; default 1,8 (1 with --emulator)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="fp16", help="q/K/V/out element type")
    g.add_argument("--kv-layout", choices=("NHD", "HND"), default="NHD",
                   help="KV cache layout: [B,N,Hkv,D] (NHD) or [B,Hkv,N,D] (HND); the same storage is "
                        "given to every implementation")

    r = p.add_argument_group("run")
    r.add_argument("--impls", type=parse_impls, default=list(SELECTABLE), metavar="LIST",
                   help=f"implementations to run, comma list of {', '.join(SELECTABLE)} ('eager' = the "
                        "host-cost rows); floor always runs; unavailable peers are skipped")
    r.add_argument("--out", type=Path, default=None,
                   help="CSV path (default results/attn_<model>_<dtype>_<gpu>.csv)")
    r.add_argument("--repeats", type=_positive, default=None, help="timed graph replays per point (default 7, "
                   "3 with --quick)")
    r.add_argument("--warmup", type=int, default=None, help="untimed replays (default 3, 1 with --quick)")
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
             max_rel_err: float, gpu: str) -> dict[str, Any]:
    t = float(time_us)
    return {
        "impl": impl, "model": shape.model, "hq": shape.hq, "hkv": shape.hkv, "head_dim": shape.head_dim,
        "batch": int(batch), "seqlen": int(seqlen), "dtype": dtype, "kv_dtype": dtype,
        "page_size": int(page_size), "time_us": t, "p10_us": float(p10_us), "p90_us": float(p90_us),
        "gbps": kv_bytes / t / 1e3 if t > 0 else math.nan,
        "pct_floor": 100.0 * floor_us / t if t > 0 and math.isfinite(floor_us) else math.nan,
        "max_rel_err": float(max_rel_err), "gpu": gpu,
    }


def kv_bytes_of(shape: Shape, batch: int, seqlen: int, dtype: str) -> int:
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


def summary_table(rows: list[dict[str, Any]]) -> str:
    """time_us and % of floor per implementation (rows) and context length (columns), per batch."""
    import pandas as pd

    if not rows:
        return "(no rows)"
    df = pd.DataFrame(rows, columns=COLUMNS)
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
    'floor') on small sizes; rows in the GPU schema with gpu='cpu-emulator'."""
    from tqdm import tqdm

    seqlens = args.seqlens or list(EMULATOR_SEQLENS)
    batches = args.batch or [1]
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    gpu = "cpu-emulator"

    pts = [(b, n) for b in batches for n in seqlens]
    for b, n in tqdm(pts, desc="fdpp.bench --emulator", unit="point", file=sys.stderr):
        rows.extend(_emulate_point(args, shape, rs, b, n, rng))
    meta = {"mode": "emulator", "gpu": gpu,
            "note": "NumPy on the CPU: 'floor' is np.bitwise_xor.reduce over the K and V bytes, "
                    "'fdpp-emulator' fdpp.reference.split_kv_emulator (chunk from the heuristic's split "
                    "count), 'reference' the float64 attention_reference; max_rel_err against it, full "
                    "batch and heads."}
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
    emu, _ = split_kv_emulator(q, k, v, kv_layout=layout, chunk=chunk)
    kw = {"warmup": rs.warmup, "repeats": rs.repeats}
    t_floor = time_cpu_calls([lambda: np.bitwise_xor.reduce(words)], **kw)
    t_emu = time_cpu_calls([lambda: split_kv_emulator(q, k, v, kv_layout=layout, chunk=chunk)], **kw)
    t_ref = time_cpu_calls([lambda: attention_reference(q, k, v, kv_layout=layout)], **kw)
    fl = t_floor.median_us
    return [make_row(impl, shape, b, n, dt.name, 0, t.median_us, t.p10_us, t.p90_us, nbytes, fl, err,
                     "cpu-emulator")
            for impl, t, err in (("floor", t_floor, math.nan),
                                 ("fdpp-emulator", t_emu, max_rel_err(emu, ref)),
                                 ("reference", t_ref, 0.0))]


# ---- GPU run --------------------------------------------------------------------------------
@dataclass
class _Sets:
    """Rotated input sets of one point. ``store`` is one allocation [sets, 2, *kvshape]."""

    store: Any
    q: Any  # [sets, B, Hq, D]
    kind: str  # "torch" | "cupy"

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
    timer: Callable[..., Any]
    context: Callable[[], Any] = contextlib.nullcontext
    to_numpy: Callable[[Any], np.ndarray] | None = None  # result of calls[0]() -> [B, Hq, D]
    page_size: int = 0
    keep: Any = None  # objects the closures need alive (workspaces, planned wrappers)


class _GpuBench:
    """State of one GPU benchmark run (imports, device, settings)."""

    def __init__(self, args: argparse.Namespace, shape: Shape, rs: RunSettings):
        import cupy

        self.cupy = cupy
        self.args, self.shape, self.rs = args, shape, rs
        self.dev = args.device
        cupy.cuda.Device(self.dev).use()
        self.dt = DTYPES[args.dtype]
        self.errors: dict[str, str] = {}  # impl -> first failure
        self.skipped: dict[str, str] = {}  # impl -> why not run at all
        self.torch = self._import_torch()
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
            self.skipped["flashinfer"] = "needs torch"
            return None
        try:
            import flashinfer
        except Exception as e:  # noqa: BLE001 - ImportError, or a broken install
            self.skipped["flashinfer"] = f"not importable ({type(e).__name__}: {e})"[:200]
            return None
        return flashinfer

    # -- data
    def kvshape(self, b: int, n: int) -> tuple[int, int, int, int]:
        s = self.shape
        return (b, n, s.hkv, s.head_dim) if self.args.kv_layout == "NHD" else (b, s.hkv, n, s.head_dim)

    def free_bytes(self) -> int:
        self.release()
        return int(self.cupy.cuda.runtime.memGetInfo()[0])

    def release(self) -> None:
        self.cupy.get_default_memory_pool().free_all_blocks()
        if self.torch is not None:
            self.torch.cuda.empty_cache()

    def make_sets(self, b: int, n: int, sets: int) -> _Sets:
        kvs = self.kvshape(b, n)
        s = self.shape
        if self.torch is not None:
            torch = self.torch
            tdt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[self.dt.name]
            g = torch.Generator(device=f"cuda:{self.dev}")
            g.manual_seed(1234 + b * 7919 + n)
            store = torch.empty((sets, 2, *kvs), dtype=tdt, device=f"cuda:{self.dev}")
            for i in range(sets):  # per set: bounded temporaries
                store[i].normal_(generator=g)
            q = torch.randn((sets, b, s.hq, s.head_dim), dtype=tdt, device=f"cuda:{self.dev}", generator=g)
            torch.cuda.synchronize()
            return _Sets(store, q, "torch")
        cp = self.cupy
        rng = cp.random.default_rng(1234 + b * 7919 + n)
        store = cp.empty((sets, 2, *kvs), dtype=self.dt.np_dtype)
        for i in range(sets):
            for j in range(2):
                for bb in range(b):  # one request at a time: float32 temporaries stay small
                    store[i, j, bb] = rng.standard_normal(kvs[1:], dtype=np.float32).astype(self.dt.np_dtype)
        q = rng.standard_normal((sets, b, s.hq, s.head_dim), dtype=np.float32).astype(self.dt.np_dtype)
        cp.cuda.runtime.deviceSynchronize()
        return _Sets(store, q, "cupy")

    def to_numpy(self, x: Any) -> np.ndarray:
        if type(x).__module__.split(".")[0] == "torch":
            return x.detach().float().cpu().numpy()
        return self.cupy.asnumpy(x).astype(np.float32)

    def as_cupy(self, x: Any) -> Any:
        if type(x).__module__.split(".")[0] == "cupy":
            return x
        return self.cupy.asarray(x)  # __cuda_array_interface__: zero-copy view of torch memory

    # -- reference subset
    def picks(self, b: int) -> list[tuple[int, int]]:
        return sorted({(0, 0), (0, self.shape.hq - 1), (b - 1, 0), (b - 1, self.shape.hq - 1)})

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
        k0, v0, q0 = sets.k(0), sets.v(0), sets.q[0]
        for (bi, kvh), hs in groups.items():
            if self.args.kv_layout == "NHD":
                ks, vs = k0[bi, :, kvh, :], v0[bi, :, kvh, :]
            else:
                ks, vs = k0[bi, kvh], v0[bi, kvh]
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
        """A float32 CuPy copy of a device array (torch or CuPy), for the reference."""
        if type(x).__module__.split(".")[0] == "torch":
            return self.cupy.asarray(x.float().contiguous()).copy()
        return x.astype(np.float32)

    # -- implementations
    def build(self, impl: str, sets: _Sets, b: int, n: int) -> _Impl | None:
        from fdpp.timing import time_calls, time_torch_calls

        layout = self.args.kv_layout
        m = len(sets)
        if impl in ("fdpp", "fdpp-nosplit"):
            import fdpp

            fn = fdpp.decode_attention if impl == "fdpp" else fdpp.decode_attention_nosplit
            if self.fdpp_arrays == "cupy":
                qs = [self.as_cupy(sets.q[i]) for i in range(m)]
                ks = [self.as_cupy(sets.k(i)) for i in range(m)]
                vs = [self.as_cupy(sets.v(i)) for i in range(m)]
                outs = [self.cupy.empty_like(x) for x in qs]
                timer = time_calls
            else:
                qs = [sets.q[i] for i in range(m)]
                ks = [sets.k(i) for i in range(m)]
                vs = [sets.v(i) for i in range(m)]
                outs = [self.torch.empty_like(x) for x in qs]
                timer = time_torch_calls

            def mk(i: int) -> Callable[[], Any]:
                q, k, v, o = qs[i], ks[i], vs[i], outs[i]
                return lambda: fn(q, k, v, kv_layout=layout, out=o)

            return _Impl([mk(i) for i in range(m)], timer, to_numpy=self.to_numpy)

        if impl in ("torch-cudnn", "torch-flash"):
            if self.torch is None:
                return None
            torch = self.torch
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = SDPBackend.CUDNN_ATTENTION if impl == "torch-cudnn" else SDPBackend.FLASH_ATTENTION
            sdpa = torch.nn.functional.scaled_dot_product_attention

            def bhnd(x: Any) -> Any:  # [B, Hkv, N, D] view of the cache
                return x.transpose(1, 2) if layout == "NHD" else x

            def mk(i: int) -> Callable[[], Any]:
                q, k, v = sets.q[i].unsqueeze(2), bhnd(sets.k(i)), bhnd(sets.v(i))
                return lambda: sdpa(q, k, v, enable_gqa=True)

            return _Impl([mk(i) for i in range(m)], time_torch_calls, lambda: sdpa_kernel([backend]),
                         to_numpy=lambda o: self.to_numpy(o.squeeze(2)))

        if impl == "flashinfer":
            if self.flashinfer is None:
                return None
            fi, torch = self.flashinfer, self.torch
            s = self.shape
            if b == 1:
                def mk1(i: int) -> Callable[[], Any]:
                    q, k, v = sets.q[i][0], sets.k(i)[0], sets.v(i)[0]
                    return lambda: fi.single_decode_with_kv_cache(q, k, v, kv_layout=layout, use_tensor_cores=True)

                return _Impl([mk1(i) for i in range(m)], time_torch_calls,
                             to_numpy=lambda o: self.to_numpy(o)[None])
            if layout != "NHD" or n % FLASHINFER_PAGE:
                raise _Skip(f"batch decode benchmarked only for NHD and N % {FLASHINFER_PAGE} == 0")
            page = FLASHINFER_PAGE
            per = n // page
            tdev = sets.q.device
            ws = torch.empty(128 << 20, dtype=torch.uint8, device=tdev)
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
            indptr = torch.arange(b + 1, dtype=torch.int32, device=tdev) * per
            indices = torch.arange(b * per, dtype=torch.int32, device=tdev)
            last = torch.full((b,), page, dtype=torch.int32, device=tdev)
            wrapper.plan(indptr, indices, last, s.hq, s.hkv, s.head_dim, page,
                         q_data_type=sets.q.dtype, kv_data_type=sets.q.dtype)

            def mkb(i: int) -> Callable[[], Any]:
                q = sets.q[i]
                kv = (sets.k(i).reshape(b * per, page, s.hkv, s.head_dim),
                      sets.v(i).reshape(b * per, page, s.hkv, s.head_dim))
                return lambda: wrapper.run(q, kv)

            return _Impl([mkb(i) for i in range(m)], time_torch_calls, to_numpy=self.to_numpy, page_size=page,
                         keep=(ws, wrapper, indptr, indices, last))
        raise ValueError(f"unknown implementation {impl!r}")

    def fdpp_plan(self, b: int, n: int) -> str | None:
        def get() -> str:
            from fdpp import dispatch
            from fdpp.configs import DecodeProblem

            s = self.shape
            plan = dispatch.select_plan(DecodeProblem(b, s.hq, s.hkv, s.head_dim, n, self.dt.name), self.limits)
            return f"{plan.split.key} splits={plan.num_splits} ({plan.source})"
        return _try(get)


class _Skip(Exception):
    """An implementation does not apply to this point (not an error)."""


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def run_gpu(args: argparse.Namespace, shape: Shape, rs: RunSettings,
            checkpoint: Callable[[list[dict[str, Any]], str], None] | None = None,
            ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The attention sweep on the GPU; ``checkpoint(rows, gpu_name)`` is called after each point."""
    from tqdm import tqdm

    from fdpp.reference import max_rel_err
    from fdpp.timing import (
        STREAM_READ_VARIANTS,
        host_call_us,
        rotation_count,
        stream_read_gbps,
        time_stream_read,
    )

    gb = _GpuBench(args, shape, rs)
    dt = gb.dt
    batches = args.batch or [1, 8]
    seqlens = args.seqlens or list(DEFAULT_SEQLENS)
    wanted = [i for i in IMPLS if i in args.impls and i != "floor"]
    run_impls = [i for i in wanted if i not in gb.skipped]
    variants = STREAM_READ_VARIANTS[:2] if rs.quick else STREAM_READ_VARIANTS
    tkw = {"warmup": rs.warmup, "repeats": rs.repeats}

    print(f"fdpp.bench: {gb.gpu}, L2 {gb.l2 / 2**20:.0f} MiB, {shape.model} (Hq={shape.hq}, Hkv={shape.hkv}, "
          f"D={shape.head_dim}), {dt.name}, {args.kv_layout}; fdpp arrays: {gb.fdpp_arrays}", file=sys.stderr)
    for i, why in gb.skipped.items():
        if i in wanted:
            print(f"fdpp.bench: skipping {i}: {why}", file=sys.stderr)

    peak_bytes = int(min(2 << 30, gb.free_bytes() * 0.25)) // 256 * 256
    try:
        peak = stream_read_gbps(peak_bytes, device_id=gb.dev, variants=variants, **tkw)
        print(f"fdpp.bench: peak streaming read {peak:.0f} GB/s ({peak_bytes / 2**30:.2f} GiB, best of "
              f"{len(variants)} stream_read variants)", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - time the attention anyway; floor columns become NaN
        peak = math.nan
        gb.errors["floor"] = f"peak read: {_reason(e)}"
        print(f"fdpp.bench: the streaming-read kernel failed ({_reason(e)}); floor and pct_floor will be "
              "missing", file=sys.stderr)
        log.debug("%s", traceback.format_exc())

    rows: list[dict[str, Any]] = []
    flagged: list[str] = []
    plans: dict[str, Any] = {}
    rotation: dict[str, int] = {}
    skipped_points: list[str] = []
    tol = dt.rtol
    points = [(b, n) for b in batches for n in seqlens]
    bar = tqdm(total=len(points) * (len(run_impls) + 1), desc="fdpp.bench", unit="run", file=sys.stderr,
               mininterval=2.0)

    def record(impl: str, b: int, n: int, t: Any, nbytes: int, floor_us: float, err: float, page: int) -> None:
        rows.append(make_row(impl, shape, b, n, dt.name, page, t.median_us, t.p10_us, t.p90_us, nbytes,
                             floor_us, err, gb.gpu))
        if not (err <= tol) and not math.isnan(err):
            msg = f"{impl} B={b} N={n}: max_rel_err {err:.3g} > {dt.name} tolerance {tol:g}"
            flagged.append(msg)
            tqdm.write(f"fdpp.bench: WARNING {msg}", file=sys.stderr)

    def run_point(b: int, n: int) -> None:
        nbytes = kv_bytes_of(shape, b, n, dt.name)
        set_bytes = nbytes + 2 * b * shape.hq * shape.head_dim * dt.itemsize
        free = gb.free_bytes()
        sets = rotation_count(set_bytes, gb.l2, factor=ROTATE_FACTOR, max_sets=MAX_SETS)
        sets = min(sets, int(free * MEM_FRACTION // set_bytes))
        if sets < 1:
            raise _Skip(f"{set_bytes / 2**30:.1f} GiB of inputs > {MEM_FRACTION:.0%} of free memory")
        rotation[f"B{b}_N{n}"] = sets
        cpr = calls_per_replay_for(nbytes, rs.calls_per_replay)
        data = gb.make_sets(b, n, sets)
        floor_us = math.nan
        try:
            floor = time_stream_read(nbytes, ptrs=[data.ptr(i) for i in range(sets)], variants=variants,
                                     device_id=gb.dev, calls_per_replay=cpr, **tkw)
            floor_us = floor.median_us
            record("floor", b, n, floor, nbytes, floor_us, math.nan, 0)
        except Exception as e:  # noqa: BLE001 - the rows of this point get pct_floor = NaN
            fails["floor"] = fails.get("floor", 0) + 1
            gb.errors.setdefault("floor", f"B={b} N={n}: {_reason(e)}")
        bar.update(1)
        try:
            picks, ref = gb.reference(data, b)
        except Exception as e:  # noqa: BLE001 - time anyway; the rows get max_rel_err = NaN
            picks, ref = None, None
            tqdm.write(f"fdpp.bench: reference failed at B={b} N={n}: {_reason(e)}", file=sys.stderr)
        if "fdpp" in run_impls:
            plans[f"B{b}_N{n}"] = gb.fdpp_plan(b, n)
        for impl in run_impls:
            spec = None
            try:
                spec = gb.build(impl, data, b, n)
                if spec is None:
                    continue
                with spec.context():
                    out = spec.calls[0]()
                    err = math.nan
                    if ref is not None:
                        got = spec.to_numpy(out)
                        err = max_rel_err(np.stack([got[p] for p in picks]), ref)
                    del out
                    t = spec.timer(spec.calls, calls_per_replay=cpr, **tkw)
                record(impl, b, n, t, nbytes, floor_us, err, spec.page_size)
            except _Skip as e:
                gb.skipped.setdefault(impl, str(e))
            except Exception as e:  # noqa: BLE001 - one failing peer must not end the sweep
                fails[impl] = fails.get(impl, 0) + 1
                if impl not in gb.errors:
                    gb.errors[impl] = f"B={b} N={n}: {_reason(e)}"
                    tqdm.write(f"fdpp.bench: {impl} failed at B={b} N={n}: {_reason(e)}", file=sys.stderr)
                    log.debug("%s", traceback.format_exc())
            finally:
                del spec
                bar.update(1)

    fails: dict[str, int] = {}
    for b, n in points:
        bar.set_postfix_str(f"B={b} N={_fmt_n(n)}")
        done = len(rows)
        try:
            run_point(b, n)
        except Exception as e:  # noqa: BLE001 - out of memory, a broken input set: skip the point
            msg = f"B={b} N={n}: {_reason(e)}"
            skipped_points.append(msg)
            tqdm.write(f"fdpp.bench: skipping point {msg}", file=sys.stderr)
            log.debug("%s", traceback.format_exc())
            bar.update(max(0, len(run_impls) + 1 - (len(rows) - done)))
        gb.release()
        if checkpoint is not None:
            try:
                checkpoint(rows, gb.gpu)
            except OSError as e:
                log.warning("could not write the partial CSV: %s", e)
    bar.close()

    if "eager" in args.impls:
        try:
            rows.extend(_eager_rows(gb, rs, host_call_us, variants, tkw, record_flag=flagged))
        except Exception as e:  # noqa: BLE001 - keep the sweep's rows
            gb.errors.setdefault("eager", _reason(e))
            print(f"fdpp.bench: eager host-cost rows failed: {_reason(e)}", file=sys.stderr)
            log.debug("%s", traceback.format_exc())

    meta = {
        "mode": "gpu",
        "gpu_name": gb.gpu,
        "peak_read_gbps": peak,
        "peak_read_bytes": peak_bytes,
        "stream_read_variants": [dataclasses.asdict(v) | {"key": v.key} for v in variants],
        "fdpp_arrays": gb.fdpp_arrays,
        "kv_layout": args.kv_layout,
        "settings": dataclasses.asdict(rs),
        "rotation_sets": rotation,
        "rotation_rule": f"sets = ceil({ROTATE_FACTOR} x L2 / set bytes), at most {MAX_SETS} and "
                         f"{MEM_FRACTION:.0%} of free memory",
        "method": "CUDA graph of max(calls_per_replay, sets) calls cycling over the rotated sets; "
                  "warm-up replays, then `repeats` replays timed with CUDA events; time = replay / calls. "
                  "calls_per_replay ~ 2 ms of work per replay, 3..cap. fdpp with CuPy arrays: CuPy graph "
                  "capture; torch tensors, torch peers and FlashInfer: torch.cuda.CUDAGraph.",
        "floor": "kernels_cu/stream_read.cu reading the same K/V storage as each point's sets (best "
                 "variant per point); pct_floor = floor time / time * 100; gbps = K+V bytes / time",
        "reference_check": "eager call on set 0; float64 attention_reference (CuPy on the GPU, else "
                           "NumPy on the CPU) for (batch row, q head) in {0, B-1} x {0, Hq-1}; "
                           "max_rel_err = max|out-ref| / max|ref|",
        "reference_on_gpu": gb.use_gpu_reference,
        "tolerance_rtol": tol,
        "flagged": flagged,
        "fdpp_plans": plans,
        "skipped_impls": gb.skipped,
        "failed_impls": gb.errors,
        "failed_counts": fails,
        "skipped_points": skipped_points,
        "page_size_note": "0 = contiguous cache; flashinfer batch rows use its paged layout",
    }
    for i, why in gb.errors.items():
        print(f"fdpp.bench: {i} failed at {fails.get(i, 1)} point(s) (first: {why}); those rows are missing",
              file=sys.stderr)
    return rows, meta


def _eager_rows(gb: _GpuBench, rs: RunSettings, host_call_us: Callable[..., float], variants: Any,
                tkw: dict[str, Any], record_flag: list[str]) -> list[dict[str, Any]]:
    """Host cost of one eager call at B=1, N=1k: fdpp (and fdpp with torch tensors when fdpp ran on
    CuPy views) and torch SDPA cuDNN. time_us = median of 3 measurements of ``host_call_us``,
    p10/p90 = their min/max."""
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
    if gb.torch is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa = gb.torch.nn.functional.scaled_dot_product_attention
        qt = q.unsqueeze(2)
        kt, vt = (k.transpose(1, 2), v.transpose(1, 2)) if layout == "NHD" else (k, v)
        cands.append(("torch-cudnn-eager", lambda: sdpa(qt, kt, vt, enable_gqa=True),
                      lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), lambda o: gb.to_numpy(o.squeeze(2))))
    rows = []
    for name, fn, ctx, conv in cands:
        try:
            with ctx():
                got = conv(fn())
                err = max_rel_err(np.stack([got[p] for p in picks]), ref)
                samples = [host_call_us(fn, rs.host_calls) for _ in range(3)]
            t = Timing(float(np.median(samples)), min(samples), max(samples), tuple(samples))
            rows.append(make_row(name, shape, b, n, dt.name, 0, t.median_us, t.p10_us, t.p90_us, nbytes,
                                 floor_us, err, gb.gpu))
            if err > dt.rtol:
                record_flag.append(f"{name} B={b} N={n}: max_rel_err {err:.3g} > {dt.rtol:g}")
        except Exception as e:  # noqa: BLE001
            gb.errors.setdefault(name, _reason(e))
            print(f"fdpp.bench: {name} failed: {_reason(e)}", file=sys.stderr)
    del data
    gb.release()
    return rows


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


def default_out(shape: Shape, dtype: str, gpu: str) -> Path:
    return Path("results") / f"attn_{slug(shape.model)}_{dtype}_{slug(gpu)}.csv"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "gemm":
        return _run_gemm(argv[1:])
    if not argv or argv[0] not in ("attn", "-h", "--help"):
        argv = ["attn", *argv]
    top, p = build_parser()
    args = top.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    shape = resolve_shape(args, p)
    rs = run_settings(args)

    if args.emulator:
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
            path = args.out or default_out(shape, args.dtype, gpu_name)
            write_results(partial, path, {"partial": True, "command_line": shlex.join(sys.argv)})

        rows, meta = run_gpu(args, shape, rs, checkpoint)
        env = environment(args.device)
        gpu = meta.get("gpu_name") or env.get("gpu") or "gpu"

    out = args.out or default_out(shape, args.dtype, gpu)
    meta = {**env, "model": shape.model, "hq": shape.hq, "hkv": shape.hkv, "head_dim": shape.head_dim,
            "dtype": args.dtype, "columns": COLUMNS, "rows": len(rows), **meta}
    meta_path = write_results(rows, out, meta)
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
