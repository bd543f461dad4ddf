"""Flat GEMM for decode-phase linear layers: ``y = x @ w.T (+ bias)`` with M = batch = 1..64.

What the GEMM op contributes to the engine the attention ops run on (the package's one-way data flow):

- **configs, plans, search space and heuristic**: :mod:`fdpp.gemm_configs` (plain Python; the
  names are re-exported here).
- **table entries** (:class:`GemmBucket`, :class:`GemmEntry`, :data:`GEMM_OP`): read, checked,
  layered (shipped ``tuning/<GPU>_gemm.json``, then the user's in ``$FDPP_TUNING_DIR`` or the user
  cache dir) and written (locked, atomic, merged) by :mod:`fdpp.tables`, in its file format::

    {"schema": 1, "op": "flat_gemm", "device": {"name": "NVIDIA H200", "cc": [9, 0], "sm_count": 132},
     "kernel_hashes": {"flat_gemm.cu": "…"}, "params": ["impl", "block_n", …, "grid"], …,
     "entries": {"fp16.n6144.k4096.m8": {"bucket": {"dtype": "fp16", "n": 6144, "k": 4096, "m": 8, "wfmt": ""},
                                         "plan": {"impl": "tma", "num_warps": 8, …, "grid": 128},
                                         "sources": {"flat_gemm.cu": "…"}, "time_us": 12.1,
                                         "cublas_us": 15.6, "alternatives": {…}}, …}}

  M is bucketed up to a power of two (1, 2, 4, ..., 64); ``m_tiles`` / ``m_max`` (x rows a
  variant holds) always follow the actual M, so an entry serves any M of its bucket. Lookup
  (:class:`GemmTable`): exact bucket, else the nearest bucket of the same (dtype, N, K) whose plan
  fits M, else the heuristic. cuBLAS entries carry the ``flat_gemm.cu`` hash too: they were chosen
  against those kernels' times.
- **dispatch** (:func:`choose`): a plan forced with :func:`fdpp.dispatch.forced_plan`, else the
  tables, else :func:`heuristic_plan`, memoised in a :class:`fdpp.dispatch.PlanMemo`;
  :func:`explain` says which and why.
- **public call** :func:`flat_gemm`: validation (TypeError/ValueError naming the argument),
  NumPy/CuPy/torch arrays, a launch record per call signature (the attention records' key parts,
  :func:`fdpp.plan.launch_env`), scratch from :mod:`fdpp.workspace`, launch through
  :mod:`fdpp.registry` / :mod:`fdpp.launch`.

The tuner is :mod:`fdpp.gemm_tune` (it imports this module; this module never imports it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import struct
import threading
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from fdpp import dispatch, tables
from fdpp import launch as _launch
from fdpp import plan as _plan
from fdpp import workspace as _ws
from fdpp.configs import SM80, SM90, DeviceLimits
from fdpp.dtypes import get_dtype
from fdpp.gemm_configs import (
    GEMM_DTYPES,
    GEMV_M,
    M_BUCKETS,
    MAX_M,
    SOURCE,
    FlatGemmConfig,
    FlatTmaConfig,
    GemmConfigAsDtype,
    GemmPlan,
    GemvConfig,
    KernelCfg,
    _plan_wfmt,
    compile_space,
    flat_space,
    gemv_space,
    heuristic_plan,
    iterations,
    m_bucket,
    m_max_for,
    m_tiles_for,
    tma_space,
    workspace_floats,
)

log = logging.getLogger("fdpp.gemm")

@dataclass(frozen=True, order=True)
class GemmBucket:
    """What a table entry serves: x's dtype, N, K, the M bucket (:func:`m_bucket`) and the weight
    format (``""`` 16-bit weights in x's dtype, ``"e4m3"`` FP8 codes with a row scale)."""

    dtype: str
    n: int
    k: int
    m: int
    wfmt: str = ""

    @property
    def key(self) -> str:
        """``fp16.n6144.k4096.m8``; FP8 weights: ``fp16.e4m3.n6144.k4096.m8``."""
        return f"{self.dtype}{'.' + self.wfmt if self.wfmt else ''}.n{self.n}.k{self.k}.m{self.m}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> GemmBucket:
        return cls(str(d["dtype"]), int(d["n"]), int(d["k"]), int(d["m"]), str(d.get("wfmt", "")))


def table_key(dtype: str, n: int, k: int, m: int, wfmt: str = "") -> str:
    """The key of the bucket serving an (M, N, K) call (:attr:`GemmBucket.key`)."""
    return GemmBucket(get_dtype(dtype).name, n, k, m_bucket(m), wfmt).key


def table_filename(device_name: str) -> str:
    """``NVIDIA H200`` -> ``NVIDIA_H200_gemm.json``."""
    return GEMM_OP.filename(device_name)


def table_paths(device_name: str) -> list[Path]:
    """The GEMM table files lookups read, later ones overriding earlier ones entry by entry: the
    shipped table and the user's (:func:`fdpp.tables.layer_paths`, as for attention).
    :func:`fdpp.gemm_tune.tune_gemm` writes the last."""
    return [p for _, p in tables.layer_paths(table_filename(device_name))]


def current_source_hash() -> str:
    return tables.current_hash(SOURCE)


def plan_from_json(d: Mapping[str, Any], dtype: str, m: int) -> GemmPlan:
    """The plan a table entry's ``plan`` object describes, for M rows in ``dtype`` (raises
    KeyError/ValueError/TypeError when malformed)."""
    impl = d["impl"]
    grid = d.get("grid")
    grid = None if grid is None else int(grid)
    if impl == "cublas":
        return GemmPlan("cublas", None, None, source="table")
    if impl == "flat":
        cfg: KernelCfg = FlatGemmConfig(dtype, **{f: int(d[f]) for f in FlatGemmConfig.TUNED},
                                        m_tiles=m_tiles_for(m))
    elif impl == "tma":
        cfg = FlatTmaConfig(dtype, **{f: int(d[f]) for f in FlatTmaConfig.TUNED if f != "w8"},
                            w8=int(d.get("w8", 0)), m_tiles=m_tiles_for(m))
    elif impl == "gemv":
        cfg = GemvConfig(dtype, **{f: int(d[f]) for f in GemvConfig.TUNED}, m_max=m_max_for(m))
    else:
        raise ValueError(f"unknown impl {impl!r}")
    return GemmPlan(impl, cfg, grid, source="table")


def plan_json(plan: GemmPlan) -> dict[str, Any]:
    """A plan as a table entry's ``plan`` object (the tuned fields; M-dependent ones follow the call)."""
    d: dict[str, Any] = {"impl": plan.impl}
    if plan.config is not None:
        d.update({f: getattr(plan.config, f) for f in type(plan.config).TUNED})
        d["grid"] = plan.grid
    return d


#: What an entry's ``plan`` object may hold (the table header's ``params``).
PLAN_PARAMS: tuple[str, ...] = ("impl", *dict.fromkeys(
    f for c in (FlatGemmConfig, FlatTmaConfig, GemvConfig) for f in c.TUNED), "grid")


@dataclass(frozen=True)
class GemmEntry:
    """One tuned bucket: the plan measured best there (at the bucket's M), with the hash of the
    kernel source it was measured against (cuBLAS entries too: they were chosen against those
    kernels' times) and what was measured (``time_us``; ``meta``: ``cublas_us``, ``alternatives``)."""

    bucket: GemmBucket
    plan: GemmPlan
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    time_us: float | None = field(default=None, compare=False)
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)
    origin: str = field(default="", compare=False)

    @classmethod
    def of(cls, plan: GemmPlan, dtype: str, n: int, k: int, m: int, wfmt: str = "", *,
           time_us: float | None = None, **meta: Any) -> GemmEntry:
        """The entry of ``plan`` for the bucket of (``dtype``, N, K, M, ``wfmt``), stamped with the
        current kernel source."""
        b = GemmBucket(get_dtype(dtype).name, int(n), int(k), m_bucket(m), wfmt)
        return cls(b, plan_from_json(plan_json(plan), b.dtype, b.m), {SOURCE: current_source_hash()},
                   time_us, dict(meta))

    @property
    def key(self) -> str:
        return self.bucket.key

    @property
    def sort_key(self) -> GemmBucket:
        return self.bucket

    def plan_for(self, dtype: str, m: int) -> GemmPlan:
        """The plan for a call of M rows in ``dtype`` (fp16 and bf16 read the same bytes through the
        same kernels: an entry serves both)."""
        return plan_from_json(plan_json(self.plan), dtype, m)

    def check(self, device: DeviceLimits) -> str | None:
        """Why this entry must not be used (None: it may; whether its kernel runs a call's M on
        ``device`` is decided per lookup)."""
        b = self.bucket
        if b.dtype not in GEMM_DTYPES or b.m not in M_BUCKETS or b.wfmt not in ("", "e4m3"):
            return f"bucket {b.key} is not <fp16|bf16>[.e4m3].n<N>.k<K>.m<M bucket>"
        if _plan_wfmt(self.plan) != b.wfmt:
            return f"bucket {b.key} and its plan disagree on the weight format"
        return tables.stale_source(self.sources, (SOURCE,))

    def to_json(self) -> dict[str, Any]:
        return {"bucket": self.bucket.to_json(), "plan": plan_json(self.plan), "sources": dict(self.sources),
                "time_us": None if self.time_us is None else round(float(self.time_us), 3), **self.meta}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], origin: str = "") -> GemmEntry:
        b = GemmBucket.from_json(d["bucket"])
        meta = {k: v for k, v in d.items() if k not in ("bucket", "plan", "sources", "time_us")}
        t = d.get("time_us")
        return cls(b, plan_from_json(d["plan"], b.dtype, b.m), {str(k): str(v) for k, v in dict(d["sources"]).items()},
                   None if t is None else float(t), meta, origin)


