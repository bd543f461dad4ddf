"""Tuned tables: ``tuning/<GPU>.json``, one per GPU, read by the dispatcher, written by the tuner.

No CuPy here (CI tests it on a CPU): kernel-source hashes come from ``fdpp.registry.source_hash``,
which only reads files.

File layout (``SCHEMA_VERSION`` 1)::

    {
      "schema": 1,
      "fdpp_version": "0.1.0",
      "device": {"name": "NVIDIA H200", "cc": [9, 0], "sm_count": 132},
      "kernel_hashes": {"decode_split.cu": "…", "decode_combine.cu": "…"},   # when written
      "params": ["group_size", "num_warps", "num_stages", "unroll", "kernel", "mma",
                 "num_splits", "combine_warps"],          # PARAM_NAMES: what a plan is made of
      "versions": {"cuda_runtime": 13000, "cupy": "14.2.0", …},              # informational
      "written": "2026-11-30T12:00:00+00:00",
      "entries": {
        "q32.kv8.d128.fp16.n4096.b1": {
          "bucket": {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "fp16",
                     "seqlen": 4096, "batch": 1},
          "plan": {"group_size": 4, "num_warps": 4, "num_stages": 3, "unroll": 1,
                   "kernel": "decode_split", "mma": true,              # every DecodeConfig field
                   "num_splits": 66, "combine_warps": 4},              # combine_warps null: no split
          "chunk": 63,                                  # tokens per split at the bucket's seqlen
          "sources": {"decode_split.cu": "…", "decode_combine.cu": "…"},  # hashes this entry uses
          "time_us": 5.1, "heuristic_time_us": 6.3, "trials": 20, "study": "…"
        }, …
      }
    }

Buckets: a problem's seqlen (N_max) and batch are each rounded to the **nearest power of two in
log2 space** (:func:`bucket_pow2`: 2^k covers [2^k/√2, 2^k·√2); no integer sits on a boundary, so
there are no ties). The tuner measures at the bucket values themselves.

Checks on load (each failure warns once and drops what it concerns, never raises):

- unreadable or corrupt JSON, wrong ``schema``, different ``params`` (a config field added or renamed) or
  a header for another device: the whole file is ignored;
- an entry whose recorded hash of a kernel source differs from the current source (``sources``,
  per kernel, so editing ``decode_combine.cu`` only drops entries that launch the combine), a
  malformed entry, or a config that is invalid on this device: that entry is ignored;
- different fdpp / CUDA / CuPy versions are only reported (by :func:`fdpp.dispatch.explain`): they
  can change speed, not results, and the per-kernel hashes already guard correctness.

Every op's tables are handled here (:class:`TableOp`: the header's ``op``, a file-name suffix,
the plan parameter names, the kernel files and an entry parser): the format above, the checks,
the layers (:func:`layered`), the locked atomic merge-write (:func:`write_file`) and the warning.
Attention's op is :data:`ATTENTION` (a header without ``op`` is attention's: tables written before
ops were named); flat GEMM's is :data:`fdpp.gemm.GEMM_OP` (``tuning/<GPU>_gemm.json``).

Lookup (:meth:`TableSet.lookup`): the shipped table (package ``tuning/``), then the user's
(``FDPP_TUNING_DIR``, else the platformdirs user cache dir ``fdpp``), user entries overriding
shipped ones bucket by bucket; exact bucket, else the nearest bucket of the same head
configuration and dtype — nearest in |log2 seqlen| first, then |log2 batch|, ties to the larger
bucket — within ``MAX_BUCKET_DISTANCE`` octaves in each; else no match (the heuristic).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import json
import logging
import math
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from fdpp.configs import (
    MAX_SPLITS,
    CombineConfig,
    DecodeConfig,
    DecodeProblem,
    DeviceLimits,
    LaunchPlan,
    cache_parts,
    cluster_within,
)
from fdpp.dtypes import DTYPES

log = logging.getLogger("fdpp.tables")

SCHEMA_VERSION = 1
#: DecodeConfig fields the problem fixes (they come from the bucket, not the tuned plan).
PROBLEM_FIELDS = ("dtype", "head_dim", "kv_dtype", "page_size")
#: DecodeConfig fields stored in an entry's "plan"; derived from the dataclass, so a new kernel
#: field is stored without touching this file (a table written before it existed reads the
#: field's default).
SPLIT_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(DecodeConfig) if f.name not in PROBLEM_FIELDS)
_FIELD_TYPES = {f.name: type(f.default) for f in dataclasses.fields(DecodeConfig) if f.name in SPLIT_FIELDS}
#: How an entry's splits are merged (absent in tables written before the fused path: the
#: two-launch combine of one slice): "merge" is "combine", "fused" or "cluster" (the phase-1
#: variant's ``cluster`` field then equals the split count).
MERGE_FIELDS: tuple[str, ...] = ("merge", "combine_slices", "merge_bucket")
#: What a plan is made of, in order: the phase-1 config fields, the split count, the combine
#: kernel's warps. Stored in the header; a table with other names was made for another config
#: layout (a field added or renamed) and is ignored.
PARAM_NAMES: tuple[str, ...] = (*SPLIT_FIELDS, "num_splits", "combine_warps", *MERGE_FIELDS)
#: How far (in octaves of seqlen and of batch, each) a nearest-bucket match may be.
MAX_BUCKET_DISTANCE = 2
ENV_DIR = "FDPP_TUNING_DIR"


class TableWarning(RuntimeWarning):
    """A tuned table (or one of its entries) was ignored; the heuristic serves those problems.
    Raised for attention and flat GEMM tables alike."""


# ---- buckets --------------------------------------------------------------------------------
def bucket_pow2(x: int) -> int:
    """Nearest power of two to ``x`` in log2 space (1 for x <= 1).

    2^k serves [2^k/√2, 2^k·√2): 3 -> 4, 5 -> 4, 6 -> 8, 1000 -> 1024, 1448 -> 1024, 1449 -> 2048.
    """
    x = int(x)
    if x <= 1:
        return 1
    lo = 1 << (x.bit_length() - 1)
    return lo * 2 if x * x >= 2 * lo * lo else lo  # x >= lo·√2, exactly in integers


@dataclass(frozen=True, order=True)
class HeadConfig:
    """What must match exactly for an entry to serve a problem (besides the GPU): heads, q's
    dtype, the K/V element type ("" = q's) and the cache (page_size 0 = contiguous)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_dtype: str = ""
    page_size: int = 0

    def __post_init__(self) -> None:
        if not self.kv_dtype:
            object.__setattr__(self, "kv_dtype", self.dtype)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> HeadConfig:
        """Fields missing from ``d`` (tables written before they existed) take their defaults."""
        kw = {f.name: (str if f.type == "str" else int)(d[f.name]) for f in dataclasses.fields(cls) if f.name in d}
        return cls(**kw)

    @property
    def key(self) -> str:
        return ".".join([f"q{self.num_q_heads}", f"kv{self.num_kv_heads}", f"d{self.head_dim}", self.dtype,
                         *cache_parts(self.dtype, self.kv_dtype, self.page_size)])


@dataclass(frozen=True, order=True)
class Bucket:
    heads: HeadConfig
    seqlen: int
    batch: int

    @classmethod
    def of(cls, problem: DecodeProblem) -> Bucket:
        """The bucket of ``problem`` (seqlen and batch rounded by :func:`bucket_pow2`)."""
        return cls(head_config(problem), bucket_pow2(problem.seqlen), bucket_pow2(problem.batch))

    @property
    def key(self) -> str:
        """``q32.kv8.d128.fp16[.kv<tag>][.p16].n4096.b1``: a contiguous cache in q's dtype keys as
        it did before K/V types and pages were fields, so older tables still match."""
        return f"{self.heads.key}.n{self.seqlen}.b{self.batch}"

    def problem(self) -> DecodeProblem:
        """The problem the tuner measures for this bucket."""
        h = self.heads
        return DecodeProblem(self.batch, h.num_q_heads, h.num_kv_heads, h.head_dim, self.seqlen, h.dtype,
                             h.kv_dtype, h.page_size)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.heads), "seqlen": self.seqlen, "batch": self.batch}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Bucket:
        return cls(HeadConfig.from_json(d), int(d["seqlen"]), int(d["batch"]))


