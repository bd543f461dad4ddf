"""``python -m fdpp.tune``: the Optuna autotuner; writes ``tuning/<GPU>.json`` for the dispatcher.

One Optuna study per (GPU, problem bucket) — a bucket is a head configuration (Hq, Hkv, D), a
dtype, a cache (contiguous, or paged with ``--page-size`` pages: keys ``.p<size>``), and a seqlen
and batch that are powers of two (:mod:`fdpp.tables`). A trial is one
:class:`~fdpp.configs.LaunchPlan`:

- the phase-1 kernel variant: one Optuna parameter per ``DecodeConfig`` field that varies across
  :func:`fdpp.configs.kernel_space` (today ``num_warps``, ``num_stages``, ``unroll``, ``mma``); a
  combination outside that list is pruned like an invalid one. The group size is
  ``group_size_for(ratio)`` (each KV head read once), and also half of it (``group_size`` a
  parameter; each KV head read by two CTAs, the second read mostly from L2) where batch x KV heads
  is at most :data:`HALF_GROUP_MAX_COHORTS`: with one KV head the doubled grid pays,
- ``num_splits`` from :func:`split_candidates` (powers of two, counts around whole waves of the SM count and the
  heuristic's count; chunks of at least ``MIN_CHUNK`` tokens, of whole pages when paged; one count
  per launched grid) — a launch-time value, free to vary,
- ``combine_warps`` of ``decode_combine`` in {2, 4, 8} and ``combine_slices`` (CTAs per row),
- ``merge``: "fused" (merged by the last CTA of each group inside phase 1, first-level buckets of
  ``merge_bucket`` splits), "combine" (a second launch), or, on sm_90 with a tensor-core variant,
  "cluster" (the splits merged inside one thread-block cluster per group; the cluster size is the
  largest of :data:`fdpp.configs.CLUSTER_SIZES` not above ``num_splits``); all are seeded from the
  heuristic's kernel.

A trial:

1. an invalid config (``config.check(device)``) is a pruned trial; nothing is compiled;
2. a plan already measured in this study (same kernel variants and same *effective* split count)
   is answered from that trial (``repeat_of`` user attribute), not measured again;
3. else ``measure(plan)``: the plan is launched through ``fdpp.decode_attention`` (paged buckets:
   ``fdpp.paged_decode_attention`` over shuffled pages) under :func:`fdpp.dispatch.forced_plan`, its
   output (and lse) compared with the float64 :func:`fdpp.reference.attention_reference`
   (``paged_attention_reference``); only if ``max_rel_err`` is within the dtype's
   ``atol`` (:mod:`fdpp.dtypes`) is it timed with :func:`fdpp.timing.time_calls` (CUDA graphs,
   inputs rotated past L2). A mismatch is value ``inf`` (user attribute ``verify_error``): it can
   never be the best.

The heuristic's plan is always the first trial. The search: exhaustive (GridSampler) when the
space has at most ``--trials`` points, else seeded TPE. ``--trials`` counts distinct measured plans
per bucket, in total over all runs: the storage (SQLite by default) makes a rerun resume, and any
Optuna storage URL (PostgreSQL, …) lets several processes or machines share one study. Study names
include a digest of the kernel sources and the search space, so editing a kernel starts afresh.
Workers sharing a study: each seeds its sampler afresh (or from ``--seed`` and ``--worker``), so
they explore different plans; claiming an enqueued trial is atomic (SQLite transactions begin
``IMMEDIATE``); a new database's schema is created under retries; a seed trial whose worker was
killed (left RUNNING) is enqueued again by the next run; the table's read-merge-write is locked.

After the search the best ``--top`` plans and the heuristic are measured again, interleaved,
``--rounds`` times; the fastest by median (the heuristic if nothing beats it) becomes the table
entry with both times. The table is rewritten (atomically) after every bucket, so Ctrl-C leaves
every finished bucket — and the best so far of the interrupted one — in the table.

Also writes ``results/tune_<GPU>.csv`` (every entry of the table: tuned and heuristic time) and
plots: ``tune_<GPU>_speedup.png`` (heuristic time / tuned time per bucket, every entry of the
table) and, over the studies of this run, ``tune_<GPU>_history.png`` (a panel per bucket: each
trial's time relative to the heuristic's, and the running best) and ``tune_<GPU>_importance.png``
(PED-ANOVA importances from ``optuna.importance``; no scikit-learn needed). Four files in all.

Cost: about 20 Optuna trials per bucket (~40 ms of bookkeeping each with SQLite, about half of
them pruned or repeated and never launched), one verification launch and one graph-timed
measurement per distinct plan, and ``--rounds`` x (``--top`` + 1) re-measurements. Kernel variants
are compiled up front for each head configuration, ``--jobs`` NVRTC compiles at a time.

``python -m fdpp.tune --show ...`` prints :func:`fdpp.dispatch.explain` for each problem instead.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fdpp import configs, tables, workspace
from fdpp.bench import FP8_DESCALE, HelpFormatter, _int_at_least, parse_page_sizes, shuffled_table
from fdpp.configs import (
    CLUSTER_SIZES,
    COMBINE_SLICES,
    H100,
    MAX_SPLITS,
    MIN_CHUNK,
    SM80,
    SM90,
    SPACE,
    CombineConfig,
    DecodeConfig,
    DecodeProblem,
    DeviceLimits,
    LaunchPlan,
    cluster_within,
    default_config,
    group_size_for,
    split_heuristic,
)
from fdpp.dtypes import DTYPES, INT4_FORMATS, kv_row_bytes
from fdpp.timing import VerificationError, VerifiedMeasure, randn

log = logging.getLogger("fdpp.tune")
_POSITIVE, _NONNEGATIVE = _int_at_least(1), _int_at_least(0)  # argparse types: an int >= 1 / >= 0

COMBINE_WARPS = (2, 4, 8)
MERGE_BUCKETS = (0, 4, 8, 16)  # fused merge's first-level bucket (0: configs.merge_bucket's default)
DEFAULT_SEQLENS = "1k,4k,16k,64k,256k"
DEFAULT_BATCH = "1,8"
DEFAULT_TRIALS = 20
MAX_FAILURES_IN_A_ROW = 3  # measurements raising (not mismatching) before a bucket gives up
MAX_BUCKET_ERRORS_IN_A_ROW = 2  # failed buckets before a run gives up
#: Half groups are searched where batch x KV heads is at most this. Run Z5 (H100, B = 1): llama3-70b
#: TP-8 heads (8 / 1) at half groups took 1k from 5.29 to 4.56 µs, 4k 7.03 -> 6.05, 16k 9.47 -> 9.30;
#: llama3-8b heads (32 / 8) were slower at every plan (results/device_runZ5/README.md).
HALF_GROUP_MAX_COHORTS = 4


# ---- search space ---------------------------------------------------------------------------
def split_candidates(problem: DecodeProblem, device: DeviceLimits) -> list[int]:
    """Split counts worth trying: powers of two, counts around 1, 2, 3, 4, 6, 8 whole waves of CTAs
    (splits x batch x head groups = k x SM count: the smallest count reaching it and the largest
    within it, so a kernel holding k CTAs per SM runs one wave) and the heuristic's count, each with
    chunks of at least MIN_CHUNK tokens; counts with the same effective split count (same chunk)
    deduplicated. (H200, llama3-8b INT4 B = 1, 64k, w4 s2 u1: 49 splits, 392 CTAs within 3 per SM,
    41.9 us; 50 splits, 400 CTAs, 55.9 us; results/device_runZ10/.)"""
    hi = max(1, min(MAX_SPLITS, problem.seqlen // MIN_CHUNK))
    base = problem.batch * (problem.num_q_heads // group_size_for(problem.ratio))
    cand = {1 << i for i in range(MAX_SPLITS.bit_length())}
    for k in (1, 2, 3, 4, 6, 8):
        cand |= {math.ceil(k * device.sm_count / base), k * device.sm_count // base}
    cand.add(split_heuristic(problem, device))
    return sorted({effective_splits(problem.seqlen, c, problem.page_size) for c in cand if 1 <= c <= hi})


def effective_splits(seqlen: int, num_splits: int, page_size: int = 0) -> int:
    """Splits launched for ``num_splits`` asked: :meth:`LaunchPlan.effective_splits` itself (chunks
    of whole pages when ``page_size`` > 0, so several counts can launch the same grid)."""
    probe = DecodeConfig("fp16", 128, page_size=page_size)  # only the page size matters here
    return LaunchPlan((probe,), max(1, int(num_splits))).effective_splits(seqlen)


def group_candidates(problem: DecodeProblem) -> list[int]:
    """Query heads per CTA the tuner tries: ``group_size_for(ratio)``, and half of it where batch
    x KV heads is at most :data:`HALF_GROUP_MAX_COHORTS` (few CTAs otherwise)."""
    g = group_size_for(problem.ratio)
    half = g % 2 == 0 and problem.batch * problem.num_kv_heads <= HALF_GROUP_MAX_COHORTS
    return [g, g // 2] if half else [g]


def kernel_candidates(problem: DecodeProblem) -> list[DecodeConfig]:
    """Phase-1 variants the tuner may launch for ``problem`` (:func:`fdpp.configs.kernel_space`
    at each of :func:`group_candidates`, the full group's first; valid or not)."""
    ks = getattr(configs, "kernel_space", None)
    out: list[DecodeConfig] = []
    for g in group_candidates(problem):
        if ks is not None:
            out += ks(problem.dtype, problem.head_dim, g, problem.page_size, problem.kv_dtype)
        else:
            out += [DecodeConfig(problem.dtype, problem.head_dim, g, **dict(zip(SPACE, v, strict=True)),
                                 page_size=problem.page_size)
                    for v in itertools.product(*SPACE.values())]
    return out


def _kernel_params(cands: Sequence[DecodeConfig]) -> dict[str, list[Any]]:
    """DecodeConfig fields that vary across ``cands`` -> their sorted values."""
    out: dict[str, list[Any]] = {}
    for f in tables.SPLIT_FIELDS:
        vals = sorted({getattr(c, f) for c in cands})
        if len(vals) > 1:
            out[f] = vals
    return out


def search_space(problem: DecodeProblem, device: DeviceLimits) -> dict[str, list[Any]]:
    """Optuna parameter name -> candidate values: the varying kernel fields, ``num_splits`` and
    ``combine_warps``."""
    space = _kernel_params(kernel_candidates(problem))
    space["num_splits"] = split_candidates(problem, device)
    space["combine_warps"] = list(COMBINE_WARPS)
    space["merge"] = ["fused", "combine"] + (["cluster"] if cluster_searched(problem, device) else [])
    space["combine_slices"] = [s for s in COMBINE_SLICES if problem.head_dim % (4 * s) == 0]
    space["merge_bucket"] = list(MERGE_BUCKETS)
    return space


def cluster_searched(problem: DecodeProblem, device: DeviceLimits) -> bool:
    """Whether the search offers the cluster merge: sm_90 or newer, a tensor-core phase 1 for the
    problem's dtype and head_dim, and room for two splits of MIN_CHUNK tokens."""
    return (device.cc[0] >= 9 and any(c.mma for c in kernel_candidates(problem))
            and problem.seqlen // MIN_CHUNK >= CLUSTER_SIZES[0])


def plan_from_params(problem: DecodeProblem, params: dict[str, Any]) -> LaunchPlan:
    """The plan of one trial's parameters (combine only when more than one split runs). Kernel
    fields that are not parameters keep the value of the first kernel candidate."""
    base = kernel_candidates(problem)[0]
    fields = {f: params.get(f, getattr(base, f)) for f in tables.SPLIT_FIELDS}
    cfg = DecodeConfig(problem.dtype, problem.head_dim, **fields, kv_dtype=problem.kv_dtype,
                       page_size=problem.page_size)
    splits = effective_splits(problem.seqlen, int(params["num_splits"]), problem.page_size)
    if params.get("merge") == "cluster":  # the largest cluster size within the split count
        c = cluster_within(int(params["num_splits"]))
        return LaunchPlan.cluster_merge(cfg, c, source="tune") if c > 1 else LaunchPlan.split_kv(cfg, 1, source="tune")
    comb = CombineConfig(problem.dtype, problem.head_dim, int(params["combine_warps"]),
                         int(params.get("combine_slices", 1)))
    return LaunchPlan.split_kv(cfg, splits, comb, source="tune", fused=params.get("merge") == "fused",
                               bucket=int(params.get("merge_bucket", 0)))


def params_of(plan: LaunchPlan, space: dict[str, list[Any]]) -> dict[str, Any]:
    """Trial parameters of ``plan`` for a study over ``space``."""
    p = {k: getattr(plan.split, k) for k in space if k in tables.SPLIT_FIELDS}
    p["num_splits"] = plan.num_splits
    p["combine_warps"] = plan.combine.num_warps if plan.combine is not None else 4
    if "merge" in space:
        p["merge"] = "cluster" if plan.mode == "cluster" else "fused" if plan.fused else "combine"
        p["combine_slices"] = plan.combine.slices if plan.combine is not None else 1
        p["merge_bucket"] = plan.bucket
    return p


def plan_key(plan: LaunchPlan, seqlen: int) -> str:
    """Identity of what a plan launches at ``seqlen`` (equal keys: same kernels, same grid)."""
    eff = plan.effective_splits(seqlen)
    if plan.mode == "cluster":
        comb = "cluster"  # the split key names the cluster size
    elif eff > 1 and plan.fused:
        comb = f"fused.b{plan.merge_bucket(seqlen)}"
    else:
        comb = plan.combine.key if (eff > 1 and plan.combine is not None) else "-"
    return f"{plan.split.key}|splits{eff}|{comb}"


# ---- objective (verify-then-time: fdpp.timing.VerifiedMeasure) -----------------------------
Measure = Callable[[LaunchPlan], float]


class Bench(Protocol):
    """What the tuning loop needs per bucket (``DecodeBench`` on a GPU; synthetic in tests)."""

    measure: Measure

    def close(self) -> None: ...


# ---- studies --------------------------------------------------------------------------------
def default_storage() -> str:
    d = tables.user_cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{d / 'tune.db'}"


def open_storage(url: str) -> Any:
    """An Optuna ``RDBStorage`` for ``url``, to be shared by every study of a run.

    Workers that start together on a new database race to create Optuna's schema (PostgreSQL:
    UniqueViolation / DuplicateTable; SQLite: a locked file): the storage is made under retries
    (:func:`_retrying`), and the loser finds the schema made.

    SQLite: waits up to 2 minutes for a lock (several processes on one file), and runs in WAL mode
    with ``synchronous=NORMAL``: Optuna commits ~20 times per trial, which at the default
    (``FULL``, an fsync per commit) costs more than measuring a small bucket. A crash of the
    process loses nothing; a power cut may lose the last trials, which a rerun redoes. Every
    transaction begins ``IMMEDIATE`` (:func:`_serializable_sqlite`).
    """
    import optuna

    if not url.startswith("sqlite:"):
        return _retrying(lambda: optuna.storages.RDBStorage(url))
    storage = _retrying(lambda: optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 120}}))
    _serializable_sqlite(storage.engine)
    storage.engine.dispose()  # connections opened by the constructor lack the settings
    return storage