#: flat GEMM's tables: ``tuning/<GPU>_gemm.json`` (:mod:`fdpp.tables` reads, checks, layers and writes them).
GEMM_OP = tables.TableOp("flat_gemm", "_gemm", PLAN_PARAMS, (SOURCE,), GemmEntry.from_json,
                         retune="python -m fdpp.bench gemm --tune")


class GemmTable:
    """The entries of ``layers`` (tables of one device, later ones overriding), with the lookup."""

    def __init__(self, entries: Mapping[str, GemmEntry], layers: Sequence[tables.Table] = ()) -> None:
        self.entries, self.layers = dict(entries), list(layers)

    @classmethod
    def build(cls, device: DeviceLimits, layers: list[tables.Table]) -> GemmTable:
        return cls({k: e for t in layers for k, e in t.entries.items()}, layers)

    def lookup(self, dtype: str, m: int, n: int, k: int, device: DeviceLimits, wfmt: str = "") -> GemmPlan | None:
        """Exact M bucket, else the nearest bucket (in octaves, ties to the larger) whose plan is
        valid for M on ``device``, else the same for the other 16-bit dtype (fp16 <-> bf16 read the
        same bytes through the same kernels); None when (N, K) has no entry. FP8 weights (``wfmt``
        "e4m3") read only their own entries (``fp16.e4m3.*``). (:func:`choose` memoises.)"""
        dt = get_dtype(dtype).name
        want = m_bucket(m)
        cands = sorted(M_BUCKETS, key=lambda b: (abs(math.log2(b) - math.log2(want)), -b))
        # the other 16-bit type last: same bytes, same kernels, same speed (tuned in one of them)
        keys = [(dt, b) for b in cands]
        if not wfmt:
            keys += [(o, b) for o in GEMM_DTYPES if o != dt for b in cands]
        for src_dt, b in keys:
            e = self.entries.get(GemmBucket(src_dt, n, k, b, wfmt).key)
            if e is None:
                continue
            plan = e.plan_for(dt, m)
            if plan.config is not None and (not plan.config.is_valid(device) or not plan.config.fits(m)):
                continue
            if _plan_wfmt(plan) != wfmt:  # never FP8 kernels for 16-bit weights, nor the other way
                continue
            return plan
        return None

    def kernel_alternative(self, dtype: str, m: int, n: int, k: int, device: DeviceLimits,
                           wfmt: str = "") -> GemmPlan | None:
        """The fastest fdpp kernel the tuner measured for the exact bucket of this call (the first
        kernel of its entry's ``alternatives``, fastest first), adapted to M and ``dtype``; None if
        there is none valid. What a fused call runs where the entry's plan is cuBLAS."""
        dt = get_dtype(dtype).name
        for src_dt in (dt, *(o for o in GEMM_DTYPES if o != dt and not wfmt)):
            e = self.entries.get(GemmBucket(src_dt, n, k, m_bucket(m), wfmt).key)
            if e is None:
                continue
            for text in (e.meta.get("alternatives") or {}):
                plan = plan_from_describe(text, dt, m)
                if plan is not None and plan.config is not None and plan.config.is_valid(device) \
                        and _plan_wfmt(plan) == wfmt:
                    return GemmPlan(plan.impl, plan.config, plan.grid, source="table")
        return None