def head_config(problem: DecodeProblem) -> HeadConfig:
    return HeadConfig(problem.num_q_heads, problem.num_kv_heads, problem.head_dim, problem.dtype,
                      problem.kv_dtype, problem.page_size)


# ---- entries --------------------------------------------------------------------------------
def plan_sources(plan: LaunchPlan) -> tuple[str, ...]:
    """Kernel source files a plan launches."""
    return tuple(dict.fromkeys(k.source for k in plan.kernels))


def current_hash(source: str) -> str:
    from fdpp.registry import source_hash  # reads files only; registry imports CuPy lazily

    return source_hash(source)


@dataclass(frozen=True)
class Entry:
    """One tuned bucket: the plan measured best there, and what it was measured against."""

    bucket: Bucket
    split: DecodeConfig
    num_splits: int  # effective split count at the bucket's seqlen
    combine_warps: int | None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    time_us: float | None = field(default=None, compare=False)
    heuristic_time_us: float | None = field(default=None, compare=False)
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)  # trials, study, …
    origin: str = field(default="", compare=False)  # the file it was read from
    merge: str = "combine"  # "combine" (a second launch) or "fused" (merged in phase 1)
    combine_slices: int = 1
    merge_bucket: int = 0  # fused: first-level bucket (0: the default of configs.merge_bucket)

    @classmethod
    def from_plan(cls, bucket: Bucket, plan: LaunchPlan, *, time_us: float | None = None,
                  heuristic_time_us: float | None = None, **meta: Any) -> Entry:
        splits = plan.effective_splits(bucket.seqlen)
        cluster = plan.mode == "cluster"
        fused = plan.fused and splits > 1
        two = splits > 1 and not fused and not cluster
        comb = (plan.combine.num_warps if plan.combine is not None else 4) if two else None
        slices = plan.combine.slices if (two and plan.combine is not None) else 1
        e = cls(bucket, plan.split, splits, comb, {}, time_us, heuristic_time_us, dict(meta),
                merge="cluster" if cluster else "fused" if fused else "combine", combine_slices=slices,
                merge_bucket=plan.bucket if fused else 0)
        return dataclasses.replace(e, sources={s: current_hash(s) for s in plan_sources(e.plan())})

    @property
    def sort_key(self) -> Bucket:
        return self.bucket

    def combine(self) -> CombineConfig | None:
        if self.combine_warps is None or self.merge != "combine":
            return None
        return CombineConfig(self.split.dtype, self.split.head_dim, self.combine_warps, self.combine_slices)

    def plan(self, num_splits: int | None = None, source: str = "table") -> LaunchPlan:
        """The plan, with ``num_splits`` instead of the tuned count when given (a cluster entry: the
        largest cluster size of at most that count, or one split without a merge)."""
        s = self.num_splits if num_splits is None else int(num_splits)
        if self.merge == "cluster":
            c = cluster_within(s)
            return LaunchPlan.split_kv(dataclasses.replace(self.split, cluster=c), c, source=source)
        return LaunchPlan.split_kv(self.split, s, self.combine(), source=source,
                                   fused=self.merge == "fused", bucket=self.merge_bucket)

    @property
    def key(self) -> str:
        return self.bucket.key

    def to_json(self) -> dict[str, Any]:
        plan = {f: getattr(self.split, f) for f in SPLIT_FIELDS}
        plan.update(num_splits=self.num_splits, combine_warps=self.combine_warps, merge=self.merge,
                    combine_slices=self.combine_slices, merge_bucket=self.merge_bucket)
        return {
            "bucket": self.bucket.to_json(),
            "plan": plan,
            "chunk": math.ceil(self.bucket.seqlen / self.num_splits),
            "sources": dict(self.sources),
            "time_us": _finite_or_none(self.time_us),
            "heuristic_time_us": _finite_or_none(self.heuristic_time_us),
            **{k: v for k, v in self.meta.items() if k not in ("bucket", "plan", "sources", "chunk")},
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any], origin: str = "") -> Entry:
        """Parse an entry; raises (KeyError, TypeError, ValueError) when malformed."""
        bucket = Bucket.from_json(d["bucket"])
        p = d["plan"]
        unknown = set(p) - set(SPLIT_FIELDS) - {"num_splits", "combine_warps", *MERGE_FIELDS}
        if unknown:
            raise ValueError(f"unknown plan fields {sorted(unknown)}")
        kw = {f: _coerce(f, p[f]) for f in SPLIT_FIELDS if f in p}  # missing: the field's default
        h = bucket.heads
        split = DecodeConfig(h.dtype, h.head_dim, **kw, kv_dtype=h.kv_dtype, page_size=h.page_size)
        splits = int(p["num_splits"])
        cw = p.get("combine_warps")
        cw = None if cw is None else int(cw)
        sources = {str(k): str(v) for k, v in dict(d["sources"]).items()}
        meta = {k: v for k, v in d.items()
                if k not in ("bucket", "plan", "sources", "chunk", "time_us", "heuristic_time_us")}
        merge = str(p.get("merge", "combine"))
        if merge not in ("combine", "fused", "cluster"):
            raise ValueError(f"merge {merge!r} is not 'combine', 'fused' or 'cluster'")
        if (merge == "cluster") != (split.cluster > 1) or (merge == "cluster" and split.cluster != splits):
            raise ValueError(f"merge {merge!r} with cluster {split.cluster} and {splits} splits")
        return cls(bucket, split, splits, cw, sources, _float_or_none(d.get("time_us")),
                   _float_or_none(d.get("heuristic_time_us")), meta, origin, merge=merge,
                   combine_slices=int(p.get("combine_slices", 1)), merge_bucket=int(p.get("merge_bucket", 0)))

    def problem_mismatch(self, problem: DecodeProblem) -> str | None:
        """Why this entry's kernel cannot serve ``problem`` (None when it can)."""
        if head_config(problem) != self.bucket.heads:
            return "other head configuration or dtype"
        if problem.ratio % self.split.group_size:
            return f"group_size {self.split.group_size} does not divide the GQA ratio {problem.ratio}"
        return None

    def check(self, device: DeviceLimits) -> str | None:
        """Why this entry must not run on ``device`` with the current sources (None: it may)."""
        if self.bucket.heads.dtype not in DTYPES:
            return f"dtype {self.bucket.heads.dtype!r} unknown"
        if not 1 <= self.num_splits <= MAX_SPLITS:
            return f"num_splits {self.num_splits} outside 1..{MAX_SPLITS}"
        if self.bucket.heads.num_q_heads % self.bucket.heads.num_kv_heads:
            return "num_q_heads not a multiple of num_kv_heads"
        ratio = self.bucket.heads.num_q_heads // self.bucket.heads.num_kv_heads
        if ratio % self.split.group_size:
            return f"group_size {self.split.group_size} does not divide the GQA ratio {ratio}"
        if self.split.kernel != "decode_split":
            return f"kernel {self.split.kernel!r} is not a split kernel"
        why = self.split.check(device)
        if why:
            return f"{self.split.key} invalid on {device.name}: {why}"
        comb = self.combine()
        if comb is not None and (why := comb.check(device)):
            return f"{comb.key} invalid: {why}"
        return stale_source(self.sources, plan_sources(self.plan()))


