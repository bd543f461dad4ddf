"""Choose the launch plan for a problem: a tuned table entry if one applies, else the heuristic.

Order (:func:`select_plan`):

1. a plan forced by :func:`forced_plan` (the tuner uses it to launch each candidate through the
   public API);
2. ``num_splits`` given by the caller: the heuristic's kernel config with that split count;
3. the tuned tables of this GPU (:mod:`fdpp.tables`): exact bucket, else nearest bucket;
4. :func:`fdpp.configs.default_config` (the heuristic).

Split count of a tuned entry for the actual problem (:func:`scaled_splits`): the entry fixes the
kernel variant, the combine variant and the number of splits measured best at its bucket. Inside a
bucket seqlen varies by at most √2, and what the tuner really optimised is the grid (splits ×
batch × head groups against the SM count: wave quantisation), so the **split count is kept** and
the chunk (tokens per split) follows N_max. Batch changes the grid too, so the count is scaled by
bucket batch / actual batch to keep the number of CTAs (a count tuned at batch 8 doubles at
batch 4). The result is clamped to [1, min(MAX_SPLITS, N_max // MIN_CHUNK)].

Decisions are memoised per (problem, device, user table dir) in a :class:`PlanMemo`;
:func:`fdpp.tables.clear_cache` invalidates them. :func:`explain` says which plan runs and why.

Shared by every op: :func:`forced_plan` (one context mechanism, keyed by the plan's ``family``:
"attention" for :class:`fdpp.configs.LaunchPlan`, "gemm" for :class:`fdpp.gemm.GemmPlan`) and
:class:`PlanMemo`; flat GEMM's :func:`fdpp.gemm.choose` is the same forced / table / heuristic order.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from fdpp import tables
from fdpp.configs import (
    BATCH_INVARIANT,
    MAX_SPLITS,
    MIN_CHUNK,
    DecodeProblem,
    DeviceLimits,
    LaunchPlan,
    batch_invariant_plan,
    default_config,
    group_size_for,
)

log = logging.getLogger("fdpp.dispatch")

_forced: ContextVar[Mapping[str, Any]] = ContextVar("fdpp_forced_plans", default=MappingProxyType({}))


def plan_family(plan: Any) -> str:
    """The op family a plan launches ("attention", "gemm"): its class's ``family``."""
    return getattr(plan, "family", "attention")


@contextlib.contextmanager
def forced_plan(plan: Any) -> Iterator[Any]:
    """Make every call of the plan's op in this context (thread / task) launch ``plan``: a
    :class:`fdpp.configs.LaunchPlan` for ``decode_attention`` / ``paged_decode_attention``, a
    :class:`fdpp.gemm.GemmPlan` for ``flat_gemm``. Plans of different ops nest independently.

    For the tuners and experiments: the plan must fit the call (attention: same dtype and head_dim,
    a group size dividing the GQA ratio; GEMM: a kernel valid for the call's M and weight format)
    or the call raises ValueError. It also wins over a ``num_splits`` argument.
    """
    token = _forced.set(MappingProxyType({**_forced.get(), plan_family(plan): plan}))
    try:
        yield plan
    finally:
        _forced.reset(token)


def current_forced(family: str = "attention") -> Any:
    """The plan of ``family`` forced in this context, if any (part of the launch-record keys)."""
    return _forced.get().get(family)


class PlanMemo:
    """Plans memoised per key (a problem, its device and the user tables dir), dropped when the
    tables are re-read (:func:`fdpp.tables.generation`) and when ``size`` keys accumulate (many
    distinct shapes: start over, stay bounded). Every op's dispatcher keeps one."""

    def __init__(self, size: int = 4096) -> None:
        self.size, self._plans, self._generation = size, {}, -1

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, key: Hashable, decide: Callable[[], Any]) -> Any:
        gen = tables.generation()
        if gen != self._generation:
            self._plans.clear()
            self._generation = gen
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= self.size:
                self._plans.clear()
            plan = self._plans[key] = decide()
        return plan