def plan_from_describe(text: str, dtype: str, m: int) -> GemmPlan | None:
    """The plan whose :meth:`GemmPlan.describe` is ``text`` (a config key, then ``.g<grid>`` or
    ``.gauto``), adapted to ``dtype`` and M; None when no variant of the search space has that key."""
    head, _, grid = text.rpartition(".g")
    if not head or not (grid == "auto" or grid.isdigit()):
        return None
    for dt in GEMM_DTYPES:
        for cfg in compile_space(dt):
            if cfg.key == head:
                impl = {"flat_tma": "tma", "flat_gemm": "flat", "gemv": "gemv"}[cfg.kernel]
                c = GemmConfigAsDtype(cfg.for_m(m), get_dtype(dtype).name)
                return GemmPlan(impl, c, None if grid == "auto" else int(grid))
    return None


def read_table(path: Path | str, device: DeviceLimits) -> tables.Table:
    """Load one GEMM table file for ``device`` (:func:`fdpp.tables.read_table`: never raises; a
    corrupt file or a header for another device is ignored whole, a stale or malformed entry
    alone, each with one :class:`fdpp.tables.TableWarning` per load)."""
    return tables.read_table(Path(path), device, op=GEMM_OP)


def write_table(path: Path | str, device: DeviceLimits, entries: Iterable[GemmEntry], *,
                merge: bool = True) -> Path:
    """Write ``entries`` into the table file ``path`` (:func:`fdpp.tables.write_file`: atomically
    under its lock; with ``merge`` the valid entries already there are kept unless one of
    ``entries`` has the same key)."""
    return tables.write_file(path, device, entries, GEMM_OP, merge=merge)


def table_for(device: DeviceLimits) -> GemmTable:
    """The merged tables of ``device`` (:func:`table_paths`), memoised until :func:`fdpp.tables.clear_cache`."""
    if os.environ.get("FDPP_GEMM_TABLE"):
        _warn_old_env()
    return tables.layered(GEMM_OP, device, GemmTable.build)


@cache
def _warn_old_env() -> None:
    tables.warn_ignored("fdpp: $FDPP_GEMM_TABLE is no longer read: GEMM tables live beside the attention "
                        "tables (the shipped tuning/<GPU>_gemm.json, then <GPU>_gemm.json in $FDPP_TUNING_DIR "
                        "or the user cache dir)")


# ---- dataflow -------------------------------------------------------------------------------
def forced_plan(plan: GemmPlan) -> contextlib.AbstractContextManager[GemmPlan]:
    """Make every ``flat_gemm`` call in this context launch ``plan`` (tests, the tuner):
    :func:`fdpp.dispatch.forced_plan`. A kernel plan's m_tiles / m_max are adapted to each call's M."""
    return dispatch.forced_plan(plan)


_memo = dispatch.PlanMemo()


def choose(m: int, n: int, k: int, device: DeviceLimits = SM90, dtype: str = "fp16",
           table: GemmTable | tables.Table | None = None, wfmt: str = "") -> GemmPlan:
    """GEMV, flat GEMM or cuBLAS for y[m, n] = x[m, k] w[n, k]^T on ``device`` (``wfmt`` "e4m3":
    w holds FP8 codes, only the bulk-copy kernel's w8 variants apply).

    The attention dispatcher's order: a forced plan (:func:`forced_plan`) wins; then the tuned
    table (``table``: a :class:`GemmTable` or one file's :func:`read_table`; default the layered
    tables of this device, :func:`table_for`); then
    :func:`heuristic_plan`. Memoised (:class:`fdpp.dispatch.PlanMemo`) unless ``table`` is given.
    """
    dt = get_dtype(dtype).name
    forced = dispatch.current_forced("gemm")
    if forced is not None:
        return _check_forced(forced, m, dt, device, wfmt)
    if table is not None:
        if isinstance(table, tables.Table):  # one file, as read_table loads it
            table = GemmTable(table.entries, [table])
        return _decide(m, n, k, device, dt, wfmt, table)[0]
    return _memo.get((m, n, k, device, dt, wfmt, tables.user_dir_str()),
                     lambda: _decide(m, n, k, device, dt, wfmt, table_for(device))[0])


def _check_forced(forced: GemmPlan, m: int, dt: str, device: DeviceLimits, wfmt: str) -> GemmPlan:
    if forced.config is None:
        if wfmt:
            raise ValueError("forced plan cublas cannot take FP8 weights")
        return GemmPlan(forced.impl, None, None, source="forced")
    cfg = GemmConfigAsDtype(forced.config.for_m(m), dt)
    why = cfg.check(device)
    if not why and _plan_wfmt(GemmPlan(forced.impl, cfg)) != wfmt:
        why = "its weight format is not the call's" + (" (FP8)" if wfmt else " (16-bit)")
    if why:
        raise ValueError(f"forced plan {cfg.key} cannot run M={m}: {why}")
    return GemmPlan(forced.impl, cfg, forced.grid, source="forced")


def _decide(m: int, n: int, k: int, device: DeviceLimits, dt: str, wfmt: str,
            table: GemmTable) -> tuple[GemmPlan, str]:
    """(the table's or the heuristic's plan, why)."""
    plan = table.lookup(dt, m, n, k, device, wfmt) if table.entries else None
    if plan is not None:
        return plan, "a tuned table entry"
    if not table.entries:
        bad = [f"{t.path}: {t.error}" for t in table.layers if t.error]
        why = (f"no usable tuned GEMM table ({'; '.join(bad)})" if bad else
               f"no tuned GEMM table for {device.name!r} ({table_filename(device.name)})")
    else:
        why = f"no tuned entry for {'FP8 ' if wfmt else ''}N={n} K={k} that runs M={m} on {device.arch}"
    return heuristic_plan(m, n, k, dt, device, wfmt), why