def _retrying(make: Callable[[], Any], attempts: int = 8) -> Any:
    """``make()``, tried again (after 0.25, 0.5, … s) while it raises a database error."""
    from optuna.exceptions import StorageInternalError
    from sqlalchemy.exc import SQLAlchemyError

    for attempt in range(attempts):
        try:
            return make()
        except (SQLAlchemyError, StorageInternalError) as e:  # another process is creating the schema
            if attempt == attempts - 1:
                raise
            log.info("creating the storage: %s: %s; retrying", type(e).__name__, str(e)[:200])
            time.sleep(0.25 * (attempt + 1))
    raise AssertionError("unreachable")


def _serializable_sqlite(engine: Any) -> None:
    """SQLite connections of ``engine``: WAL, ``synchronous=NORMAL``, and ``BEGIN IMMEDIATE``.

    pysqlite begins a transaction only at the first write, so Optuna's read-then-update steps are
    not atomic across processes: two workers could both see an enqueued trial WAITING and both
    claim it (``SELECT ... FOR UPDATE`` is a no-op on SQLite), then both measure it and the second
    ``tell`` fails. Taking the write lock when a transaction begins serialises them; the second
    worker sees the trial RUNNING and takes another.
    """
    from sqlalchemy import event

    def connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # pysqlite emits no BEGIN of its own; "begin" below does
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    def begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    event.listen(engine, "connect", connect)
    event.listen(engine, "begin", begin)


def study_name(device: DeviceLimits, bucket: tables.Bucket, space: dict[str, list[int]]) -> str:
    srcs = {s: tables.current_hash(s) for s in ("decode_split.cu", "decode_combine.cu")}
    blob = json.dumps([space, srcs, list(device.cc), device.sm_count, device.smem_per_block], sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:10]
    return f"fdpp.{tables.table_filename(device.name)[:-5]}.{bucket.key}.{digest}"


@dataclass
class BucketResult:
    bucket: tables.Bucket
    study: Any
    entry: tables.Entry | None = None
    measured: int = 0  # distinct plans measured in the study (all runs)
    new_trials: int = 0
    interrupted: bool = False
    error: str | None = None
    seconds: float = 0.0


def _complete(study: Any) -> list[Any]:
    import optuna

    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))


def _measured(trials: Iterable[Any]) -> list[Any]:
    return [t for t in trials if "plan_key" in t.user_attrs and "repeat_of" not in t.user_attrs]


def _distinct(trials: Iterable[Any]) -> int:
    """Distinct plans measured among ``trials`` (workers sharing a study may measure one twice)."""
    return len({t.user_attrs["plan_key"] for t in _measured(trials)})


def worker_seed(seed: int | None, worker: int = 0) -> int:
    """The sampler seed of one worker process: ``seed`` mixed with the worker's index, so workers
    sharing a storage with one ``--seed`` (and distinct ``--worker``) suggest different plans;
    ``seed`` None: fresh entropy (``os.urandom``), different in every process."""
    ss = np.random.SeedSequence() if seed is None else np.random.SeedSequence([seed, worker])
    return int(ss.generate_state(1)[0])