def stale_source(recorded: Mapping[str, str], needed: Iterable[str]) -> str | None:
    """Why an entry that launches the kernel files ``needed`` is stale (None: every one's
    ``recorded`` hash is the current one). Every op's entries carry these hashes."""
    for src in needed:
        want = recorded.get(src)
        if want is None:
            return f"no recorded hash of {src}"
        try:
            have = current_hash(src)
        except OSError as e:
            return f"cannot hash {src}: {e}"
        if want != have:
            return f"{src} changed since tuning (hash {want} in table, {have} now)"
    return None


def _coerce(name: str, value: Any) -> Any:
    """A JSON value as the type of DecodeConfig's field ``name`` (bool, int or str)."""
    t = _FIELD_TYPES.get(name, int)
    if t is bool:
        if not isinstance(value, (bool, int)):
            raise TypeError(f"{name} must be a boolean, got {value!r}")
        return bool(value)
    if t is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {value!r}")
        return value
    if not isinstance(value, t):
        raise TypeError(f"{name} must be {t.__name__}, got {value!r}")
    return value


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), 3)


def _float_or_none(x: Any) -> float | None:
    return None if x is None else float(x)



# ---- files ----------------------------------------------------------------------------------
def table_filename(device_name: str, suffix: str = "") -> str:
    """``NVIDIA H200`` -> ``NVIDIA_H200<suffix>.json`` (every non-alphanumeric character becomes
    ``_``; flat GEMM's tables use the suffix ``_gemm``)."""
    return re.sub(r"[^0-9A-Za-z]", "_", device_name) + suffix + ".json"