def explain(m: int, n: int, k: int, dtype: str = "fp16", wfmt: str = "", device: DeviceLimits | None = None,
            fused: bool = False) -> str:
    """Which plan ``flat_gemm`` launches for y[m, n] = x[m, k] w[n, k]^T, and why (the GEMM
    counterpart of :func:`fdpp.explain`); ``fused``: for a call with ``residual`` or ``rms_eps``.
    ``device`` defaults to the current GPU, else the H200 limits (``fdpp.configs.SM90``), as
    :func:`fdpp.explain`'s."""
    device = dispatch.current_device() if device is None else device
    dt = get_dtype(dtype).name
    lines = [f"flat_gemm M={m} N={n} K={k} {dt}{' FP8 E4M3 weights' if wfmt else ''} on {device.name} "
             f"({device.arch}, {device.sm_count} SMs)", f"bucket: {table_key(dt, n, k, m, wfmt)}"]
    forced = dispatch.current_forced("gemm")
    if forced is not None:
        plan, why = _check_forced(forced, m, dt, device, wfmt), "a plan forced with fdpp.gemm.forced_plan()"
    else:
        plan, why = _decide(m, n, k, device, dt, wfmt, table_for(device))
    if fused and forced is None:
        was = plan
        plan = _fused_plan(plan, m, n, k, dt, device, wfmt)
        if was.impl == "cublas":
            why += ("; it says cuBLAS, which cannot fuse the residual / RMSNorm: the fastest kernel measured "
                    "for the bucket instead" if plan.source == "table" else
                    "; it says cuBLAS, which cannot fuse the residual / RMSNorm: the heuristic's kernel instead")
        elif plan != was:
            why += "; fused: on one wave of CTAs (each CTA runs the RMSNorm prologue once)"
    lines += [f"runs: {plan.describe()}", f"why: {why}"]
    return "\n".join(lines)


# ---- public API -----------------------------------------------------------------------------
@cache
def _warn_fallback() -> None:
    from fdpp.api import user_stacklevel

    warnings.warn("fdpp: no GPU found (CuPy sees no CUDA device); flat_gemm computes in NumPy "
                  "float32 on the CPU", RuntimeWarning, stacklevel=user_stacklevel())


#: dtype names FP8 E4M3 weight codes may have: uint8 (CuPy, NumPy), ml_dtypes / torch float8_e4m3fn.
W8_DTYPES = ("uint8", "float8_e4m3fn", "torch.uint8", "torch.float8_e4m3fn")


def _check(x: Any, w: Any, bias: Any, out: Any, w_scale: Any = None, residual: Any = None, rms_eps: Any = None
           ) -> tuple[str, dict[str, Any], tuple[int, int, int], str, str]:
    """Validate a flat_gemm call: (array kind, views, (M, N, K), x's dtype name, weight format:
    "" for w in x's dtype, "e4m3" for FP8 codes with ``w_scale``)."""
    from fdpp.api import _check_writable, _overlaps, gather_views

    check_rms_eps(rms_eps)
    kind, views = gather_views("x", x, {"w": w, "bias": bias, "out": out, "w_scale": w_scale, "residual": residual},
                               required=("w",))
    xv, wv = views["x"], views["w"]
    if len(xv.shape) != 2:
        raise ValueError(f"x must have shape [M, K], got {xv.shape}")
    if len(wv.shape) != 2:
        raise ValueError(f"w must have shape [N, K] (torch Linear layout), got {wv.shape}")
    m, k = xv.shape
    n, kw = wv.shape
    if kw != k:
        raise ValueError(f"w has K = {kw} columns but x has K = {k}")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"x must have 1..{MAX_M} rows (M, the batch), got {m}")
    if n < 1:
        raise ValueError(f"w must have at least one row (N >= 1), got {n}")
    if k < 8 or k % 8:
        raise ValueError(f"K must be a positive multiple of 8 (16-byte rows), got K = {k}")
    try:
        dt = get_dtype(xv.dtype)
    except TypeError:
        raise TypeError(f"x dtype {xv.dtype} unsupported; flat_gemm takes {GEMM_DTYPES}") from None
    if dt.name not in GEMM_DTYPES:
        raise TypeError(f"x dtype {xv.dtype} unsupported; flat_gemm takes {GEMM_DTYPES}")
    wfmt = ""
    if w_scale is not None:
        wfmt = "e4m3"
        if str(wv.dtype) not in W8_DTYPES:
            raise TypeError(f"w_scale is given, so w must hold FP8 E4M3 codes (uint8 or float8_e4m3fn), "
                            f"got w dtype {wv.dtype}")
        if dt.name != "fp16":
            raise TypeError(f"FP8 weights (W8A16) take fp16 x, got x dtype {xv.dtype}")
        sv = views["w_scale"]
        if str(sv.dtype) not in ("float32", "torch.float32"):
            raise TypeError(f"w_scale must be float32, got {sv.dtype}")
        if sv.shape != (n,):
            raise ValueError(f"w_scale must have shape [N] = ({n},) (one scale per row of w), got {sv.shape}")
        if k % 16:
            raise ValueError(f"FP8 weights need K a multiple of 16 (16-byte rows of codes), got K = {k}")
        if kind == "numpy" and not np.isfinite(np.asarray(w_scale)).all():  # as KV descales: NumPy only, no sync
            raise ValueError("w_scale must be finite")
    for nm in (n for n in views if n not in ("x", "w_scale") and not (wfmt and n == "w")):
        try:
            same = get_dtype(views[nm].dtype) == dt
        except TypeError:
            same = False
        if not same:
            hint = " (FP8 weights: pass their w_scale)" if nm == "w" and str(views[nm].dtype) in W8_DTYPES else ""
            raise TypeError(f"{nm} dtype {views[nm].dtype} must match x dtype {xv.dtype}{hint}")
    if bias is not None and views["bias"].shape != (n,):
        raise ValueError(f"bias must have shape [N] = ({n},), got {views['bias'].shape}")
    for nm in ("out", "residual"):
        if nm in views:
            ov = views[nm]
            if ov.shape != (m, n):
                raise ValueError(f"{nm} must have shape [M, N] = {(m, n)}, got {ov.shape}")
            if ov.strides != (n, 1) and not (m == 1 and ov.strides[-1] == 1):
                raise ValueError(f"{nm} must be C-contiguous, got element strides {ov.strides}")
    if out is not None:
        _check_writable(kind, out)
        ov = views["out"]
        for nm in ("x", "w", "bias", "w_scale"):
            if nm in views and _overlaps(ov, views[nm]):
                raise ValueError(f"out must not overlap {nm}")
        if residual is not None and _overlaps(ov, views["residual"]) and views["residual"].ptr != ov.ptr:
            raise ValueError("residual must be out itself (y += x @ w.T) or not overlap it")
    if kind != "numpy":
        for nm in ("x", "w"):
            v = views[nm]
            isz = 1 if nm == "w" and wfmt else dt.itemsize
            if v.strides[1] != 1 and v.shape[1] > 1:
                raise ValueError(f"{nm} must be contiguous along K (last stride 1), got strides {v.strides}")
            if v.shape[0] > 1 and v.strides[0] < k:
                raise ValueError(f"{nm} rows overlap or are reversed (strides {v.strides})")
            if v.ptr % 16 or (v.shape[0] > 1 and (v.strides[0] * isz) % 16):
                raise ValueError(f"{nm} must be 16-byte aligned with a row stride that is a multiple "
                                 f"of 16 bytes (pointer {v.ptr:#x}, element strides {v.strides}); copy "
                                 "it to a contiguous array")
        for nm in ("bias", "w_scale"):
            if nm in views and views[nm].strides != (1,) and n > 1:
                raise ValueError(f"{nm} must be contiguous, got element strides {views[nm].strides}")
    return kind, views, (m, n, k), dt.name, wfmt