def _check_forced(plan: LaunchPlan, problem: DecodeProblem) -> LaunchPlan:
    cfg = plan.split
    have = (cfg.dtype, cfg.kv_dtype, cfg.head_dim, cfg.page_size)
    want = (problem.dtype, problem.kv_dtype, problem.head_dim, problem.page_size)
    if have != want:
        raise ValueError(f"forced plan {cfg.key} is for (dtype, kv_dtype, head_dim, page_size) {have}, "
                         f"the call is {want}")
    if cfg.kernel == "decode_split" and problem.ratio % cfg.group_size:
        raise ValueError(f"forced plan {cfg.key}: group_size {cfg.group_size} does not divide the "
                         f"GQA ratio {problem.ratio}")
    if not 1 <= plan.num_splits <= MAX_SPLITS:
        raise ValueError(f"forced plan num_splits {plan.num_splits} outside 1..{MAX_SPLITS}")
    return plan


def scaled_splits(entry: tables.Entry, problem: DecodeProblem) -> int:
    """Split count of a tuned ``entry`` for ``problem`` (see the module docstring)."""
    s = math.floor(entry.num_splits * entry.bucket.batch / problem.batch + 0.5)
    hi = max(1, min(MAX_SPLITS, problem.seqlen // MIN_CHUNK))
    return int(max(1, min(s, hi)))


@dataclass(frozen=True)
class Decision:
    plan: LaunchPlan
    how: str  # "forced" | "num_splits" | "table" | "heuristic"
    match: tables.Match | None = None
    why: str = ""


def _decide(problem: DecodeProblem, device: DeviceLimits, ts: tables.TableSet | None) -> Decision:
    """The table-or-heuristic part of :func:`select_plan` (no forced plan, no num_splits)."""
    if ts is not None:
        m = ts.lookup(problem)
        if m is not None:
            plan = m.entry.plan(scaled_splits(m.entry, problem))
            return Decision(plan, "table", m)
    heur = default_config(problem, device)
    if ts is None:
        return Decision(heur, "heuristic", None, "the tuned tables could not be consulted")
    if not any(t.entries for t in ts.tables):
        found = [t for t in ts.tables if t.found]
        why = (f"no usable tuned table for {device.name!r}" if found
               else f"no tuned table for {device.name!r} ({tables.table_filename(device.name)})")
        return Decision(heur, "heuristic", None, why)
    if tables.head_config(problem) not in ts.by_heads:
        return Decision(heur, "heuristic", None, "no tuned entry for this head configuration and dtype")
    return Decision(heur, "heuristic", None,
                    f"no tuned bucket within {tables.MAX_BUCKET_DISTANCE} octaves of seqlen and batch")


def _table_set(device: DeviceLimits) -> tables.TableSet | None:
    try:
        return tables.table_set(device)
    except Exception as e:  # noqa: BLE001 - tables must never break a call; warn and use the heuristic
        msg = f"fdpp: tuned tables unavailable ({type(e).__name__}: {e}); using the heuristic"
        log.warning(msg)
        warnings.warn(msg, tables.TableWarning, stacklevel=3)
        return None


_plan_cache = PlanMemo()


def select_plan(problem: DecodeProblem, device: DeviceLimits, num_splits: int | None = None) -> LaunchPlan:
    """The plan ``decode_attention`` launches for ``problem`` on ``device``.

    ``num_splits`` given by the caller overrides the split count (the kernel config stays the
    heuristic's); ``None`` asks the tuned tables, then the heuristic. A plan set with
    :func:`forced_plan` wins over both. Memoised; cheap per call.
    """
    forced = current_forced()
    if forced is not None:
        return _check_forced(forced, problem)
    if num_splits == BATCH_INVARIANT:
        return batch_invariant_plan(problem, device)
    if num_splits is not None:
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
        d = default_config(problem, device).split  # the heuristic's kernel, merged in the same launch
        return LaunchPlan.split_kv(replace(d, cluster=1), num_splits, source="user", fused=True)
    return _plan_cache.get((problem, device, tables.user_dir_str()),
                           lambda: _decide(problem, device, _table_set(device)).plan)


def clear_cache() -> None:
    """Forget memoised plans and loaded tables."""
    tables.clear_cache()


# ---- explain --------------------------------------------------------------------------------
def _describe(plan: LaunchPlan, problem: DecodeProblem) -> str:
    n = problem.seqlen
    chunk, eff = plan.chunk(n), plan.effective_splits(n)
    if eff > 1 and plan.fused:
        r = plan.merge_bucket(n)
        levels = "one level" if r >= eff else f"buckets of {r} splits, then the buckets"
        comb = f", merged in the same launch by the last CTA of each group ({levels})"
    elif plan.mode == "cluster":
        comb = (f", merged in the same launch inside a thread-block cluster of its {eff} CTAs "
                "(distributed shared memory; no partials in global memory)")
    elif eff > 1 and plan.combine is not None:
        comb = f", then combine {plan.combine.key}"
    else:
        comb = ", no merge"
    g = plan.split.group_size
    readers = (f"; {g} query heads per CTA, so {problem.ratio // g} CTAs read each KV head"
               if g < group_size_for(problem.ratio) and problem.ratio % g == 0 else "")
    return f"{plan.split.key}, {eff} split{'s' if eff != 1 else ''} of {chunk} tokens{comb}{readers}"


def explain(problem: DecodeProblem, device: DeviceLimits | None = None,
            num_splits: int | None = None, softmax_mode: str = "exact") -> str:
    """Which plan ``decode_attention`` runs for ``problem`` on ``device``, and why; with
    ``softmax_mode`` (as decode_attention's), what that mode does on the plan's kernel.

    Parameters
    ----------
    problem : fdpp.configs.DecodeProblem
        The call's sizes and types: ``DecodeProblem(batch, num_q_heads, num_kv_heads, head_dim,
        seqlen, dtype="fp16", kv_dtype="", page_size=0)`` (seqlen: N_max; paged: pages per
        request x page_size).
    device : fdpp.configs.DeviceLimits, optional
        Defaults to the current GPU, else the H200 limits (``fdpp.configs.SM90``).
    num_splits : int, optional
        As decode_attention's: a forced split count instead of the table / heuristic.
    softmax_mode : {"exact", "unified_max"}
    """
    from fdpp.api import SOFTMAX_MODES

    if softmax_mode not in SOFTMAX_MODES:
        raise ValueError(f"softmax_mode must be one of {SOFTMAX_MODES}, got {softmax_mode!r}")
    _check_problem(problem, num_splits)
    if device is None:
        device = current_device()
    elif not isinstance(device, DeviceLimits):
        raise TypeError(f"device must be a fdpp.configs.DeviceLimits (e.g. fdpp.configs.SM90) or None, "
                        f"got {type(device).__name__}")
    text = _explain(problem, device, num_splits)
    plan = select_plan(problem, device, num_splits)
    split = plan.unified_max().split
    if softmax_mode == "exact":
        why = "each chunk's softmax starts from its first scores"
    elif split.umax:
        why = (f"{split.function} (the unified-max twin of {plan.split.function}) "
               "starts each chunk from unified_max phi: blocks within phi +- 5.5 "
               "skip the rescale; scores outside move the reference on the device (exact)")
    else:
        kind = "head_dim 256: its registers are full" if split.mma else "CUDA cores"
        why = (f"{split.function} ({kind}) computes each block's max as in exact mode: unified_max is "
               "accepted and has no effect on this plan")
    return f"{text}\nsoftmax: {softmax_mode}: {why}"


def _check_problem(p: Any, num_splits: Any) -> None:
    """explain's arguments describe a call decode_attention accepts (TypeError / ValueError naming the field)."""
    from fdpp.api import QUANT_HEAD_DIMS, _check_scalar_args, check_problem_sizes
    from fdpp.dtypes import DTYPES, ELEMENT_TYPES, INT4_FORMATS, is_quantized

    if not isinstance(p, DecodeProblem):
        raise TypeError("problem must be a fdpp.configs.DecodeProblem (e.g. DecodeProblem(batch=1, num_q_heads=32, "
                        f"num_kv_heads=8, head_dim=128, seqlen=4096)), got {type(p).__name__}")
    check_problem_sizes(p.batch, p.num_q_heads, p.num_kv_heads, p.head_dim, p.seqlen, p.page_size, "problem.")
    if p.page_size and p.seqlen % p.page_size:  # as DecodePlan: a block-table row addresses whole pages
        raise ValueError(f"problem.seqlen must be pages per request x page_size for a paged problem, got seqlen "
                         f"{p.seqlen}, page_size {p.page_size}")
    if p.dtype not in DTYPES:
        raise ValueError(f"problem.dtype must be one of {sorted(DTYPES)}, got {p.dtype!r}")
    if p.kv_dtype not in ELEMENT_TYPES:
        raise ValueError(f"problem.kv_dtype must be one of {sorted(ELEMENT_TYPES)}, got {p.kv_dtype!r}")
    if is_quantized(p.kv_dtype) and p.dtype == "fp32":
        raise ValueError(f"problem.kv_dtype {p.kv_dtype!r} takes fp16 or bf16 q (problem.dtype), got fp32")
    if is_quantized(p.kv_dtype) and p.head_dim not in QUANT_HEAD_DIMS:
        raise ValueError(f"problem.kv_dtype {p.kv_dtype!r} takes head_dim in {QUANT_HEAD_DIMS}, got {p.head_dim}")
    if p.kv_dtype in INT4_FORMATS and p.head_dim % INT4_FORMATS[p.kv_dtype].group_size:
        raise ValueError(f"problem.kv_dtype {p.kv_dtype!r}: its group of {INT4_FORMATS[p.kv_dtype].group_size} "
                         f"elements must divide head_dim {p.head_dim}")
    if not is_quantized(p.kv_dtype) and p.kv_dtype != p.dtype:
        raise ValueError(f"problem.kv_dtype {p.kv_dtype!r} must be q's dtype {p.dtype!r} or a quantized format")
    _check_scalar_args(None, num_splits, "NHD")


def _explain(problem: DecodeProblem, device: DeviceLimits, num_splits: int | None) -> str:
    p = problem
    cache = f"paged, page_size {p.page_size}" if p.paged else "contiguous"
    kv = "" if p.kv_dtype == p.dtype else f", K/V {p.kv_dtype}"
    lines = [f"problem: batch {p.batch}, {p.num_q_heads} q heads / {p.num_kv_heads} kv heads, "
             f"head_dim {p.head_dim}, N_max {p.seqlen}, {p.dtype}{kv}, {cache} cache; device {device.name} "
             f"({device.arch}, {device.sm_count} SMs)"]
    b = tables.Bucket.of(p)
    lines.append(f"bucket: {b.key} (seqlen and batch rounded to the nearest power of two)")
    lines.append(f"launch: {_launch_mode(device, p)}")
    forced = current_forced()
    if forced is not None:
        plan = _check_forced(forced, p)
        lines.append(f"runs: {_describe(plan, p)}")
        lines.append("why: a plan forced with fdpp.dispatch.forced_plan()")
        return "\n".join(lines)
    if num_splits is not None:
        plan = select_plan(p, device, num_splits)
        lines.append(f"runs: {_describe(plan, p)}")
        lines.append(f"why: num_splits={num_splits} given by the caller (kernel config of the heuristic)")
        return "\n".join(lines)
    ts = _table_set(device)
    if ts is not None:
        for t in ts.tables:
            if not t.found:
                state = "not found"
            elif t.error:
                state = f"IGNORED: {t.error}"
            else:
                state = f"{len(t.entries)} entries kept, {len(t.rejected)} rejected"
                cupy = sys.modules.get("cupy")  # compare versions only if already imported
                notes = tables.version_notes(t.header, {"cupy": getattr(cupy, "__version__", "?")} if cupy else None)
                if notes:
                    state += f" ({'; '.join(notes)})"
            lines.append(f"{t.kind} table: {t.path}: {state}")
        for t, key, why in ts.rejected_for(p):
            lines.append(f"rejected: {key} in {t.path}: {why}")
    d = _decide(p, device, ts)
    lines.append(f"runs: {_describe(d.plan, p)}")
    if d.how == "table" and d.match is not None:
        m, e = d.match, d.match.entry
        where = f"{e.bucket.key} from {e.origin}"
        if m.exact:
            why = f"tuned entry for this exact bucket: {where}"
        else:
            why = (f"nearest tuned bucket {where} ({m.d_seqlen} octave(s) of seqlen, "
                   f"{m.d_batch} of batch away)")
        if e.time_us is not None:
            ht = f"{e.heuristic_time_us:.2f}" if e.heuristic_time_us is not None else "?"
            why += f"; measured {e.time_us:.2f} µs there vs {ht} µs for the heuristic"
        lines.append(f"why: {why}")
        if d.plan.num_splits != e.num_splits:
            lines.append(f"splits: tuned {e.num_splits} at batch {e.bucket.batch}, scaled to "
                         f"{d.plan.num_splits} for batch {p.batch} and N_max {p.seqlen}")
    else:
        lines.append(f"why: heuristic (fdpp.configs.default_config): {d.why}")
    return "\n".join(lines)


def _launch_mode(device: DeviceLimits, p: DecodeProblem) -> str:
    """How the attention kernels of ``p`` are launched on ``device`` (fdpp.launch.PDL, the call's
    K/V bytes, the launcher, the arch)."""
    from fdpp import launch

    if "attention" not in launch.PDL:
        return "plain launches (FDPP_PDL leaves attention out)"
    if p.kv_bytes() > launch.PDL_ATTENTION_MAX_BYTES:
        return (f"plain launches (the call reads {p.kv_bytes() / 2**20:.0f} MiB of K/V, more than "
                f"fdpp.launch.PDL_ATTENTION_MAX_BYTES = {launch.PDL_ATTENTION_MAX_BYTES >> 20} MiB)")
    if device.cc < (9, 0):
        return f"plain launches (no programmatic dependent launch on {device.arch})"
    if launch.LAUNCHER == "cupy":
        return "plain launches (the 'cupy' launcher passes no launch attributes)"
    if not launch.HAVE_BINDINGS:
        return "plain launches (programmatic dependent launch needs cuda.bindings' cuLaunchKernelEx)"
    pf = launch.L2_PREFETCH_BYTES
    return ("programmatic dependent launch: each kernel's launch overlaps the end of the kernel before it"
            + (f"; before waiting for it, the CTAs ask the L2 for their chunks' K/V rows (calls of at "
               f"most {pf / 2**20:g} MiB of K/V, FDPP_L2_PREFETCH_MB: "
               f"{'this one' if p.kv_bytes() <= pf else 'not this one'})" if pf > 0 else
               "; no L2 prefetch (FDPP_L2_PREFETCH_MB=0)"))


def current_device() -> DeviceLimits:
    """The current GPU's limits, else (no GPU, no CuPy) the H200's: what explain() describes a plan for."""
    from fdpp.configs import SM90

    try:
        from fdpp.api import gpu_available

        if gpu_available():
            from fdpp import registry

            return registry.device_limits()
    except Exception:  # noqa: BLE001 - explain works without a GPU
        pass
    return SM90


__all__ = ["select_plan", "forced_plan", "current_forced", "explain", "scaled_splits", "clear_cache", "Decision"]