@cache
def shipped_dir() -> Path:
    """The tables shipped with fdpp: the source tree's ``tuning/``, else the installed copy."""
    tree = Path(__file__).resolve().parent.parent / "tuning"
    if tree.is_dir():
        return tree
    from importlib.resources import files

    return Path(str(files("fdpp.tuning")))


@cache
def _default_user_dir() -> str:
    return str(user_cache_dir())


def user_cache_dir() -> Path:
    """platformdirs' user cache dir ``fdpp``; without platformdirs, ``$XDG_CACHE_HOME/fdpp`` or
    ``~/.cache/fdpp`` (the same place on Linux)."""
    try:
        import platformdirs
    except ImportError:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "fdpp"
    return Path(platformdirs.user_cache_dir("fdpp"))


def user_dir() -> Path:
    """The user's tables: ``$FDPP_TUNING_DIR``, else the platformdirs user cache dir ``fdpp``."""
    return Path(user_dir_str())


def user_dir_str() -> str:
    return os.environ.get(ENV_DIR) or _default_user_dir()


def layer_paths(filename: str, user: str | None = None) -> list[tuple[str, Path]]:
    """``("shipped", path)`` then ``("user", path)`` of one table file (later entries override
    earlier ones); the user's is left out when the user dir is the shipped dir."""
    shipped = shipped_dir()
    user = user_dir_str() if user is None else user
    layers = [("shipped", shipped / filename)]
    if Path(user).resolve() != Path(shipped).resolve():
        layers.append(("user", Path(user) / filename))
    return layers