def check_rms_eps(rms_eps: Any) -> None:
    """``rms_eps``: None, or a finite real >= 0 (TypeError / ValueError naming it)."""
    if rms_eps is None:
        return
    if isinstance(rms_eps, bool) or not isinstance(rms_eps, (int, float, np.integer, np.floating)):
        raise TypeError(f"rms_eps must be a real number or None, got {type(rms_eps).__name__}")
    try:
        ok = math.isfinite(rms_eps) and rms_eps >= 0
    except OverflowError:  # an int past float64's range
        ok = False
    if not ok:
        got = repr(rms_eps) if len(repr(rms_eps)) <= 32 else f"an integer of {len(str(abs(int(rms_eps))))} digits"
        raise ValueError(f"rms_eps must be finite and >= 0, got {got}")


def flat_gemm(x: Any, w: Any, *, w_scale: Any = None, bias: Any = None, residual: Any = None,
              rms_eps: float | None = None, out: Any = None) -> Any:
    """y = x @ w.T (+ bias) (+ residual): a decode-phase linear layer, memory-bound on reading ``w``;
    with ``rms_eps``, of RMSNorm(x) (the norm's weight folded into ``w``: :func:`fold_rmsnorm`).

    Parameters
    ----------
    x : array [M, K], fp16 or bf16
        Activations, M = 1..64 rows (the batch). NumPy, CuPy or torch (CUDA).
    w : array [N, K], x's dtype and array type
        Weights in torch ``Linear`` layout. Any N; K must be a multiple of 8. With ``w_scale``: FP8
        E4M3 codes (W8A16; uint8 for CuPy / NumPy, or ``ml_dtypes`` / ``torch.float8_e4m3fn``), one
        byte per weight, K a multiple of 16, x fp16; :func:`fdpp.quantize_weight` makes them.
    w_scale : float32 array [N], optional
        FP8 weights' scale per row of ``w``: the weight is ``float32(code) * w_scale[n]``. The row's
        fp32 sum of ``x * fp16(code)`` is multiplied by it, then the bias is added. sm_90 GPUs
        (the bulk-copy kernel) or NumPy. NumPy scales must be finite (ValueError); device scales
        are not read on the host (a non-finite one gives that row non-finite outputs).
    bias : array [N], optional
        Added in fp32 before the output is rounded.
    residual : array [M, N], optional
        Added in fp32 after the bias, before the output is rounded (the residual add of a decode step
        fused into its o / down projection). C-contiguous, x's dtype; it may be ``out`` itself
        (``out += x @ w.T`` in place), else must not overlap it.
    rms_eps : float, optional
        RMSNorm prologue: each row of x is divided by ``sqrt(mean(x_row ** 2) + rms_eps)`` (float32
        sums of squares) before the product, i.e. ``y = rmsnorm(x) @ w.T`` with the norm's weight
        already folded into ``w``'s columns (:func:`fold_rmsnorm`). The division is applied to the
        row's fp32 sum (one rounding of y), so results match an unfused norm + GEMM to rounding, not
        bit for bit. None: no norm.
    out : array [M, N], optional
        C-contiguous, x's dtype and array type, not overlapping the inputs (``residual`` excepted);
        written and returned.

    Returns
    -------
    y : array [M, N], x's dtype and array type (fp32 accumulation inside)

    Notes
    -----
    Device arrays need unit stride along K and 16-byte aligned pointers and row strides.
    The kernel (GEMV, flat GEMM on tensor cores, or cuBLAS) comes from :func:`choose`: the tuned
    table of this GPU, else a heuristic; a fused call (``residual`` or ``rms_eps``) where the table
    picks cuBLAS runs :func:`heuristic_plan`'s kernel instead (cuBLAS cannot fuse). Device calls do no host synchronisation, so they can be
    captured in CUDA graphs after one warm-up call (which compiles the kernel and allocates the
    stream's workspace). NumPy in, NumPy out: on the GPU when CuPy sees one, else computed by
    NumPy in float32 with a one-time RuntimeWarning.
    """
    rkey, ptrs = _probe_key(x, w, bias, w_scale, out, residual, rms_eps)  # ptrs: x, w, bias, w_scale, residual, out
    if rkey is not None:
        rec = _records.get(rkey)
        if rec is not None:
            if rec.pointers_ok(ptrs[:5], ptrs[5]):
                return rec.run(ptrs[:5], out, x)
            # misaligned or overlapping: the full path raises the precise error
    kind, views, (m, n, k), dt, wfmt = _check(x, w, bias, out, w_scale, residual, rms_eps)
    if kind == "numpy":
        return _numpy_call(x, w, bias, out, w_scale, residual, rms_eps)
    from fdpp import registry

    dev = views["x"].device
    lim = registry.device_limits(dev)
    plan = choose(m, n, k, lim, dt, wfmt=wfmt)
    if residual is not None or rms_eps is not None:
        plan = _fused_plan(plan, m, n, k, dt, lim, wfmt)
    return _device_call(kind, x, w, bias, out, views, plan, (m, n, k), dt, dev, rkey, w_scale, residual, rms_eps)