def tune_bucket(problem: DecodeProblem, device: DeviceLimits, measure: Measure, *, storage: Any,
                trials: int = DEFAULT_TRIALS, timeout: float | None = None, seed: int | None = 0,
                space: dict[str, list[int]] | None = None, rounds: int = 2, top: int = 2,
                on_trial: Callable[[Any], None] | None = None, prior: LaunchPlan | None = None) -> BucketResult:
    """Run (or resume) the study of ``problem``'s bucket until ``trials`` distinct plans are measured.

    ``problem`` must be a bucket problem (powers of two). Returns the study and the table entry
    (None when no plan passed verification). Ctrl-C: returns with ``interrupted`` set and an entry
    from the trials done so far (not re-measured). ``seed``: of the sampler (plus the number of
    trials already in the study); None: a fresh one (:func:`worker_seed`). Processes sharing a
    study need different seeds, or they suggest the same plans. ``storage``: an Optuna storage
    (:func:`open_storage`) or its URL. ``prior``: a plan measured among the first trials (the one
    a table had for the bucket, :func:`prior_plans`), so a short re-tune cannot miss it.
    """
    import optuna

    if isinstance(storage, str):
        storage = open_storage(storage)
    bucket = tables.Bucket.of(problem)
    if bucket.problem() != problem:
        raise ValueError(f"{problem} is not a bucket problem (seqlen and batch powers of two)")
    space = search_space(problem, device) if space is None else space
    name = study_name(device, bucket, space)
    n_points = math.prod(len(v) for v in space.values())
    grid = n_points <= trials
    t0 = time.perf_counter()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.simplefilter("ignore", FutureWarning)
        probe = optuna.create_study(storage=storage, study_name=name, direction="minimize",
                                    load_if_exists=True)
        existing = probe.get_trials(deepcopy=False)
        seed = (worker_seed(None) if seed is None else seed + len(existing)) % 2**32  # numpy's range
        if grid:
            sampler: Any = optuna.samplers.GridSampler(space, seed=seed)
        else:
            sampler = optuna.samplers.TPESampler(
                seed=seed, multivariate=True, n_startup_trials=max(4, trials // 3))
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
    study.set_user_attr("bucket", bucket.to_json())
    study.set_user_attr("device", device.name)
    res = BucketResult(bucket, study)
    members = set(kernel_candidates(problem))
    for p in _missing_seed_points(_seed_points(problem, device, space, prior), existing):
        study.enqueue_trial(p)

    cap = 4 * trials + 16  # repeats and pruned points cost little, but a search must end
    done: dict[str, Any] = {t.user_attrs["plan_key"]: t for t in _measured(_complete(study))}

    failures: list[BaseException] = []

    def objective(trial: Any) -> float:
        params = {name: trial.suggest_categorical(name, space[name]) for name in space}
        plan = plan_from_params(problem, params)
        why = ("not a variant of configs.kernel_space" if replace(plan.split, cluster=1) not in members else
               plan.split.check(device) or (plan.combine.check(device) if plan.combine else None))
        if why:
            trial.set_user_attr("invalid", why)
            raise optuna.TrialPruned(why)
        key = plan_key(plan, problem.seqlen)
        trial.set_user_attr("plan_key", key)
        prev = done.get(key)
        if prev is None:  # measured by another process since?
            prev = next((t for t in _measured(_complete(study)) if t.user_attrs["plan_key"] == key), None)
        if prev is not None:
            trial.set_user_attr("repeat_of", prev.number)
            return prev.value
        trial.set_user_attr("pid", os.getpid())
        try:
            value = measure(plan)
        except VerificationError as e:
            trial.set_user_attr("verify_error", str(e))
            log.warning("%s %s: wrong output (%s); never chosen", bucket.key, key, e)
            return math.inf
        except Exception as e:  # noqa: BLE001 - compile or launch failure of one variant: record, go on
            trial.set_user_attr("error", f"{type(e).__name__}: {str(e)[:500]}")
            what = ("failed to compile (a bug in DecodeConfig.check)" if isinstance(e, _compile_errors())
                    else "failed")
            log.error("%s %s %s: %s: %s", bucket.key, key, what, type(e).__name__, str(e)[:300])
            failures.append(e)
            if len(failures) >= MAX_FAILURES_IN_A_ROW:  # systematic (or a dead CUDA context): stop
                raise RuntimeError(f"{len(failures)} measurements in a row failed; last: "
                                   f"{type(e).__name__}: {e}") from e
            return math.inf
        failures.clear()
        if not math.isfinite(value) or value <= 0:
            trial.set_user_attr("error", f"bad time {value!r}")
            return math.inf
        return float(value)

    def after(study: Any, trial: Any) -> None:
        if trial.state == optuna.trial.TrialState.COMPLETE and "repeat_of" not in trial.user_attrs \
                and "plan_key" in trial.user_attrs:
            done.setdefault(trial.user_attrs["plan_key"], trial)
            res.new_trials += 1
            if on_trial is not None:
                on_trial(trial)
        all_t = study.get_trials(deepcopy=False)
        if _distinct(t for t in all_t if t.state == optuna.trial.TrialState.COMPLETE) >= trials \
                or len(all_t) >= cap:
            study.stop()

    measured_now = _distinct(_complete(study))
    exhausted = grid and len([t for t in existing if t.state.is_finished()]) >= n_points + 1
    if measured_now < trials and not exhausted and len(existing) < cap:
        try:
            study.optimize(objective, timeout=timeout, callbacks=[after], gc_after_trial=False)
        except KeyboardInterrupt:
            res.interrupted = True
    res.measured = _distinct(_complete(study))
    try:
        res.entry = finalize(study, problem, device, measure, rounds=0 if res.interrupted else rounds, top=top)
    except KeyboardInterrupt:
        res.interrupted = True
        res.entry = finalize(study, problem, device, measure, rounds=0, top=top)
    res.seconds = time.perf_counter() - t0
    return res


def _missing_seed_points(points: list[dict[str, Any]], existing: Sequence[Any]) -> list[dict[str, Any]]:
    """The seed points no trial of the study answers yet: one is answered by a COMPLETE or PRUNED
    trial of its parameters, or by one WAITING to run. A RUNNING trial may be one whose process
    was killed (it stays RUNNING for ever) and a FAIL one measured nothing, so neither counts:
    their point is enqueued again (a worker that is alive and running it meanwhile costs one
    duplicate measurement at most; the later trial is a repeat if the first finished)."""
    import optuna

    S = optuna.trial.TrialState
    answered = [t.params or t.system_attrs.get("fixed_params") for t in existing  # WAITING: fixed_params
                if t.state in (S.COMPLETE, S.PRUNED, S.WAITING)]
    return [p for p in points if p not in answered]


def _seed_points(problem: DecodeProblem, device: DeviceLimits, space: dict[str, list[Any]],
                 prior: LaunchPlan | None = None) -> list[dict[str, Any]]:
    """The first trials of a study: the heuristic's plan (so tuned >= heuristic), the ``prior``
    plan if given (a table's earlier pick), then the heuristic's kernel with the split counts that
    fill the GPU with 1 and 2 whole waves of CTAs and the largest within 3 (the split count matters
    most; TPE starts from there)."""
    heur = _heuristic(problem, device)
    if heur is None:
        return []
    base = problem.batch * (problem.num_q_heads // group_size_for(problem.ratio))
    # the heuristic's count as launched (paged: chunks of whole pages may launch fewer splits)
    points = [{**params_of(heur, space), "num_splits": heur.effective_splits(problem.seqlen)}]
    prior_point = [] if prior is None else [params_of(prior, space)]
    # the split-count seeds take the heuristic's kernel merged in the launch (a cluster heuristic's
    # fused twin: a cluster's split count is its size)
    wave = {**points[0], "merge": "fused"} if points[0].get("merge") == "cluster" else points[0]
    # (and the largest count within 3 waves: a kernel holding 3 CTAs per SM in one wave)
    for n in (math.ceil(device.sm_count / base), math.ceil(2 * device.sm_count / base), 3 * device.sm_count // base):
        s = effective_splits(problem.seqlen, max(1, n), problem.page_size)
        p = {**wave, "num_splits": s, "combine_warps": wave["combine_warps"]}
        if p not in points:
            points.append(p)
    if "merge" in space:  # the other merge of each seed point: fused and two-launch both measured
        other = {"fused": "combine", "combine": "fused"}
        for p in list(points):
            if p["merge"] not in other:
                continue
            q = {**p, "merge": other[p["merge"]]}
            if q not in points:
                points.append(q)
    if "cluster" in space.get("merge", ()):  # the cluster merge at the largest cluster the GPU holds, and half
        c = max(cluster_within(device.sm_count // base), CLUSTER_SIZES[0])
        for n in (c, c // 2):
            p = {**points[0], "merge": "cluster", "num_splits": n}
            if n in CLUSTER_SIZES and p not in points:
                points.append(p)
    if len(space.get("group_size", ())) > 1:  # half groups: every seed again at the smaller group
        half = min(space["group_size"])
        points += [q for q in ({**p, "group_size": half} for p in list(points)) if q not in points]
    points[1:1] = [p for p in prior_point if p not in points]
    return [p for p in points if all(v in space.get(k, ()) for k, v in p.items())]


def prior_plans(path: Path | str) -> dict[str, LaunchPlan]:
    """The plan of every entry of the table at ``path`` by bucket key, stale entries included (a
    kernel edit leaves the plan a good first guess). Seeds for a re-tune (:func:`tune_bucket`'s
    ``prior``): entries that do not parse are left out. Raises FileNotFoundError when there is no
    file, ValueError when it is not a table's JSON."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text()).get("entries", {})
    except AttributeError as e:
        raise ValueError(f"{path}: not a table (no entries object)") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    out: dict[str, LaunchPlan] = {}
    for d in raw.values() if isinstance(raw, dict) else ():
        try:
            e = tables.Entry.from_json(d)
        except (KeyError, TypeError, ValueError):
            continue
        out[e.bucket.key] = e.plan(source="prior")
    return out


def _heuristic(problem: DecodeProblem, device: DeviceLimits) -> LaunchPlan | None:
    """The heuristic's plan, or None where it cannot run on ``device``."""
    try:
        plan = default_config(problem, device)
    except ValueError:
        return None
    return plan if plan.split.check(device) is None else None


def _compile_errors() -> tuple[type[BaseException], ...]:
    from fdpp.registry import KernelCompileError

    return (KernelCompileError,)


#: A plan of fewer launches wins over the fastest plan when its GPU time is within
#: min(LAUNCH_TIE x that time, LAUNCH_TIE_US) of it: every launch costs the host 4.5-6 us per eager
#: call (``scripts/host_profile.py``'s "empty kernel" rows on the H200, run G1) and an eager call at
#: short contexts is host-bound, while a graph replay pays at most LAUNCH_TIE_US for it.
LAUNCH_TIE = 0.05
LAUNCH_TIE_US = 0.4


def _launch_count(plan: LaunchPlan, seqlen: int) -> int:
    return len(plan.launches(seqlen))


def prefer_fewer_launches(times: dict[str, float], plans: dict[str, LaunchPlan], seqlen: int) -> str:
    """The key of the winner among measured ``times``: the fastest, unless a plan of fewer launches
    is within the launch tie of it (``LAUNCH_TIE``, ``LAUNCH_TIE_US``; then the fastest of those
    with the fewest launches)."""
    best = min(times, key=lambda k: times[k])
    if not math.isfinite(times[best]) or best not in plans:
        return best
    limit = times[best] + min(LAUNCH_TIE * times[best], LAUNCH_TIE_US)
    close = [k for k in times if k in plans and times[k] <= limit]
    return min(close, key=lambda k: (_launch_count(plans[k], seqlen), times[k]))


def finalize(study: Any, problem: DecodeProblem, device: DeviceLimits, measure: Measure, *,
             rounds: int = 2, top: int = 2) -> tables.Entry | None:
    """The table entry of a study: its ``top`` best verified plans and the heuristic measured again
    ``rounds`` times, interleaved; fastest median wins. ``rounds=0`` uses the trial values."""
    bucket = tables.Bucket.of(problem)
    good = sorted((t for t in _measured(_complete(study)) if math.isfinite(t.value)), key=lambda t: t.value)
    if not good:
        log.warning("%s: no plan passed verification; no table entry", bucket.key)
        return None
    cands: dict[str, LaunchPlan] = {}
    for t in good:
        if len(cands) >= max(1, top):
            break
        cands.setdefault(t.user_attrs["plan_key"], plan_from_params(problem, t.params))
    counts = {_launch_count(p, problem.seqlen) for p in cands.values()}
    for t in good:  # and the fastest plan of every other launch count (LAUNCH_TIE)
        p = plan_from_params(problem, t.params)
        if _launch_count(p, problem.seqlen) not in counts:
            counts.add(_launch_count(p, problem.seqlen))
            cands.setdefault(t.user_attrs["plan_key"], p)
    heur = _heuristic(problem, device)
    heur_ok = heur is not None
    hkey = plan_key(heur, problem.seqlen) if heur is not None else "-"
    hplan = dataclasses.replace(heur, source="tune") if heur is not None else None
    measured = _measured(_complete(study))
    by_key = {t.user_attrs["plan_key"]: t for t in measured}
    if rounds > 0:
        plans = {**cands, hkey: hplan} if heur_ok else dict(cands)
        samples: dict[str, list[float]] = {k: [] for k in plans}
        for _ in range(rounds):
            for k, p in plans.items():
                try:
                    samples[k].append(measure(p))
                except KeyboardInterrupt:
                    raise
                except Exception as e:  # noqa: BLE001 - wrong or failing now: not a winner
                    log.warning("%s: re-measuring %s: %s: %s", bucket.key, k, type(e).__name__, e)
                    samples[k].append(math.inf)
        times = {k: statistics.median(v) for k, v in samples.items()}
    else:
        times = {k: by_key[k].value for k in cands}
        if hkey in by_key and heur_ok:
            times[hkey] = by_key[hkey].value
        plans = {**cands, hkey: hplan}
    best = prefer_fewer_launches(times, {k: p for k, p in plans.items() if p is not None}, problem.seqlen)
    if not math.isfinite(times[best]):
        return None
    return tables.Entry.from_plan(
        bucket, plans[best], time_us=times[best], heuristic_time_us=times.get(hkey),
        trials=len(measured), verified=len(good), study=study.study_name, heuristic_won=best == hkey)


# ---- GPU bench ------------------------------------------------------------------------------
_ADVERSARIAL_LENGTHS = (1, 54, 97, 0, 4097, 333, 2048, 17)


def verify_lengths(batch: int, seqlen: int, token_bytes: int, budget: int) -> list[int]:
    """Per-request lengths of the verification call, within ``budget`` bytes of K and V in all:
    the other requests get short adversarial lengths (0, 1, 54, 97, …; together at most half the
    budget), request 0 the rest (all of N_max when it fits)."""
    tokens = max(1, budget // max(1, token_bytes))
    cap = max(1, tokens // (2 * (batch - 1))) if batch > 1 else 0
    rest = [min(seqlen, cap, _ADVERSARIAL_LENGTHS[(i - 1) % len(_ADVERSARIAL_LENGTHS)]) for i in range(1, batch)]
    return [max(1, min(seqlen, tokens - sum(rest)))] + rest


def parse_kv_dtypes(text: str) -> list[str]:
    """``--kv-dtype``: '' / 'same' (q's dtype), FP8 format names or INT4 ("int4": groups of 64;
    "int4_g32", "int4_g64", "int4_g128"), comma-separated."""
    from fdpp.dtypes import INT4_FORMATS, KV_FORMATS

    out = []
    for t in (x.strip() for x in (text or "").split(",")):
        if t in ("", "same"):
            out.append("")
        elif t in KV_FORMATS or t in INT4_FORMATS:
            out.append(t)
        elif t == "int4":
            out.append("int4_g64")
        else:
            raise ValueError(f"--kv-dtype: choose from 'same', {', '.join(sorted(KV_FORMATS))}, int4, "
                             f"{', '.join(INT4_FORMATS)}; got {t!r}")
    return list(dict.fromkeys(out))


def _int4_cache(xp: Any, shape: tuple[int, ...], g: int, rng: Any) -> tuple[Any, ...]:
    """INT4 K and V of a cache of ``shape`` (last axis D): random uint8 code pairs and fp16 scales
    U(0.01, 0.3), zeros -8 x scale per group of ``g``: (k, v, k scale, v scale, k zero, v zero)."""
    *lead, d = shape
    codes = [rng.integers(0, 256, size=(*lead, d // 2), dtype=np.uint8) for _ in range(2)]
    sc = [rng.uniform(0.01, 0.3, size=(*lead, d // g)).astype(np.float16) for _ in range(2)]
    zp = [(x.astype(np.float32) * -8.0).astype(np.float16) for x in sc]
    return (*codes, *sc, *zp)


def _fp8_codes(xp: Any, shape: tuple[int, ...], dtype: np.dtype, rng: Any) -> Any:
    """uint8 FP8 codes: the top byte of fp16 N(0, 16) data (its E5M2 code rounded toward zero,
    so N(0, 1/16) after FP8_DESCALE; read as E4M3 another spread of finite values), never an
    E4M3 NaN code. The reference dequantises whatever the codes are."""
    x = randn(xp, shape, np.dtype(np.float16), rng)
    x *= np.float16(4.0)
    codes = (x.view(xp.uint16) >> 8).astype(xp.uint8)
    codes[(codes & 0x7f) == 0x7f] = 0  # E4M3's NaN codes never occur
    return codes


def _gpu_timer(device_id: int) -> Callable[[list[Callable[[], object]], int, int], float]:
    from fdpp import timing

    def timer(calls: list[Callable[[], object]], calls_per_replay: int, repeats: int) -> float:
        return float(timing.time_calls(calls, calls_per_replay=calls_per_replay, warmup=2,
                                       repeats=repeats, use_graph=True).median_us)

    return timer


@dataclass
class _InputSet:
    """One rotated input set: q, K and V (contiguous [B, N, Hkv, D], or page pools
    [num_pages, page_size, Hkv, D] with ``table``), and the output."""

    q: Any
    k: Any
    v: Any
    out: Any
    table: Any = None  # int32 [B, pages per request]: a random permutation of the pool (paged)
    params: tuple[Any, ...] | None = None  # INT4: fp16 (K scale, V scale, K zero, V zero), as k with D // g


class DecodeBench:
    """One bucket's inputs on the device and its ``measure(plan)`` (verify, then time).

    - timing: ``n_sets`` input sets (``fdpp.timing.rotation_count`` of them, so they exceed L2
      four times over, capped by free memory), q/k/v/out each, all NHD, random normal; a paged
      problem gets page pools and a shuffled block table per set (:func:`shuffled_table`; width
      ceil(seqlen / page_size)), every request using all ``seqlen`` tokens;
    - verification: the same K/V (and block table) of set 0 (so the launch has the timed geometry:
      same N_max, chunk and grid) with its own q and per-request lengths from
      :func:`verify_lengths`, whose tokens (at most ``verify_bytes`` of K and V; the pages holding
      them when paged) are copied to the host once for the float64 reference.

    ``xp=numpy`` with a ``timer`` runs the same code on the CPU (the API's NumPy path; tests).
    """

    def __init__(self, problem: DecodeProblem, *, device_id: int = 0, xp: Any = None, seed: int = 0,
                 verify_bytes: int = 16 << 20, timer: Callable[..., float] | None = None,
                 repeats: int = 5, max_sets: int | None = None) -> None:
        if xp is None:
            import cupy as xp  # noqa: N813
        self.xp, self.problem, self.device_id, self.repeats = xp, problem, device_id, repeats
        p = problem
        dt = DTYPES[p.dtype].np_dtype
        self.on_gpu = xp.__name__ == "cupy"
        self.pages_per_seq = -(-p.seqlen // p.page_size) if p.paged else 0
        self._ctx = xp.cuda.Device(device_id) if self.on_gpu else contextlib.nullcontext()
        with self._ctx:
            rng = xp.random.default_rng(seed) if hasattr(xp.random, "default_rng") else xp.random
            host_rng = np.random.default_rng(seed)  # block-table permutations
            n_sets = self._set_count(max_sets)
            self.sets = [self._input_set(rng, host_rng) for _ in range(n_sets)]
            token_bytes = 2 * p.num_kv_heads * kv_row_bytes(p.kv_dtype, p.head_dim)
            self.lengths = verify_lengths(p.batch, p.seqlen, token_bytes, verify_bytes)
            self.q_verify = randn(xp, (p.batch, p.num_q_heads, p.head_dim), dt, rng)
            self.lens_dev = xp.asarray(np.asarray(self.lengths, dtype=np.int32))
            # timing lengths: every request full (contiguous: no lengths, as decode_attention defaults)
            self.lens_full = xp.asarray(np.full(p.batch, p.seqlen, dtype=np.int32)) if p.paged else None
            self.reference = self._reference()
        est_us = 3.0 + p.kv_bytes() / 4.0e6  # ~4 TB/s plus a launch: only sizes the graph
        self.calls_per_replay = int(min(20, max(2, math.ceil(1000.0 / est_us))))
        self._timer = timer if timer is not None else _gpu_timer(device_id)
        self.measure: Measure = VerifiedMeasure(self.run, self.reference, self.time, p.dtype)

    def set_bytes(self) -> int:
        """Device bytes of one input set (K and V or their pools, q, out, block table)."""
        p = self.problem
        qo = 2 * p.batch * p.num_q_heads * p.head_dim * DTYPES[p.dtype].itemsize
        if not p.paged:
            return p.kv_bytes() + qo
        pages = p.batch * self.pages_per_seq
        return 2 * pages * p.page_size * p.num_kv_heads * kv_row_bytes(p.kv_dtype, p.head_dim) + qo + 4 * pages

    def _set_count(self, max_sets: int | None) -> int:
        """Rotated sets: enough to exceed 4x L2 (at most 256 and 60 % of free memory); 1 on the CPU."""
        n_sets, set_bytes = 1, self.set_bytes()
        if self.on_gpu:
            from fdpp import timing

            n_sets = timing.rotation_count(set_bytes, timing.l2_bytes(self.device_id), factor=4, max_sets=256)
            free = self.xp.cuda.runtime.memGetInfo()[0]
            n_sets = max(1, min(n_sets, int(0.6 * free // max(1, set_bytes))))
        if max_sets is not None:
            n_sets = max(1, min(n_sets, max_sets))
        return n_sets

    def _input_set(self, rng: Any, host_rng: np.random.Generator) -> _InputSet:
        p, xp = self.problem, self.xp
        dt = DTYPES[p.dtype].np_dtype
        q_shape = (p.batch, p.num_q_heads, p.head_dim)
        kv = _fp8_codes if p.quantized else randn
        i4 = INT4_FORMATS.get(p.kv_dtype)
        if not p.paged:
            kv_shape = (p.batch, p.seqlen, p.num_kv_heads, p.head_dim)
            if i4 is not None:
                c = _int4_cache(xp, kv_shape, i4.group_size, rng)
                return _InputSet(randn(xp, q_shape, dt, rng), c[0], c[1], xp.empty(q_shape, dtype=dt), params=c[2:])
            return _InputSet(randn(xp, q_shape, dt, rng), kv(xp, kv_shape, dt, rng),
                             kv(xp, kv_shape, dt, rng), xp.empty(q_shape, dtype=dt))
        pool = (p.batch * self.pages_per_seq, p.page_size, p.num_kv_heads, p.head_dim)
        table = shuffled_table(host_rng, p.batch, self.pages_per_seq)
        if i4 is not None:
            c = _int4_cache(xp, pool, i4.group_size, rng)
            return _InputSet(randn(xp, q_shape, dt, rng), c[0], c[1], xp.empty(q_shape, dtype=dt), xp.asarray(table),
                             c[2:])
        return _InputSet(randn(xp, q_shape, dt, rng), kv(xp, pool, dt, rng), kv(xp, pool, dt, rng),
                         xp.empty(q_shape, dtype=dt), xp.asarray(table))

    def _kv_args(self, s: _InputSet) -> dict[str, Any]:
        """decode_attention's quantised-cache arguments (FP8: the codes of :func:`_fp8_codes`;
        INT4: set ``s``'s scales and zeros)."""
        p = self.problem
        if s.params is not None:
            ks, vs, kz, vz = s.params
            return dict(kv_dtype="int4", k_descale=ks, v_descale=vs, k_zero=kz, v_zero=vz)
        return dict(kv_dtype=p.kv_dtype, k_descale=FP8_DESCALE, v_descale=FP8_DESCALE) if p.quantized else {}

    def _deq(self, s: _InputSet, which: int, idx: Any) -> np.ndarray:
        """Host values of K (``which`` 0) or V (1) of set ``s`` at index ``idx``, dequantised."""
        from fdpp.quant import dequant_int4
        from fdpp.reference import dequant_fp8_cache

        p = self.problem
        x = self._host((s.k, s.v)[which][idx])
        if s.params is not None:
            return dequant_int4(x, self._host(s.params[which][idx]), self._host(s.params[2 + which][idx]),
                                INT4_FORMATS[p.kv_dtype].group_size)
        return dequant_fp8_cache(x, p.kv_dtype, FP8_DESCALE) if p.quantized else x

    def _host(self, x: Any) -> np.ndarray:
        return self.xp.asnumpy(x) if self.on_gpu else np.asarray(x)

    def _reference(self) -> tuple[np.ndarray, np.ndarray]:
        """float64 (out, lse) of the verification call, request by request, from the verified
        tokens only (paged: the pages holding them, found through set 0's block table)."""
        from fdpp.reference import attention_reference, paged_attention_reference

        s0, page = self.sets[0], self.problem.page_size
        qh = self._host(self.q_verify)
        outs, lses = [], []
        for i, n in enumerate(self.lengths):
            if s0.table is None:
                sel = (slice(i, i + 1), slice(0, n))
                o, lse = attention_reference(qh[i:i + 1], self._deq(s0, 0, sel), self._deq(s0, 1, sel))
            else:  # its pages, in table order, as a pool of their own (one page even when n == 0)
                ids = s0.table[i, :max(1, -(-n // page))]
                kp, vp = self._deq(s0, 0, ids), self._deq(s0, 1, ids)
                o, lse = paged_attention_reference(qh[i:i + 1], kp, vp, np.arange(len(kp), dtype=np.int32)[None],
                                                   np.array([n], dtype=np.int32))
            outs.append(o)
            lses.append(lse)
        return np.concatenate(outs), np.concatenate(lses)

    def _attend(self, s: _InputSet, q: Any, lens: Any, **kw: Any) -> Any:
        """One call on set ``s``: ``paged_decode_attention`` through its block table, else
        ``decode_attention``."""
        from fdpp import api

        kw.update(self._kv_args(s))
        if s.table is not None:
            return api.paged_decode_attention(q, s.k, s.v, s.table, lens, **kw)
        return api.decode_attention(q, s.k, s.v, cache_seqlens=lens, **kw)

    def run(self, plan: LaunchPlan) -> tuple[np.ndarray, np.ndarray]:
        """The verification launch of ``plan``: (out, lse) on the host."""
        from fdpp import dispatch

        with self._ctx, dispatch.forced_plan(plan):
            out, lse = self._attend(self.sets[0], self.q_verify, self.lens_dev, return_lse=True)
        return self._host(out), self._host(lse)

    def time(self, plan: LaunchPlan) -> float:
        """Median µs per call of ``plan`` over the rotated input sets."""
        from fdpp import dispatch

        def make(s: _InputSet) -> Callable[[], object]:
            def call() -> object:
                with dispatch.forced_plan(plan):
                    return self._attend(s, s.q, self.lens_full, out=s.out)

            return call

        # time_calls captures on a new stream each time and the API keeps a partials workspace
        # per stream: drop the ones this measurement made (its graph is gone when it returns),
        # or hundreds of trials would pile them up on the device.
        with workspace.scoped(), self._ctx:
            return self._timer([make(s) for s in self.sets], self.calls_per_replay, self.repeats)

    def close(self) -> None:
        self.sets, self.q_verify, self.lens_dev, self.lens_full = [], None, None, None
        if self.on_gpu:
            self.xp.get_default_memory_pool().free_all_blocks()


def precompile(configs: Sequence[Any], device_id: int = 0, jobs: int = 8) -> dict[str, str]:
    """Compile ``configs`` (NVRTC, CuPy's disk cache) in a thread pool; returns key -> error."""
    from fdpp import registry

    errors: dict[str, str] = {}

    def one(c: Any) -> None:
        try:
            registry.get_kernel(c, device_id)
        except Exception as e:  # noqa: BLE001 - reported; the trial of that variant fails again
            errors[c.key] = f"{type(e).__name__}: {e}"

    if jobs <= 1:
        for c in configs:
            one(c)
    else:
        with ThreadPoolExecutor(jobs) as ex:
            list(ex.map(one, configs))
    for k, e in errors.items():
        log.error("precompiling %s failed: %s", k, e[:300])
    return errors


def variants(heads: tables.HeadConfig, device: DeviceLimits) -> list[Any]:
    """Every valid kernel variant the search can launch for one head configuration, dtype and cache
    (the page size is a template parameter: each page size compiles its own variants)."""
    prob = DecodeProblem(1, heads.num_q_heads, heads.num_kv_heads, heads.head_dim, 1024, heads.dtype,
                         heads.kv_dtype, heads.page_size)
    out: list[Any] = [c for c in kernel_candidates(prob) if c.is_valid(device)]
    out += [CombineConfig(heads.dtype, heads.head_dim, w, s) for w in COMBINE_WARPS for s in COMBINE_SLICES
            if heads.head_dim % (4 * s) == 0]
    if cluster_searched(prob, device):  # the seeds' cluster variants; others compile when a trial picks them
        seed = default_config(prob, device).split
        out += [c for c in (replace(seed, cluster=x) for x in CLUSTER_SIZES) if c.is_valid(device)]
    return out


def runtime_versions() -> dict[str, Any]:
    """CUDA/CuPy/NVRTC/optuna versions for the table header."""
    v: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import optuna

        v["optuna"] = optuna.__version__
    except ImportError:  # pragma: no cover
        pass
    try:
        import cupy

        v["cupy"] = cupy.__version__
        v["cuda_runtime"] = int(cupy.cuda.runtime.runtimeGetVersion())
        v["cuda_driver"] = int(cupy.cuda.runtime.driverGetVersion())
        v["nvrtc"] = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
    except Exception:  # noqa: BLE001 - versions are informational
        pass
    return v


# ---- the loop -------------------------------------------------------------------------------
@dataclass
class RunResult:
    results: list[BucketResult] = field(default_factory=list)
    table: Path | None = None
    interrupted: bool = False
    aborted: bool = False  # stopped after buckets kept failing
    out_of_time: list[str] = field(default_factory=list)  # bucket keys never started (max_seconds)


def run_tuning(buckets: Sequence[tables.Bucket], device: DeviceLimits,
               make_bench: Callable[[DecodeProblem], Bench], *, storage: Any, out_dir: Path | str,
               trials: int = DEFAULT_TRIALS, timeout: float | None = None, seed: int | None = None,
               worker: int = 0, rounds: int = 2, top: int = 2, versions: dict[str, Any] | None = None,
               before_group: Callable[[tables.HeadConfig], None] | None = None,
               max_seconds: float | None = None, progress: bool = True,
               priors: dict[str, LaunchPlan] | None = None) -> RunResult:
    """Tune every bucket (grouped by head configuration and dtype), writing the table after each.

    ``timeout``: seconds per bucket. ``max_seconds``: for the whole run, compiles included: each
    bucket's search gets at most 3/4 of an equal share of what is left, and no bucket starts after
    it (those keep the heuristic; the table stays usable). Expect the last bucket and the report on
    top. ``seed``, ``worker``: the samplers' seed is :func:`worker_seed` of them (None: fresh in
    every process), so concurrent workers on one storage explore different plans. ``priors``: a plan
    per bucket key measured among each study's first trials (:func:`prior_plans`).
    """
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    run = RunResult()
    seed = worker_seed(seed, worker)
    t_end = None if max_seconds is None else time.monotonic() + max_seconds
    bar = tqdm(total=len(buckets) * trials, unit="trial", disable=not progress, dynamic_ncols=True)
    current: tables.HeadConfig | None = None
    skipping: tables.HeadConfig | None = None
    skipped_groups: list[tables.HeadConfig] = []
    with contextlib.ExitStack() as stack:
        if progress:
            stack.enter_context(logging_redirect_tqdm(loggers=[logging.getLogger("fdpp")]))
        try:
            for i, b in enumerate(buckets):
                if b.heads == skipping:
                    run.results.append(BucketResult(b, None, error="skipped: its group kept failing"))
                    bar.update(trials)
                    continue
                if t_end is not None and time.monotonic() >= t_end:
                    log.warning("out of time (max_seconds): %d buckets left untuned", len(buckets) - i)
                    run.out_of_time = [x.key for x in buckets[i:]]
                    break
                if b.heads != current:
                    if current is not None and current != skipping:
                        skipped_groups.clear()  # a group ran through: failures are not systematic
                    current = b.heads
                    if before_group is not None:
                        before_group(b.heads)
                bar.set_postfix_str(b.key)
                budget = timeout
                if t_end is not None:  # 3/4 of an equal share searches; set-up and re-measuring take the rest
                    share = max(1.0, 0.75 * (t_end - time.monotonic()) / (len(buckets) - i))
                    budget = share if budget is None else min(budget, share)
                r = _one_bucket(b, device, make_bench, storage=storage, trials=trials, timeout=budget,
                                seed=seed, rounds=rounds, top=top, on_trial=lambda _t: bar.update(1),
                                prior=(priors or {}).get(b.key))
                run.results.append(r)
                bar.update(max(0, trials - r.new_trials))
                last = run.results[-MAX_BUCKET_ERRORS_IN_A_ROW:]
                if len(last) == MAX_BUCKET_ERRORS_IN_A_ROW and all(
                        x.error and x.bucket.heads == b.heads for x in last):
                    skipping = b.heads
                    skipped_groups.append(b.heads)
                    log.error("%d buckets of %s failed in a row: skipping the rest of them",
                              MAX_BUCKET_ERRORS_IN_A_ROW, b.heads)
                    if len(skipped_groups) >= 2:
                        log.error("two groups in a row failed; stopping (see the errors above)")
                        run.aborted = True
                        break
                if r.entry is not None:
                    run.table = tables.write_table(out_dir, device, [r.entry], versions)
                    e = r.entry
                    ht = f"{e.heuristic_time_us:.2f}" if e.heuristic_time_us else "?"
                    log.info("%s: %s x%d %.2f us (heuristic %s us)%s", b.key, e.split.key, e.num_splits,
                             e.time_us or math.nan, ht, " [interrupted]" if r.interrupted else "")
                if r.interrupted:
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            run.interrupted = True
            log.warning("interrupted: the table keeps every finished bucket")
        finally:
            bar.close()
    return run


def _one_bucket(b: tables.Bucket, device: DeviceLimits, make_bench: Callable[[DecodeProblem], Bench],
                **kw: Any) -> BucketResult:
    try:
        bench = make_bench(b.problem())
        try:
            return tune_bucket(b.problem(), device, bench.measure, **kw)
        finally:
            bench.close()
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - one bucket failing (memory, …) must not lose the rest
        log.exception("bucket %s failed", b.key)
        return BucketResult(b, None, error=f"{type(e).__name__}: {e}")


# ---- report ---------------------------------------------------------------------------------
def write_report(device: DeviceLimits, table_path: Path | None, results: Sequence[BucketResult],
                 results_dir: Path | str, labels: dict[tables.HeadConfig, str] | None = None,
                 plots: bool = True) -> list[Path]:
    """CSV of every entry in the table (tuned vs heuristic) and the plots; returns the files."""
    import pandas as pd

    rdir = Path(results_dir)
    rdir.mkdir(parents=True, exist_ok=True)
    slug = tables.table_filename(device.name)[:-5]
    labels = dict(labels or {})
    entries = list(tables.read_table(table_path, device).entries.values()) if table_path else \
        [r.entry for r in results if r.entry is not None]
    for e in entries:
        labels.setdefault(e.bucket.heads, preset_names(e.bucket.heads))
    df = pd.DataFrame([_report_row(e, labels) for e in entries])
    csv = rdir / f"tune_{slug}.csv"
    df.to_csv(csv, index=False)
    if not plots or df.empty:
        return [csv]
    import matplotlib

    matplotlib.use("Agg")
    png = rdir / f"tune_{slug}_speedup.png"
    _speedup_figure(df, device, png)
    return [csv, png, *_study_plots(device, results, rdir, slug, labels)]


def _report_row(e: tables.Entry, labels: dict[tables.HeadConfig, str]) -> dict[str, Any]:
    """One table entry as a row of ``tune_<GPU>.csv``."""
    h, b = e.bucket.heads, e.bucket
    t, ht = e.time_us, e.heuristic_time_us
    return {
        "heads": f"{h.num_q_heads}/{h.num_kv_heads}", "head_dim": h.head_dim, "dtype": h.dtype,
        "page_size": h.page_size, "models": labels.get(h, ""), "seqlen": b.seqlen, "batch": b.batch,
        "kernel": e.split.key, "num_splits": e.num_splits,
        "chunk": LaunchPlan((e.split,), e.num_splits).chunk(b.seqlen), "combine_warps": e.combine_warps,
        "merge": e.merge, "combine_slices": e.combine_slices, "merge_bucket": e.merge_bucket, "time_us": t, "heuristic_time_us": ht,
        "speedup": (ht / t) if (t and ht) else None,
        "GBps": b.problem().kv_bytes() / (t * 1e3) if t else None,
        "trials": e.meta.get("trials"), "heuristic_won": e.meta.get("heuristic_won"),
    }


def _cache_label(page_size: int) -> str:
    return f", pages of {page_size}" if page_size else ""


def _short_cache(h: tables.HeadConfig) -> str:
    return f" p{h.page_size}" if h.page_size else ""


def _speedup_figure(df: Any, device: DeviceLimits, path: Path) -> None:
    """Heuristic time / tuned time per bucket: a panel per head configuration, dtype and cache."""
    import matplotlib.pyplot as plt

    keys = ["heads", "head_dim", "dtype", "page_size", "models"]
    groups = sorted(set(df[keys].itertuples(index=False, name=None)))
    fig, axes = plt.subplots(len(groups), 1, figsize=(9, 2.6 * len(groups) + 0.6), squeeze=False)
    for ax, (hd, d, dt, ps, models) in zip(axes[:, 0], groups, strict=True):
        sub = df[(df["heads"] == hd) & (df["head_dim"] == d) & (df["dtype"] == dt) & (df["page_size"] == ps)]
        seqs = sorted(sub["seqlen"].unique())
        batches = sorted(sub["batch"].unique())
        w = 0.8 / max(1, len(batches))
        for j, bt in enumerate(batches):
            s = sub[sub["batch"] == bt].set_index("seqlen").reindex(seqs)
            xs = np.arange(len(seqs)) + (j - (len(batches) - 1) / 2) * w
            ys = s["speedup"].astype(float).fillna(0).to_numpy()
            ax.bar(xs, ys, w, label=f"B={bt}")
            for x, y, t in zip(xs, ys, s["time_us"].astype(float).to_numpy(), strict=True):
                if y > 0:  # the tuned time on top of its bar
                    ax.text(x, y, f"{t:.3g}", ha="center", va="bottom", fontsize=5)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(np.arange(len(seqs)), [f"{n // 1024}k" if n >= 1024 else str(n) for n in seqs])
        ax.set_ylabel("heuristic / tuned")
        ax.set_ylim(0, max(1.2, float(sub["speedup"].astype(float).max()) * 1.15))
        ax.set_title(f"{models or 'heads ' + hd} (q/kv {hd}, d{d}) {dt}{_cache_label(ps)}", fontsize=9)
        ax.legend(fontsize=7, ncol=len(batches))
    axes[-1, 0].set_xlabel("N_max (bucket)")
    fig.suptitle(f"fdpp tuned vs heuristic plan, {device.name} (>1: tuned faster; labels: tuned µs)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _study_plots(device: DeviceLimits, results: Sequence[BucketResult], rdir: Path, slug: str,
                 labels: dict[tables.HeadConfig, str]) -> list[Path]:
    """Two figures over every study of ``results``: the optimisation histories (one panel per
    bucket, a row per head configuration, dtype and batch: time / heuristic time per trial and the
    running best) and the PED-ANOVA parameter importances (``optuna.importance``; a heatmap per head
    configuration and dtype, a column per bucket)."""
    import matplotlib.pyplot as plt

    by_group: dict[tables.HeadConfig, list[BucketResult]] = {}
    for r in results:
        if r.study is not None and _measured(_complete(r.study)):
            by_group.setdefault(r.bucket.heads, []).append(r)
    if not by_group:
        return []
    groups = sorted(by_group, key=lambda h: (h.dtype, h))

    def title(h: tables.HeadConfig) -> str:
        return f"{labels.get(h) or 'q/kv ' + str(h.num_q_heads) + '/' + str(h.num_kv_heads)} {h.dtype}{_short_cache(h)}"

    written: list[Path] = []
    try:
        p = rdir / f"tune_{slug}_history.png"
        _history_figure(by_group, groups, title, f"optimisation history per bucket, {device.name}", p)
        written.append(p)
    except Exception as e:  # noqa: BLE001 - a plot must not lose a tuning run
        log.warning("history plot failed: %s", e)
    imps = {h: _importances(by_group[h]) for h in groups}
    imps = {h: v for h, v in imps.items() if v}
    if imps:
        fig, axes = plt.subplots(len(imps), 1, squeeze=False,
                                 figsize=(1.6 + 0.62 * max(len(v) for v in imps.values()), 0.4 + 2.9 * len(imps)))
        for ax, (h, imp) in zip(axes[:, 0], imps.items(), strict=True):
            params = [pn for pn in tables.PARAM_NAMES if any(pn in x for x in imp.values())]
            grid = np.array([[x.get(pn, 0.0) for x in imp.values()] for pn in params])
            ax.imshow(grid, cmap="viridis", vmin=0, vmax=1, aspect="auto")
            for (i, j), v in np.ndenumerate(grid):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w" if v < 0.6 else "k")
            ax.set_xticks(np.arange(len(imp)), list(imp), rotation=40, ha="right", fontsize=6)
            ax.set_yticks(np.arange(len(params)), params, fontsize=7)
            ax.set_title(title(h), fontsize=8)
        fig.suptitle(f"PED-ANOVA parameter importances (optuna.importance), {device.name}", fontsize=9)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (0.4 + 2.9 * len(imps))))
        p = rdir / f"tune_{slug}_importance.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written


def _importances(rs: Sequence[BucketResult]) -> dict[str, dict[str, float]]:
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances

    out: dict[str, dict[str, float]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in sorted(rs, key=lambda r: (r.bucket.batch, r.bucket.seqlen)):
            try:
                out[_short(r.bucket)] = get_param_importances(
                    r.study, evaluator=PedAnovaImportanceEvaluator(), target=_importance_target(r.study))
            except Exception as e:  # noqa: BLE001 - too few trials, one value, …
                log.info("importances of %s: %s", r.bucket.key, e)
    return out


def _short(b: tables.Bucket) -> str:
    n = f"{b.seqlen // 1024}k" if b.seqlen >= 1024 else str(b.seqlen)
    return f"N{n} B{b.batch}"


def _history_figure(by_group: dict[tables.HeadConfig, list[BucketResult]], groups: list[tables.HeadConfig],
                    title: Callable[[tables.HeadConfig], str], suptitle: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    seqs = sorted({r.bucket.seqlen for rs in by_group.values() for r in rs})
    rows = [(h, b) for h in groups for b in sorted({r.bucket.batch for r in by_group[h]})]
    fig, axes = plt.subplots(len(rows), len(seqs), squeeze=False, sharey=True,
                             figsize=(1.7 * len(seqs) + 0.9, 1.55 * len(rows) + 0.9))
    for ax in axes.flat:
        ax.set_visible(False)
    lo = 0.4
    for row, (h, bt) in enumerate(rows):
        axes[row, 0].set_ylabel(f"{title(h)}\nB={bt}: t / heuristic", fontsize=6)
        for r in by_group[h]:
            if r.bucket.batch != bt:
                continue
            ax = axes[row, seqs.index(r.bucket.seqlen)]
            ax.set_visible(True)
            trials = sorted(_complete(r.study), key=lambda t: t.number)
            heur = _heuristic_value(r, trials)
            xs, ys, bad, best, run = [], [], [], [], math.inf
            for t in trials:
                if t.value is None or not math.isfinite(t.value):
                    bad.append(t.number)
                    continue
                xs.append(t.number)
                ys.append(t.value / heur)
                run = min(run, ys[-1])
                best.append((t.number, run))
            ax.scatter(xs, ys, s=7, color="tab:blue", alpha=0.7, label="trial")
            if bad:
                ax.scatter(bad, [1.6] * len(bad), marker="x", s=10, color="tab:red", label="wrong / failed")
            if best:
                bx, by = zip(*best, strict=True)
                ax.step(bx, by, where="post", color="tab:orange", label="best so far")
            ax.axhline(1.0, color="k", lw=0.6)
            if math.isfinite(run):
                lo = min(lo, 0.9 * run)
            ax.set_title(f"{_short(r.bucket)}: {run:.2f}", fontsize=6)
            ax.tick_params(labelsize=5)
    for row in range(len(rows)):  # sharey hides the labels of invisible first panels
        axes[row, 0].set_visible(True)
    axes[0, 0].set_ylim(lo, 1.7)  # shared; much slower trials sit off the top
    handles, names = next(ax for ax in axes.flat if ax.collections).get_legend_handles_labels()
    fig.legend(handles, names, loc="upper right", fontsize=7, ncol=3)
    fig.suptitle(suptitle + " (1 = the heuristic's plan; panel title: best)", fontsize=9, x=0.01, ha="left")
    fig.supxlabel("trial", fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (1.55 * len(rows) + 0.9)))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _heuristic_value(r: BucketResult, trials: Sequence[Any]) -> float:
    """Time of the heuristic's plan in a study (its first trial), else the first finite value."""
    if r.entry is not None and r.entry.heuristic_time_us:
        return r.entry.heuristic_time_us
    finite = [t.value for t in trials if t.value is not None and math.isfinite(t.value)]
    return finite[0] if finite else 1.0


def _importance_target(study: Any) -> Callable[[Any], float]:
    vals = [t.value for t in _complete(study) if t.value is not None and math.isfinite(t.value)]
    worst = 2.0 * max(vals) if vals else 1.0

    def target(t: Any) -> float:
        v = t.value
        return math.log(v if v is not None and math.isfinite(v) else worst)

    return target


# ---- CLI ------------------------------------------------------------------------------------
def parse_sizes(text: str) -> list[int]:
    """``"1k,4k,16k"`` -> [1024, 4096, 16384] (k = 1024, m = 1024²)."""
    out = []
    for tok in text.replace(" ", "").split(","):
        if not tok:
            continue
        mult = {"k": 1024, "m": 1024 * 1024}.get(tok[-1].lower(), 1)
        num = tok[:-1] if mult > 1 else tok
        try:
            out.append(int(float(num) * mult))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected sizes like 1k,4k,16k; {tok!r} is not one (in {text!r})") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes like 1k,4k,16k; got {text!r}")
    return out


def _model_tp(spec: str, tp: str, default: int) -> int:
    """The TP of a ``--model NAME[:TP]`` entry (``tp``: the text after the colon, "" for none)."""
    try:
        return int(tp.lower().removeprefix("tp")) if tp else default
    except ValueError:
        raise ValueError(f"--model takes NAME or NAME:TP (TP an int, e.g. llama3-70b:8), got {spec!r}") from None


def head_configs(args: argparse.Namespace) -> tuple[list[tuple[int, int, int]], dict[tuple[int, int, int], list[str]]]:
    """(Hq, Hkv, D) of the requested models (``NAME[:TP]``) and ``--heads``, in order, deduplicated."""
    from fdpp.models import get_model

    heads: list[tuple[int, int, int]] = []
    names: dict[tuple[int, int, int], list[str]] = {}
    for spec in args.model or []:
        name, _, tp = spec.partition(":")
        tpv = _model_tp(spec, tp, args.tp)
        h = get_model(name).heads(tpv)
        names.setdefault(h, []).append(name + (f"-tp{tpv}" if tpv > 1 else ""))
        if h not in heads:
            heads.append(h)
    for spec in args.heads or []:
        try:
            hq, hkv = (int(x) for x in spec.split("/"))
        except ValueError:
            raise ValueError(f"--heads takes HQ/HKV like 32/8, got {spec!r}") from None
        from fdpp.api import check_problem_sizes

        try:  # heads >= 1 grouped evenly, a head_dim the kernels take (ValueError names the field)
            check_problem_sizes(1, hq, hkv, args.head_dim, 0, 0, prefix="--heads/--head-dim: ")
        except TypeError as e:
            raise ValueError(str(e)) from None
        h = (hq, hkv, args.head_dim)
        names.setdefault(h, [])
        if h not in heads:
            heads.append(h)
    if not heads:
        h = get_model("llama3-8b").heads(1)
        heads, names = [h], {h: ["llama3-8b"]}
    return heads, names


def preset_names(h: tables.HeadConfig) -> str:
    """Model presets (at TP 1, 2, 4 or 8) whose per-GPU heads are ``h``, e.g. "llama3-70b-tp8"."""
    from fdpp.models import MODELS

    out = []
    for m in MODELS.values():
        for tp in (1, 2, 4, 8):
            try:
                if m.heads(tp) == (h.num_q_heads, h.num_kv_heads, h.head_dim):
                    out.append(m.name + (f"-tp{tp}" if tp > 1 else ""))
            except ValueError:
                pass
    return ", ".join(out)


def _add_problem_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("problems (head configurations x dtypes x caches x seqlen buckets x batch "
                              "buckets)")
    g.add_argument("--model", nargs="+", action="extend", metavar="NAME[:TP]",
                   help="model presets of fdpp.models (their per-GPU heads); ':TP' (or ':tpN') sets "
                        "the tensor-parallel degree of that model, e.g. llama3-70b:8. Default: "
                        "llama3-8b when neither --model nor --heads is given")
    g.add_argument("--tp", type=_POSITIVE, default=1, help="tensor-parallel degree for --model names without ':TP'")
    g.add_argument("--heads", nargs="+", action="extend", metavar="HQ/HKV",
                   help="explicit head configurations, e.g. 32/8 (with --head-dim)")
    g.add_argument("--head-dim", type=_POSITIVE, default=128, help="head_dim for --heads")
    g.add_argument("--dtype", default="fp16,bf16", help="comma-separated dtypes (fp16, bf16, fp32)")
    g.add_argument("--seqlens", type=parse_sizes, default=DEFAULT_SEQLENS,
                   help="KV lengths N_max; each is tuned at its bucket (nearest power of two)")
    g.add_argument("--batch", type=parse_sizes, default=DEFAULT_BATCH,
                   help="batch sizes; each is tuned at its bucket (nearest power of two)")
    g.add_argument("--kv-dtype", default="", metavar="LIST",
                   help="comma-separated K/V types: '' or 'same' (q's dtype), fp8_e4m3, fp8_e5m2, int4 "
                        "(groups of 64), int4_g32, int4_g64, int4_g128")
    g.add_argument("--page-size", type=parse_page_sizes, default="0", metavar="LIST",
                   help="KV caches to tune: comma list of page sizes, 0 = contiguous, else a power of two "
                        "in 1..256 (paged buckets, keys '.p<size>'), e.g. 0,16")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m fdpp.tune",
        description="Tune fdpp's split-KV decode kernels on this GPU with Optuna and write the table "
                    "tuning/<GPU>.json that fdpp.decode_attention dispatches from. With --show, print "
                    "which plan would run for each problem, and why, instead.",
        formatter_class=HelpFormatter)
    _add_problem_args(ap)
    s = ap.add_argument_group("search")
    s.add_argument("--trials", type=_POSITIVE, default=DEFAULT_TRIALS,
                   help="distinct plans measured per bucket, in total over runs (a rerun resumes; "
                        "repeats and pruned points are not counted)")
    s.add_argument("--timeout", type=float, default=None, help="seconds per bucket (Optuna timeout)")
    s.add_argument("--max-minutes", type=float, default=None,
                   help="wall-clock budget of the whole run, compiles included: each bucket's search "
                        "gets at most 3/4 of an equal share of what is left, and no bucket starts "
                        "after it (those keep the heuristic); the last bucket and the report come on "
                        "top, so leave a minute or two")
    s.add_argument("--storage", default=None,
                   help="Optuna storage URL; several processes or machines may share one "
                        "(default: sqlite file tune.db in the user cache dir)")
    s.add_argument("--seed", type=int, default=None,
                   help="sampler seed (default: a fresh one in every process, from os.urandom, so workers "
                        "sharing a --storage explore different plans). Workers sharing a --storage with one "
                        "--seed each need their own --worker (the seed is mixed with it)")
    s.add_argument("--worker", type=_NONNEGATIVE, default=0,
                   help="index of this process among the workers sharing a --storage with one --seed")
    s.add_argument("--rounds", type=_NONNEGATIVE, default=2,
                   help="final re-measurements of the best plans and the heuristic (0: trust trials)")
    s.add_argument("--top", type=_POSITIVE, default=2, help="best plans re-measured against the heuristic")
    s.add_argument("--jobs", type=_POSITIVE, default=8, help="parallel NVRTC compiles before each head configuration (1: off)")
    s.add_argument("--device", type=_NONNEGATIVE, default=0, help="CUDA device ordinal")
    m = ap.add_argument_group("flat GEMM (the decode step's linear layers)")
    m.add_argument("--gemm", action="store_true",
                   help="also tune flat_gemm on the projections of every --model preset (qkv, o, gate_up, down "
                        "per GPU under its TP) at --gemm-m, each fp16 / bf16 --dtype, into <GPU>_gemm.json in "
                        "--out-dir (fdpp.gemm_tune.tune_gemm: every candidate and cuBLAS checked, then timed)")
    m.add_argument("--gemm-m", type=parse_sizes, default="1,2,4,8,16", metavar="LIST",
                   help="batch sizes M of the GEMM entries (buckets 1, 2, 4, ..., 64)")
    m.add_argument("--gemm-fp8", action="store_true", help="with --gemm: also FP8 E4M3 weights (fp16 x)")
    o = ap.add_argument_group("output")
    o.add_argument("--out-dir", default=None,
                   help="directory of the table <GPU>.json, merged into if present (default: "
                        "$FDPP_TUNING_DIR, else the user cache dir; use 'tuning' to update the "
                        "table shipped in the source tree)")
    o.add_argument("--skip-tuned", action="store_true",
                   help="leave out buckets that already have a valid entry in the --out-dir table (to "
                        "finish an interrupted or time-limited run without a shared --storage)")
    o.add_argument("--seed-table", default=None, metavar="PATH",
                   help="a table whose plan for a bucket is among that study's first trials, stale "
                        "entries included, so a short re-tune measures the earlier pick too (default: "
                        "the --out-dir table as it is before this run; 'none': no such seeds)")
    o.add_argument("--results-dir", default="results", help="CSV and plots")
    o.add_argument("--no-plots", action="store_true", help="write the CSV only")
    o.add_argument("--show", action="store_true",
                   help="print fdpp.dispatch.explain() for every problem (seqlens and batches taken "
                        "literally) and exit; tunes nothing")
    o.add_argument("--device-name", default=None,
                   help="with --show on a machine without a GPU: 'H200', 'H100' or 'A100' (or their full "
                        "names; fdpp.configs.SM90 / H100 / SM80), whose shipped table is shown")
    o.add_argument("-v", "--verbose", action="store_true", help="log every bucket's result")
    return ap


def make_buckets(heads: Sequence[tuple[int, int, int]], dtypes: Sequence[str], seqlens: Iterable[int],
                 batches: Iterable[int], page_sizes: Sequence[int] = (0,),
                 kv_dtypes: Sequence[str] = ("",)) -> list[tables.Bucket]:
    """The buckets of a run, dtype-major (a dtype that cannot run, say bf16 arrays, spoils only its
    groups), then K/V type ("": q's), heads, then cache (page size: a group of its own, compiled
    together)."""
    ns = sorted({tables.bucket_pow2(x) for x in seqlens})
    bs = sorted({tables.bucket_pow2(x) for x in batches})
    return [tables.Bucket(tables.HeadConfig(hq, hkv, d, dt, kv, page_size=ps), n, b)
            for dt in dtypes for kv in kv_dtypes for hq, hkv, d in heads for ps in page_sizes for n in ns
            for b in bs]


#: --device-name's choices (--show without a GPU): short and full names of the GPUs with limits in fdpp.configs
DEVICE_NAMES = {"H200": SM90, "H100": H100, "A100": SM80, SM90.name: SM90, H100.name: H100, SM80.name: SM80}


def check_combinations(heads: Sequence[tuple[int, int, int]], dtypes: Sequence[str], kv_dtypes: Sequence[str],
                       page_sizes: Sequence[int]) -> None:
    """Every (heads, --dtype, --kv-dtype, --page-size) the run would tune or show is a call the kernels
    take (fp32 q with a quantized cache, a quantized head_dim or INT4 group they lack: ValueError
    naming the flags), before any bucket is built."""
    from fdpp.dispatch import _check_problem

    for (hq, hkv, d), dt, kv, ps in itertools.product(heads, dtypes, kv_dtypes, page_sizes):
        try:
            _check_problem(DecodeProblem(1, hq, hkv, d, max(ps, 1), dt, kv_dtype=kv, page_size=ps), None)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--dtype {dt} / --kv-dtype {kv or 'same'} / heads {hq}/{hkv} head_dim {d} / "
                             f"page size {ps}: {e}") from None


def _show(args: argparse.Namespace, heads: list[tuple[int, int, int]], dtypes: list[str],
          kv_dtypes: Sequence[str] = ("",)) -> int:
    from fdpp.dispatch import current_device, explain

    if args.device_name:
        device = DEVICE_NAMES[args.device_name]
    else:
        device = current_device()
        from fdpp.api import gpu_available

        if not gpu_available():
            print(f"fdpp.tune --show: no CUDA GPU; showing the plans for {device.name} "
                  f"(--device-name picks another)", file=sys.stderr)
    problems = [DecodeProblem(b, hq, hkv, d, -(-n // ps) * ps if ps else n, dt, kv_dtype=kv, page_size=ps)  # N_max: whole pages
                for (hq, hkv, d), dt, kv, ps, n, b in itertools.product(heads, dtypes, kv_dtypes, args.page_size,
                                                                          args.seqlens, args.batch)]
    print("\n\n".join(explain(p, device) for p in problems))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if isinstance(args.seqlens, str):
        args.seqlens = parse_sizes(args.seqlens)
    if isinstance(args.batch, str):
        args.batch = parse_sizes(args.batch)
    if isinstance(args.page_size, str):
        args.page_size = parse_page_sizes(args.page_size)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    dtypes = [DTYPES[d.strip()].name if d.strip() in DTYPES else None for d in args.dtype.split(",") if d.strip()]
    if None in dtypes or not dtypes:
        build_parser().error(f"argument --dtype: choose from {sorted(DTYPES)}, got {args.dtype!r}")
    if args.device_name is not None and args.device_name not in DEVICE_NAMES:
        build_parser().error(f"argument --device-name: one of {sorted(DEVICE_NAMES)}, got {args.device_name!r}")
    try:  # a model name, TP share, head shape or KV type the tuner cannot take: an argparse error
        heads, names = head_configs(args)
        kv_dtypes = parse_kv_dtypes(args.kv_dtype)
        check_combinations(heads, dtypes, kv_dtypes, args.page_size)
    except ValueError as e:
        build_parser().error(str(e))
    if args.show:
        return _show(args, heads, dtypes, kv_dtypes)
    gemms = gemm_jobs(args, dtypes) if args.gemm else []  # argument errors before any tuning

    import optuna

    from fdpp import registry
    from fdpp.api import gpu_available

    if not gpu_available():
        raise SystemExit("fdpp.tune: no CUDA GPU (CuPy sees none); tuning measures on the GPU "
                         "(--show works without one)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    device = registry.device_limits(args.device)
    buckets = make_buckets(heads, dtypes, args.seqlens, args.batch, args.page_size, kv_dtypes)
    for x in args.seqlens + args.batch:
        if tables.bucket_pow2(x) != x:
            log.warning("%d is tuned at its bucket %d", x, tables.bucket_pow2(x))
    out_dir = Path(args.out_dir) if args.out_dir else tables.user_dir()
    if args.skip_tuned:
        have = tables.read_table(out_dir / tables.table_filename(device.name), device).entries
        buckets = [b for b in buckets if b.key not in have]
        print(f"fdpp.tune: --skip-tuned: {len(have)} buckets already in the table", file=sys.stderr)
    seed_table = out_dir / tables.table_filename(device.name) if args.seed_table is None else args.seed_table
    try:
        priors = {} if str(seed_table) == "none" else prior_plans(seed_table)
    except FileNotFoundError:
        if args.seed_table is not None:
            raise SystemExit(f"--seed-table: no such file {seed_table}") from None
        priors = {}  # no table yet in --out-dir: nothing to seed from
    except (OSError, ValueError) as e:
        raise SystemExit(f"--seed-table: cannot read {seed_table}: {e}") from None
    if priors:
        print(f"fdpp.tune: {sum(b.key in priors for b in buckets)} of {len(buckets)} studies seeded with the "
              f"plan of {seed_table}", file=sys.stderr)
    storage = open_storage(args.storage or default_storage())
    labels = {tables.HeadConfig(*h, dt, kv, page_size=ps): ", ".join(names[h])  # type: ignore[misc]
              for h in heads for dt in dtypes for kv in kv_dtypes for ps in args.page_size if names.get(h)}

    def before_group(h: tables.HeadConfig) -> None:
        vs = variants(h, device)
        t0 = time.perf_counter()
        precompile(vs, args.device, args.jobs)
        log.info("compiled %d variants for %s in %.1f s", len(vs), h, time.perf_counter() - t0)

    t0 = time.perf_counter()
    print(f"fdpp.tune: {len(buckets)} buckets x {args.trials} trials on {device.name}; "
          f"table -> {out_dir / tables.table_filename(device.name)}", file=sys.stderr)
    run = run_tuning(buckets, device, lambda p: DecodeBench(p, device_id=args.device), storage=storage,
                     out_dir=out_dir, trials=args.trials, timeout=args.timeout, seed=args.seed,
                     worker=args.worker,
                     rounds=args.rounds, top=args.top, versions=runtime_versions(),
                     before_group=before_group, priors=priors,
                     max_seconds=None if args.max_minutes is None else 60.0 * args.max_minutes)
    try:
        files = write_report(device, run.table, run.results, args.results_dir, labels, plots=not args.no_plots)
    except Exception:  # noqa: BLE001 - the table is written already; a report must not hide that
        log.exception("writing the report failed")
        files = []
    failed = [r for r in run.results if r.error]
    print(f"fdpp.tune: {sum(r.entry is not None for r in run.results)} buckets tuned in "
          f"{time.perf_counter() - t0:.0f} s; table {run.table}; wrote {', '.join(map(str, files))}"
          + (f"; {len(failed)} buckets FAILED: " + ", ".join(f"{r.bucket.key} ({r.error})" for r in failed)
             if failed else "")
          + (f"; out of time, not started: {', '.join(run.out_of_time)}" if run.out_of_time else ""),
          file=sys.stderr)
    if run.interrupted:
        return 130
    gemm_ok = True
    if args.gemm and (run.out_of_time or run.aborted):
        print("fdpp.tune --gemm: skipped (the attention run was cut short); run again to tune the GEMMs",
              file=sys.stderr)
    elif args.gemm and args.worker:
        print(f"fdpp.tune --gemm: left to worker 0 (this is worker {args.worker})", file=sys.stderr)
    elif args.gemm:
        gemm_ok = tune_model_gemms(gemms, args.gemm_m, out_dir, device, args.device)
    return 1 if failed or run.aborted or not gemm_ok else 0


def gemm_jobs(args: argparse.Namespace, dtypes: Sequence[str]) -> list[tuple[str, str, list[tuple[int, int]]]]:
    """(dtype, weight format, (N, K) shapes) that ``--gemm`` tunes: the projections of every --model
    preset (per GPU under its TP; ``--heads`` has no linear layers), deduplicated, for each 16-bit
    --dtype, and FP8 weights with fp16 x under ``--gemm-fp8``."""
    from fdpp.gemm import GEMM_DTYPES, MAX_M
    from fdpp.models import get_model

    if any(not 1 <= m <= MAX_M for m in args.gemm_m):
        raise SystemExit(f"--gemm-m: batch sizes must be in 1..{MAX_M}, got {args.gemm_m}")
    models = args.model or ([] if args.heads else ["llama3-8b:1"])  # head_configs' default, too
    shapes: list[tuple[int, int]] = []
    for spec in models:
        name, _, tp = spec.partition(":")
        tpv = _model_tp(spec, tp, args.tp)
        for nk in get_model(name).linear_shapes(tpv).values():
            if tuple(nk) not in shapes:
                shapes.append(tuple(nk))
    jobs = [(dt, "", shapes) for dt in dtypes if dt in GEMM_DTYPES]
    if args.gemm_fp8 and "fp16" in dtypes:
        jobs.append(("fp16", "e4m3", shapes))
    return [j for j in jobs if j[2]]


def tune_model_gemms(jobs: Sequence[tuple[str, str, list[tuple[int, int]]]], ms: Sequence[int], out_dir: Path,
                     device: Any, device_id: int = 0) -> bool:
    """``--gemm``: :func:`fdpp.gemm_tune.tune_gemm` for each of :func:`gemm_jobs` at M in ``ms`` on
    GPU ``device_id``, into the GEMM table of ``out_dir``; False when a job failed (reported)."""
    with on_gpu(device_id):
        return _tune_gemm_jobs(jobs, ms, out_dir, device)


@contextlib.contextmanager
def on_gpu(device_id: int) -> Any:
    """CuPy's and (when it imports) torch's current device is ``device_id`` inside the block."""
    import cupy

    with cupy.cuda.Device(device_id):
        try:
            import torch
        except ImportError:
            yield
            return
        with torch.cuda.device(device_id):
            yield


def _tune_gemm_jobs(jobs: Sequence[tuple[str, str, list[tuple[int, int]]]], ms: Sequence[int], out_dir: Path,
                    device: Any) -> bool:
    from fdpp import gemm, gemm_tune

    if not jobs:
        print("fdpp.tune --gemm: no GEMM shapes (--heads has no linear layers; give --model) or no "
              "fp16 / bf16 --dtype", file=sys.stderr)
        return True
    path = out_dir / gemm.table_filename(device.name)
    ok = True
    for dt, wfmt, shapes in jobs:
        t0 = time.perf_counter()
        try:
            got = gemm_tune.tune_gemm(shapes, ms, dtype=dt, path=path, wfmt=wfmt)
        except Exception as e:  # noqa: BLE001 - the attention table is written; report and go on
            ok = False
            print(f"fdpp.tune --gemm: {dt}{' FP8 weights' if wfmt else ''} failed: {type(e).__name__}: {e}",
                  file=sys.stderr)
            continue
        print(f"fdpp.tune --gemm: {len(got)} {dt}{' FP8-weight' if wfmt else ''} entries ({len(shapes)} shapes x "
              f"M {','.join(map(str, ms))}) in {time.perf_counter() - t0:.0f} s -> {path}", file=sys.stderr)
    return ok


if __name__ == "__main__":
    sys.exit(main())