@dataclass(frozen=True)
class TableOp:
    """What an op contributes to the table machinery (files, header checks, the locked merge-write,
    layers, memo): its name (the header's ``op``), the file-name suffix, the plan parameter names
    (the header's ``params``), the kernel files it launches (the header's ``kernel_hashes``) and
    its entry parser. An entry (:class:`Entry`, :class:`fdpp.gemm.GemmEntry`) has ``key``,
    ``sort_key``, ``sources``, ``check(device)`` and ``to_json()``; ``parse(d, origin)`` raises
    (KeyError, TypeError, ValueError) when ``d`` is malformed. ``group(entry)`` is what the
    dispatcher's explanations sort dropped entries by (attention: the head configuration)."""

    name: str
    suffix: str
    params: tuple[str, ...]
    sources: tuple[str, ...]
    parse: Callable[[Mapping[str, Any], str], Any]
    group: Callable[[Any], Any] = lambda e: None
    retune: str = "python -m fdpp.tune"  # the command that rewrites stale entries (said in warnings)

    def filename(self, device_name: str) -> str:
        return table_filename(device_name, self.suffix)


#: The attention op's tables: ``tuning/<GPU>.json``.
ATTENTION = TableOp("attention", "", PARAM_NAMES, ("decode_split.cu", "decode_combine.cu"), Entry.from_json,
                    lambda e: e.bucket.heads)