def _fused_plan(plan: GemmPlan, m: int, n: int, k: int, dt: str, device: DeviceLimits, wfmt: str) -> GemmPlan:
    """A fused call's kernel (``residual`` / ``rms_eps``) given the dispatcher's ``plan``. A table's or
    a forced kernel runs as is. cuBLAS cannot fuse: the fastest kernel the tuner measured for the
    bucket (its entry's alternatives) instead, else the heuristic's. A heuristic kernel runs on one
    wave of CTAs (grid None): every CTA runs the RMSNorm prologue once, so a grid of many waves
    (one CTA per tile) pays it once per wave (run W1: gate_up and the LM head 15-27 % slower)."""
    if plan.impl == "cublas":
        if plan.source == "forced":
            raise ValueError("a forced cuBLAS plan cannot take residual or rms_eps (cuBLAS cannot fuse them): "
                             "force a kernel plan")
        alt = table_for(device).kernel_alternative(dt, m, n, k, device, wfmt)
        if alt is not None:
            return alt
        plan = heuristic_plan(m, n, k, dt, device, wfmt)
    if plan.source == "heuristic":
        return GemmPlan(plan.impl, plan.config, None, source="heuristic")
    return plan


def fold_rmsnorm(w: Any, norm_weight: Any) -> Any:
    """``w * norm_weight`` (each column k of ``w`` [N, K] times ``norm_weight[k]``), rounded to
    ``w``'s dtype: the weight of ``rmsnorm(x, norm_weight) @ w.T`` as ``flat_gemm(x, w', rms_eps=eps)``
    computes it. NumPy, CuPy or torch (the product in float32); a new array."""
    from fdpp.api import _kind

    for name, x in (("w", w), ("norm_weight", norm_weight)):
        if _kind(x) == "other":
            raise TypeError(f"{name} must be a NumPy array, CuPy array or torch tensor, got {type(x).__name__}")
    if _kind(norm_weight) != _kind(w):
        raise TypeError(f"norm_weight must be the same array type as w ({_kind(w)})")
    if len(w.shape) != 2:
        raise ValueError(f"w must have shape [N, K], got {tuple(w.shape)}")
    for name, x in (("w", w), ("norm_weight", norm_weight)):
        try:
            get_dtype(x.dtype)
        except TypeError:  # FP8 codes, integers: the fold is for the 16-bit weights, before quantize_weight
            raise TypeError(f"{name} dtype must be fp16, bf16 or fp32, got {x.dtype}") from None
    if tuple(norm_weight.shape) != (w.shape[1],):
        raise ValueError(f"norm_weight must have shape [K] = ({w.shape[1]},), got {tuple(norm_weight.shape)}")
    if hasattr(w, "float"):  # torch
        return (w.float() * norm_weight.float()[None, :]).to(w.dtype)
    return (w.astype(np.float32) * norm_weight.astype(np.float32)[None, :]).astype(w.dtype)


def _numpy_call(x: np.ndarray, w: np.ndarray, bias: Any, out: Any, w_scale: Any = None, residual: Any = None,
                rms_eps: float | None = None) -> np.ndarray:
    from fdpp.api import gpu_available

    if gpu_available():
        import cupy

        wd = cupy.asarray(w.view(np.uint8) if w_scale is not None else w)
        y = cupy.asnumpy(flat_gemm(cupy.asarray(x), wd, w_scale=None if w_scale is None else cupy.asarray(w_scale),
                                   bias=None if bias is None else cupy.asarray(bias),
                                   residual=None if residual is None else cupy.asarray(residual), rms_eps=rms_eps))
    else:
        _warn_fallback()
        if w_scale is None:
            w32 = np.asarray(w, dtype=np.float32)
        else:  # float32(code) * scale, exactly as the kernel's fp16(code) times the row's scale
            from fdpp.quant import fp8_decode_bits

            w32 = fp8_decode_bits(np.asarray(w).view(np.uint8), "fp8_e4m3") * np.asarray(w_scale, np.float32)[:, None]
        x32 = np.asarray(x, dtype=np.float32)
        y32 = x32 @ w32.T
        if rms_eps is not None:  # the kernel's order: the row's sum times 1 / rms, then bias, then residual
            y32 *= 1 / np.sqrt(np.mean(x32 * x32, axis=1, keepdims=True) + np.float32(rms_eps))
        if bias is not None:
            y32 += np.asarray(bias, dtype=np.float32)
        if residual is not None:
            y32 += np.asarray(residual, dtype=np.float32)
        y = y32.astype(x.dtype)
    if out is not None:
        out[...] = y
        return out
    return y


# ---- device launch --------------------------------------------------------------------------
_occupancy: dict[tuple[int, str], int] = {}


def resident_ctas(cfg: KernelCfg, device_id: int) -> int:
    """CTAs of ``cfg`` resident per SM (CUDA occupancy calculator), memoised."""
    key = (device_id, cfg.key)
    occ = _occupancy.get(key)
    if occ is None:
        from cupy_backends.cuda.api import driver

        from fdpp import registry

        kern = registry.get_kernel(cfg, device_id)
        import cupy

        with cupy.cuda.Device(device_id):
            occ = int(driver.occupancyMaxActiveBlocksPerMultiprocessor(kern.kernel.ptr, cfg.threads,
                                                                       cfg.smem_bytes()))
        _occupancy[key] = occ = max(1, occ)
    return occ


def launch_grid(plan: GemmPlan, n: int, k: int, device_id: int) -> int:
    """CTAs a kernel plan launches: its grid (or one full wave), at most the iteration count."""
    cfg = plan.config
    assert cfg is not None
    _, _, total = iterations(cfg, n, k)
    if plan.grid:
        g = plan.grid
    else:
        from fdpp import registry

        g = resident_ctas(cfg, device_id) * registry.device_limits(device_id).sm_count
    return max(1, min(int(g), total))


def _device_call(kind: str, x: Any, w: Any, bias: Any, out: Any, views: dict[str, Any], plan: GemmPlan,
                 mnk: tuple[int, int, int], dt: str, dev: int, rkey: tuple | None = None,
                 w_scale: Any = None, residual: Any = None, rms_eps: float | None = None) -> Any:
    """The full path's launch: cuBLAS, or a :class:`GemmRecord` built (and remembered under
    ``rkey``) and run."""
    import cupy

    from fdpp import registry

    m, n, k = mnk
    if plan.impl == "cublas":
        if kind == "torch":
            import torch

            if out is None:
                out = torch.empty((m, n), dtype=x.dtype, device=x.device)
            if bias is not None:
                return torch.addmm(bias, x, w.t(), out=out)
            return torch.mm(x, w.t(), out=out)
        with cupy.cuda.Device(dev):
            if out is None:
                out = cupy.empty((m, n), dtype=x.dtype)
            if not cupy.cuda.get_current_stream().is_capturing():
                cupy.matmul(x, w.T, out=out)
                if bias is not None:
                    cupy.add(out, bias, out=out)
                return out
        # CuPy refuses cuBLAS calls during stream capture: the heuristic kernel instead (not
        # remembered: outside a capture the same call takes cuBLAS)
        plan, rkey = heuristic_plan(m, n, k, dt, registry.device_limits(dev)), None
    rec = GemmRecord(kind, plan, mnk, dev, views, x.dtype, rms_eps)
    if rkey is not None:
        if len(_records) >= _RECORDS_MAX:
            _records.clear()
        _records[rkey] = rec
    return rec.run(_plan.pointers(kind, (x, w, bias, w_scale, residual)), out, x)


# ---- launch records -------------------------------------------------------------------------
_records: dict[tuple, GemmRecord] = {}
_RECORDS_MAX = 1024


def _record_key(x: Any, w: Any, bias: Any, out: Any, w_scale: Any = None, residual: Any = None,
                rms_eps: float | None = None) -> tuple | None:
    """What fixes a device call's launch: array types, shapes, strides, dtypes, devices, ``rms_eps``,
    the forced plan, ``$FDPP_TUNING_DIR``, the tables' generation and
    :data:`fdpp.launch.PDL` (None: not a device call)."""
    return _probe_key(x, w, bias, w_scale, out, residual, rms_eps)[0]


def _probe_key(x: Any, w: Any, bias: Any, w_scale: Any, out: Any, residual: Any = None,
               rms_eps: float | None = None) -> tuple[tuple | None, tuple[int, ...]]:
    """(:func:`_record_key`, the pointers of x, w, bias, w_scale, residual, out) in one pass over the
    arrays."""
    from fdpp import api

    kind = api._KINDS.get(type(x))
    if kind is None:
        kind = api._KINDS[type(x)] = api._kind(x)
    if kind != "cupy" and kind != "torch":
        return None, ()
    try:
        sig, ptrs = _plan.probe(kind, (x, w, bias, w_scale, residual, out))
    except AttributeError:  # mixed array types: the full path says which argument
        return None, ()
    if rms_eps is not None and (isinstance(rms_eps, bool) or not isinstance(rms_eps, (int, float))):
        return None, ()  # the full path's check says what is wrong (or takes a NumPy scalar)
    return (kind, sig, rms_eps, *_plan.launch_env("gemm"), tables.generation()), ptrs