@dataclass
class Table:
    """One file as loaded: its header, the entries kept and why others were dropped."""

    path: Path
    kind: str  # "shipped" | "user"
    header: dict[str, Any] = field(default_factory=dict)
    entries: dict[str, Any] = field(default_factory=dict)  # key -> the op's entry
    rejected: dict[str, str] = field(default_factory=dict)  # entry key -> reason
    rejected_groups: dict[str, Any] = field(default_factory=dict)  # entry key -> its op.group (parsed)
    error: str | None = None  # why the whole file was ignored (None: loaded, or absent)
    found: bool = True


def warn_ignored(msg: str) -> None:
    """Log and warn (:class:`TableWarning`) that a table or some of its entries were ignored."""
    log.warning(msg)
    warnings.warn(msg, TableWarning, stacklevel=4)


def load_json(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """A table file's top-level object: ``(data, None)``; ``(None, why)`` when it is unreadable or
    not a JSON object; ``(None, None)`` when it does not exist. Never raises."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as e:
        return None, f"unreadable: {e}"
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("top level is not an object")
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        return None, f"corrupt JSON: {type(e).__name__}: {str(e)[:200]}"
    return data, None


def read_table(path: Path, device: DeviceLimits, kind: str = "user", *, warn: bool = True,
               op: TableOp | None = None) -> Table:
    """Load ``path`` for ``device`` (``op``: whose table, default attention's): never raises;
    problems warn (once per load) and are recorded."""
    op = ATTENTION if op is None else op
    t = Table(Path(path), kind)
    data, t.error = load_json(t.path)
    if data is None and t.error is None:
        t.found = False
        return t
    if data is not None:
        try:
            t.header = {k: v for k, v in data.items() if k != "entries"}
            t.error = _header_error(t.header, device, op)
            if t.error is None:
                _read_entries(t, data.get("entries"), device, op)
        except Exception as e:  # noqa: BLE001 - a table must never break a call
            t.error, t.entries = f"unreadable header ({type(e).__name__}: {e})", {}
    if warn and t.error:
        warn_ignored(f"fdpp: ignoring tuned table {t.path}: {t.error}; the heuristic serves these problems")
    if warn and t.rejected:
        reasons = sorted(set(t.rejected.values()))
        warn_ignored(f"fdpp: ignoring {len(t.rejected)} entr{'y' if len(t.rejected) == 1 else 'ies'} of "
                     f"{t.path}: {'; '.join(reasons[:4])}{' …' if len(reasons) > 4 else ''}; "
                     f"retune with `{op.retune}`")
    return t


def _header_error(h: Mapping[str, Any], device: DeviceLimits, op: TableOp) -> str | None:
    if h.get("schema") != SCHEMA_VERSION:
        return f"schema {h.get('schema')!r}, expected {SCHEMA_VERSION}"
    if "op" not in h and op is not ATTENTION:  # attention tables written before ops were named have none
        return "an older table format (no 'op' field)"
    have = h.get("op", ATTENTION.name)
    if have != op.name:
        return f"a table of op {have!r}, expected {op.name!r}"
    params = h.get("params")
    if not isinstance(params, list) or not set(params) <= set(op.params):
        # fewer is fine (written before a field existed: it reads the default); an unknown
        # name means a layout this fdpp cannot read
        return f"tuned parameters {params!r} are not among this fdpp's {list(op.params)}"
    dev = h.get("device")
    name = dev.get("name") if isinstance(dev, dict) else None
    if name != device.name:
        return f"written for device {name!r}, not {device.name!r}"
    return None


def _read_entries(t: Table, raw: Any, device: DeviceLimits, op: TableOp) -> None:
    if not isinstance(raw, dict):
        t.error = "no 'entries' object"
        return
    for key, d in raw.items():
        try:
            e = op.parse(d, str(t.path))
            why = e.check(device)
        except Exception as ex:  # noqa: BLE001 - whatever is wrong with it, it is not used
            t.rejected[key] = f"malformed entry ({type(ex).__name__}: {ex})"
            continue
        if e.key != key:
            t.rejected[key] = f"key does not match its bucket {e.key}"
            continue
        if why:
            t.rejected[key] = why
            t.rejected_groups[key] = op.group(e)
            continue
        t.entries[key] = e


def version_notes(header: Mapping[str, Any], current: Mapping[str, Any] | None = None) -> list[str]:
    """Differences between the versions a table was tuned with and the running ones (speed only)."""
    notes = []
    from fdpp import __version__

    if header.get("fdpp_version") not in (None, __version__):
        notes.append(f"tuned with fdpp {header.get('fdpp_version')}, running {__version__}")
    for k, v in (current or {}).items():
        old = (header.get("versions") or {}).get(k)
        if old is not None and old != v:
            notes.append(f"tuned with {k} {old}, running {v}")
    return notes


def make_header(device: DeviceLimits, versions: Mapping[str, Any] | None = None,
                op: TableOp | None = None) -> dict[str, Any]:
    from fdpp import __version__

    op = ATTENTION if op is None else op
    return {
        "schema": SCHEMA_VERSION,
        "op": op.name,
        "fdpp_version": __version__,
        "device": {"name": device.name, "cc": list(device.cc), "sm_count": device.sm_count},
        "kernel_hashes": {s: current_hash(s) for s in op.sources},
        "params": list(op.params),
        "versions": dict(versions or {}),
        "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_table(directory: Path | str, device: DeviceLimits, entries: Iterable[Entry],
                versions: Mapping[str, Any] | None = None, *, merge: bool = True) -> Path:
    """Write ``entries`` into ``<directory>/<GPU>.json`` atomically (temp file + ``os.replace``).

    With ``merge``, the valid entries already in that file are kept unless a new entry has the
    same bucket (entries that are stale or broken are dropped, with the usual warning). The
    read-merge-write holds an exclusive lock (:func:`update_file`), so processes writing other
    buckets of the same table at the same time keep each other's entries. Returns the path written.
    """
    return write_file(Path(directory) / table_filename(device.name), device, entries, ATTENTION, versions,
                      merge=merge)


def write_file(path: Path | str, device: DeviceLimits, entries: Iterable[Any], op: TableOp,
               versions: Mapping[str, Any] | None = None, *, merge: bool = True) -> Path:
    """Write ``op``'s ``entries`` into the table file ``path`` (see :func:`write_table`); the
    memoised tables and every dispatcher's memoised plans are dropped (:func:`clear_cache`)."""
    path = Path(path)

    def render() -> str:
        out: dict[str, Any] = dict(read_table(path, device, op=op).entries) if merge else {}
        for e in entries:
            out[e.key] = e
        return format_table(make_header(device, versions, op),
                            {k: out[k].to_json() for k in sorted(out, key=lambda k: out[k].sort_key)})

    update_file(path, render)
    clear_cache()
    return path


def update_file(path: Path, render: Callable[[], str]) -> Path:
    """Replace ``path`` by ``render()``'s text: the parent dir is created, ``render`` runs under the
    exclusive lock (:func:`_locked`, so it may read the current file and merge) and its text
    replaces the file atomically (:func:`_replace`). Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        _replace(path, render())
    return path


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the sidecar ``.<name>.lock`` beside ``path`` (created once, never
    removed: removing it would let two writers lock different files). Readers take no lock: the
    table itself is only ever replaced whole."""
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _replace(path: Path, text: str) -> None:
    """``path`` holds ``text``, atomically: a temp file beside it, then ``os.replace``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def format_table(header: Mapping[str, Any], entries: Mapping[str, Any]) -> str:
    """JSON with one line per header field and per entry (short, readable diffs)."""
    dump = lambda x: json.dumps(x, allow_nan=False)  # noqa: E731
    lines = [f" {dump(k)}: {dump(v)}," for k, v in header.items()]
    body = ",\n".join(f"  {dump(k)}: {dump(v)}" for k, v in entries.items())
    return "{\n" + "\n".join(lines) + '\n "entries": {\n' + body + ("\n" if body else "") + " }\n}\n"


# ---- lookup ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Match:
    entry: Entry
    exact: bool
    d_seqlen: int  # |log2 entry seqlen - log2 problem bucket seqlen|
    d_batch: int


@dataclass
class TableSet:
    """Shipped and user tables of one device, merged (user entries override shipped ones)."""

    device: DeviceLimits
    tables: list[Table]
    entries: dict[str, Entry]
    by_heads: dict[HeadConfig, list[Entry]]

    @classmethod
    def build(cls, device: DeviceLimits, tables: list[Table]) -> TableSet:
        entries: dict[str, Entry] = {}
        for t in tables:  # shipped first, user last: user wins
            entries.update(t.entries)
        by_heads: dict[HeadConfig, list[Entry]] = {}
        for e in entries.values():
            by_heads.setdefault(e.bucket.heads, []).append(e)
        return cls(device, tables, entries, by_heads)

    def lookup(self, problem: DecodeProblem) -> Match | None:
        """Exact bucket, else the nearest within ``MAX_BUCKET_DISTANCE`` (see module doc), else None."""
        b = Bucket.of(problem)
        e = self.entries.get(b.key)
        if e is not None and e.problem_mismatch(problem) is None:
            return Match(e, True, 0, 0)
        best: tuple[tuple[int, int, int, int], Entry] | None = None
        ls, lb = b.seqlen.bit_length(), b.batch.bit_length()
        for e in self.by_heads.get(b.heads, ()):
            ds = abs(e.bucket.seqlen.bit_length() - ls)
            db = abs(e.bucket.batch.bit_length() - lb)
            if ds > MAX_BUCKET_DISTANCE or db > MAX_BUCKET_DISTANCE or e.problem_mismatch(problem):
                continue
            rank = (ds, db, -e.bucket.seqlen, -e.bucket.batch)  # ties: the larger bucket
            if best is None or rank < best[0]:
                best = (rank, e)
        if best is None:
            return None
        (ds, db, _, _), e = best
        return Match(e, False, ds, db)

    def rejected_for(self, problem: DecodeProblem) -> list[tuple[Table, str, str]]:
        """(table, entry key, reason) of dropped entries that would have served ``problem``'s heads."""
        heads = head_config(problem)
        return [(t, k, why) for t in self.tables for k, why in t.rejected.items()
                if t.rejected_groups.get(k) == heads]


_sets: dict[tuple, Any] = {}  # (op, device, shipped dir, user dir) -> what build made of the layers


def layered(op: TableOp, device: DeviceLimits, build: Callable[[DeviceLimits, list[Table]], Any],
            user: str | None = None) -> Any:
    """``build(device, tables)`` of ``op``'s shipped and user tables of ``device`` (:func:`layer_paths`,
    later overriding earlier), memoised per op, device and directories until :func:`clear_cache`."""
    user = user_dir_str() if user is None else user
    key = (op.name, device, str(shipped_dir()), user)
    got = _sets.get(key)
    if got is None:
        layers = layer_paths(op.filename(device.name), user)
        got = _sets[key] = build(device, [read_table(p, device, kind, op=op) for kind, p in layers])
    return got


def table_set(device: DeviceLimits, user: str | None = None) -> TableSet:
    """The merged attention tables for ``device`` (memoised per device and directories; :func:`clear_cache`)."""
    return layered(ATTENTION, device, TableSet.build, user)


_generation = 0


def generation() -> int:
    """Bumped by :func:`clear_cache`; the dispatcher drops its memoised plans when it changes."""
    return _generation


def clear_cache() -> None:
    """Forget loaded tables (after writing one, or changing the shipped dir in a test)."""
    global _generation
    _sets.clear()
    _generation += 1