class GemmRecord:
    """What one flat_gemm call signature launches: the kernel's function, grid, block, shared
    memory and its constant arguments; a call fills in the pointers, allocates ``out`` (unless
    given) and launches on the current stream of its array type. Shapes, strides and dtypes
    were validated when the record was built and are in its key; the pointer checks
    (:meth:`pointers_ok`) run on every call."""

    def __init__(self, kind: str, plan: GemmPlan, mnk: tuple[int, int, int], dev: int, views: dict[str, Any],
                 dtype: Any, rms_eps: float | None = None):
        from fdpp import launch, registry

        m, n, k = mnk
        cfg = plan.config
        assert cfg is not None and cfg.fits(m), (plan, m)
        self.kind, self.plan, self.device, self.dtype = kind, plan, dev, dtype
        tiles, kb, total = iterations(cfg, n, k)
        grid = launch_grid(plan, n, k, dev)
        self.out_shape, self.tiles, self.ws_floats = (m, n), tiles, workspace_floats(cfg, grid)
        self.fn = registry.get_kernel(cfg, dev).kernel
        self.grid, self.block, self.smem = (grid, 1, 1), (cfg.threads, 1, 1), cfg.smem_bytes()
        xv, wv = views["x"], views["w"]
        ldx = xv.strides[0] if m > 1 else k
        ldw = wv.strides[0] if n > 1 else k
        i64, i32 = np.int64, np.int32
        pdl = launch.pdl_for(dev, "gemm")  # the kernels wait first
        # w iterations each CTA asks the L2 for before its PDL wait (launch.prefetch_units)
        prefetch = launch.prefetch_units(pdl, grid, cfg.block_n * cfg.block_k * (1 if getattr(cfg, 'w8', 0) else 2),
                                         -(-total // grid))
        self.tail = (i64(ldx), i64(ldw), i64(n), i32(m), i32(n), i32(k), i32(kb), i32(total), i32(grid),
                     i32(prefetch), np.float32(-1.0 if rms_eps is None else rms_eps))
        # the driver launchers read the arguments by address from one struct of fields
        self.args = np.zeros(1, dtype=GEMM_ARGS)
        for name, v in zip(GEMM_ARGS.names[N_GEMM_PTRS:], self.tail, strict=True):
            self.args[name] = v
        self._args_buf = memoryview(self.args).cast("B")
        self._lock = threading.Lock()
        self.call = launch.KernelCall(cfg, self.grid, dev, self.args, fields=True, fn=self.fn, pdl=pdl)
        self.spans = tuple(views[nm].nbytes_span if nm in views else 0 for nm in ("x", "w", "bias", "w_scale"))
        self.res_span = views["residual"].nbytes_span if "residual" in views else 0
        self.out_span = m * n * xv.itemsize
        self._stream = launch.current_stream_fn(kind, dev)
        self._ws_args: dict[int, tuple] = {}  # stream -> (its partials, pointer args, its tickets entry)
        if kind == "torch":
            import torch

            self._empty, self._tdev = torch.empty, torch.device("cuda", dev)
            self._zeros, self._f32, self._i32 = torch.zeros, torch.float32, torch.int32
            self._capturing = torch.cuda.is_current_stream_capturing
        else:
            import cupy

            self._empty, self._getdev, self._cp_device = cupy.empty, cupy.cuda.runtime.getDevice, cupy.cuda.Device
            nbytes = m * n * np.dtype(dtype).itemsize
            self._reuse = _plan._Reuse(self._cupy_alloc) if _plan.REUSE_OUTPUTS and nbytes <= _plan.REUSE_MAX_BYTES \
                else None

    def pointers_ok(self, ptrs: tuple[int, ...], out_ptr: int) -> bool:
        """x and w 16-byte aligned; ``out`` overlapping none of x, w, bias, w_scale, and the
        residual either ``out`` itself or apart from it."""
        if ptrs[0] % 16 or ptrs[1] % 16:
            return False
        if out_ptr:
            end = out_ptr + self.out_span
            for p, span in zip(ptrs, self.spans, strict=False):
                if span and p < end and out_ptr < p + span:
                    return False
            r = ptrs[4]
            if r and r != out_ptr and r < end and out_ptr < r + self.res_span:
                return False
        return True

    def run(self, ptrs: tuple[int, ...], out: Any, x: Any = None) -> Any:
        """Launch with ``ptrs`` = (x, w, bias or 0, w_scale or 0, residual or 0); return ``out`` (allocated unless given; torch:
        ``x.new_empty`` when ``x`` is given; CuPy: reused as :class:`fdpp.plan._Reuse` says)."""
        stream = self._stream()
        if self.kind == "torch":
            if out is None:
                out = x.new_empty(self.out_shape) if x is not None else self._empty(
                    self.out_shape, dtype=self.dtype, device=self._tdev)
            self._launch(ptrs, out.data_ptr(), stream)
            return out
        if self._getdev() != self.device:
            with self._cp_device(self.device):
                return self._cupy_run(ptrs, out, stream)
        return self._cupy_run(ptrs, out, stream)

    def _cupy_alloc(self) -> tuple[Any]:
        return (self._empty(self.out_shape, dtype=self.dtype),)

    def _cupy_run(self, ptrs: tuple[int, int, int, int], out: Any, stream: Any) -> Any:
        if out is None:
            out = self._reuse.get(stream.ptr)[0] if self._reuse is not None else self._cupy_alloc()[0]
        self._launch(ptrs, out.data.ptr, stream)
        return out

    def _launch(self, ptrs: tuple[int, int, int, int], out_ptr: int, stream: Any) -> None:
        sptr = stream.ptr
        key = (self.device, sptr)
        ws_args = self._ws_args.get(sptr)
        if ws_args is None or _ws._partials.get(key) is not ws_args[0] or _ws._tickets.get(key) is not ws_args[5]:
            # first call on this stream, or its scratch grew (fdpp.workspace: shared with attention)
            if self.kind == "torch" and self._capturing() and not self._scratch_fits(key):
                # inside a torch graph capture a CUDA allocation would break it and the tickets'
                # memset would be captured, not run (eager calls on the stream before the first
                # replay would find them unzeroed): temporaries from torch's capture-aware
                # allocator, zeroed by a captured memset at every replay, alive until queued
                part = self._empty(max(self.ws_floats, 1), dtype=self._f32, device=self._tdev)
                tk = self._zeros(max(self.tiles, 1), dtype=self._i32, device=self._tdev)
                self._launch_with(ptrs, out_ptr, stream, part.data_ptr(), tk.data_ptr())
                return
            part = _ws.partials(self.device, sptr, self.ws_floats)
            p1 = _ws.tickets(self.device, stream, self.tiles)
            p0 = part.data.ptr
            ws_args = self._ws_args[sptr] = (part, np.uint64(p0), np.uint64(p1), p0, p1, _ws._tickets[key])
        self._launch_with(ptrs, out_ptr, stream, ws_args[3], ws_args[4])

    def _scratch_fits(self, key: tuple[int, int]) -> bool:
        """The stream already has partials and tickets enough for this record (no allocation)."""
        part, tk = _ws._partials.get(key), _ws._tickets.get(key)
        return part is not None and part.size >= self.ws_floats and tk is not None and tk[1] >= self.tiles

    def _launch_with(self, ptrs: tuple[int, int, int, int], out_ptr: int, stream: Any, ws: int, tickets: int) -> None:
        if _launch.LAUNCHER != "cupy":
            with self._lock:  # the record's one argument struct: pointers and launch as one step per thread
                _PACK_GEMM_PTRS(self._args_buf, 0, ptrs[0], ptrs[1], ptrs[2], out_ptr, ws, tickets, ptrs[3], ptrs[4])
                self.call(stream)
            return
        u64 = np.uint64
        self.fn(self.grid, self.block, (u64(ptrs[0]), u64(ptrs[1]), u64(ptrs[2]), u64(out_ptr), u64(ws),
                                        u64(tickets), u64(ptrs[3]), u64(ptrs[4]), *self.tail),
                shared_mem=self.smem, stream=stream)


#: flat_gemm's kernel arguments, in order (``kernels_cu/flat_gemm.cu``: x, w, bias, y, ws, counters,
#: w_scale, residual, ldx, ldw, ldy, M, N, K, kb_per_tile, total_iters, grid, prefetch, rms_eps), as one
#: struct of fields for the launchers that pass arguments by address.
N_GEMM_PTRS = 8
GEMM_ARGS = np.dtype({"names": ["x", "w", "bias", "y", "ws", "counters", "w_scale", "residual", "ldx", "ldw", "ldy",
                                "m", "n", "k", "kb_per_tile", "total_iters", "grid", "prefetch", "rms_eps"],
                      "formats": [np.uint64] * N_GEMM_PTRS + [np.int64] * 3 + [np.int32] * 7 + [np.float32]},
                     align=True)
_PACK_GEMM_PTRS = struct.Struct(f"={N_GEMM_PTRS}Q").pack_into


__all__ = [
    # this module's
    "GEMM_OP", "GemmBucket", "GemmEntry", "GemmTable", "choose", "explain", "flat_gemm", "fold_rmsnorm", "forced_plan",
    "read_table", "write_table", "table_for", "table_key", "table_paths",
    # fdpp.gemm_configs', used here and re-exported for callers that know flat GEMM as one module
    "GEMM_DTYPES", "GEMV_M", "M_BUCKETS", "MAX_M", "SOURCE", "FlatGemmConfig", "FlatTmaConfig", "GemmPlan",
    "GemvConfig", "compile_space", "flat_space", "gemv_space", "heuristic_plan", "iterations", "m_bucket",
    "m_max_for", "m_tiles_for", "tma_space", "workspace_floats", "SM80", "SM90",
]
