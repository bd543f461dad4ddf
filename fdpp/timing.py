"""GPU timing: CUDA-graph replay timed with CUDA events, rotated inputs, and the memory floor.

Method (the one ANCHORS.md describes): each call to measure is a closure over one *input set*;
enough sets are made that together they exceed a few times the L2 (``rotation_count``), so no call
finds its inputs in cache. ``time_calls`` runs every closure once eagerly (compiles kernels, fills
workspaces), captures ``max(calls_per_replay, len(calls))`` calls, cycling round-robin over the
sets, into one CUDA graph, replays it ``warmup`` times, then times ``repeats`` replays with a pair
of CUDA events each, all queued back to back before one synchronisation (so no sample holds the
graph's launch latency). One sample = replay time / calls in the graph: the gaps between kernels
inside a decode step (which a serving engine also captures) are counted, Python overhead is not.

``time_stream_read`` gives the floor: the ``kernels_cu/stream_read.cu`` kernel reading exactly the
bytes the measured call must read, timed the same way; ``stream_read_gbps`` the card's peak read
bandwidth. ``host_call_us`` measures the other cost users see: host time of one *eager* call.

CuPy and torch are imported lazily, so this module imports on a machine without either.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

log = logging.getLogger("fdpp.timing")


@dataclass(frozen=True)
class Timing:
    """Time per call in microseconds: median, 10th and 90th percentile over the repeats."""

    median_us: float
    p10_us: float
    p90_us: float
    samples: tuple[float, ...]

    @classmethod
    def from_samples(cls, samples: Sequence[float]) -> Timing:
        s = tuple(float(x) for x in samples)
        if not s:
            raise ValueError("Timing needs at least one sample")
        if len(s) == 1:
            return cls(s[0], s[0], s[0], s)
        p10, p90 = np.percentile(s, [10, 90])
        return cls(float(statistics.median(s)), float(p10), float(p90), s)


# ---- verify, then time ----------------------------------------------------------------------
class VerificationError(RuntimeError):
    """A candidate's output did not match the reference: it is never timed, never chosen."""


class VerifiedMeasure:
    """``measure(plan)``: µs from ``time_fn(plan)``, only after ``run_fn(plan)`` matched the reference.

    One rule for every op's tuner (attention's :func:`fdpp.tune.tune_bucket`, flat GEMM's
    :func:`fdpp.gemm_tune.tune_gemm`): ``run_fn(plan)`` returns ``out`` or ``(out, lse)`` (NumPy, the
    output poisoned before the call) for the verification inputs; ``reference`` is the float64
    ``out`` or ``(out, lse)`` of a reference that never calls fdpp. The bound is ``max_rel_err <=
    tol`` (max_rel_err is normalised by max |ref|, as ``assert_close`` scales atol), ``tol``
    defaulting to ``DTYPES[dtype].atol``. Raises :class:`VerificationError` on a mismatch.
    """

    def __init__(self, run_fn: Callable[[Any], Any], reference: Any, time_fn: Callable[[Any], float],
                 dtype: str, tol: float | None = None) -> None:
        from fdpp.dtypes import DTYPES

        self.run_fn, self.time_fn = run_fn, time_fn
        self.reference = reference if isinstance(reference, tuple) else (reference, None)
        self.tol = DTYPES[dtype].atol if tol is None else tol

    def error(self, plan: Any) -> float:
        from fdpp.reference import max_rel_err

        res = self.run_fn(plan)
        out, lse = res if isinstance(res, tuple) else (res, None)
        err = max_rel_err(out, self.reference[0])
        if lse is not None:
            err = max(err, max_rel_err(lse, self.reference[1]))
        return err

    def __call__(self, plan: Any) -> float:
        err = self.error(plan)
        if not err <= self.tol:
            raise VerificationError(f"max_rel_err {err:.3g} > {self.tol:g}")
        return float(self.time_fn(plan))


def randn(xp: Any, shape: tuple[int, ...], dtype: Any, rng: Any, *, scale: float = 1.0,
          chunk: int = 1 << 26) -> Any:
    """Random inputs of every op's tuner and benchmark: standard normal x ``scale`` as ``dtype``
    (bf16 rounded to nearest even through its bits: CuPy has no bf16 cast), drawn from ``rng``
    (a NumPy Generator or a CuPy RandomState) in chunks (bounded float32 temporaries)."""
    dtype = np.dtype(dtype)
    a = xp.empty(shape, dtype=dtype)
    flat = a.reshape(-1)
    for lo in range(0, flat.size, chunk):
        hi = min(flat.size, lo + chunk)
        x = rng.standard_normal(hi - lo, dtype=np.float32)
        if scale != 1.0:
            x *= np.float32(scale)
        if dtype.name == "bfloat16":
            u = x.view(np.uint32)
            flat[lo:hi] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).view(dtype)
        else:
            flat[lo:hi] = x.astype(dtype)
    return a


# ---- rotation -------------------------------------------------------------------------------
def l2_bytes(device_id: int | None = None) -> int:
    """L2 cache size of a CUDA device in bytes (CuPy device attributes)."""
    import cupy

    dev = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
    try:
        return int(dev.attributes["L2CacheSize"])
    except (KeyError, AttributeError):  # pragma: no cover - older CuPy
        return int(cupy.cuda.runtime.getDeviceProperties(dev.id)["l2CacheSize"])


def rotation_count(bytes_per_set: int, l2: int, factor: int = 4, max_sets: int = 64) -> int:
    """Number of input sets so that ``sets * bytes_per_set >= factor * l2``, in [1, max_sets].

    >>> rotation_count(4 << 20, 60 << 20)   # 4 MB sets, 60 MB L2: 60 sets make 240 MB
    60
    >>> rotation_count(1 << 30, 60 << 20)   # one 1 GB set is already 4x the L2
    1
    """
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be positive, got {bytes_per_set}")
    if l2 < 0 or factor < 0 or max_sets < 1:
        raise ValueError(f"need l2 >= 0, factor >= 0, max_sets >= 1 (got {l2}, {factor}, {max_sets})")
    return max(1, min(max_sets, math.ceil(factor * l2 / bytes_per_set)))


# ---- graph-replay timing --------------------------------------------------------------------
def _check_args(calls: Sequence[Callable[[], object]], calls_per_replay: int, warmup: int,
                repeats: int) -> list[Callable[[], object]]:
    calls = list(calls)
    if not calls:
        raise ValueError("calls must hold at least one closure")
    if calls_per_replay < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"need calls_per_replay >= 1, repeats >= 1, warmup >= 0 (got "
                         f"{calls_per_replay}, {repeats}, {warmup})")
    return calls


def _round_robin(calls: list[Callable[[], object]], n: int) -> None:
    m = len(calls)
    for i in range(n):
        calls[i % m]()


#: How :func:`time_round_robin` runs an implementation's closures: launching on CuPy's or torch's
#: current stream, captured in one CUDA graph, or (``-eager``) launched as they are between the events.
KINDS = ("cupy", "cupy-eager", "torch", "torch-eager")


def time_calls(calls: Sequence[Callable[[], object]], *, calls_per_replay: int = 20, warmup: int = 3,
               repeats: int = 7, use_graph: bool = True) -> Timing:
    """Time closures that launch GPU work on CuPy's current stream.

    Parameters
    ----------
    calls : closures, one per rotated input set
        Each launches its work on ``cupy.cuda.get_current_stream()`` and must be capturable
        (no host synchronisation, no device-to-host copy). Outputs should be preallocated.
    calls_per_replay : int
        Calls captured in the graph; raised to ``len(calls)`` so every set is used once per replay.
    warmup, repeats : int
        Untimed replays, then timed replays (one sample each).
    use_graph : bool
        False: the same calls launched eagerly back to back between the events (includes launch
        gaps, and host overhead where the host is slower than the GPU).

    Returns
    -------
    Timing of one call (µs).
    """
    return time_round_robin([(calls, "cupy" if use_graph else "cupy-eager")], calls_per_replay=calls_per_replay,
                            warmup=warmup, repeats=repeats)[0]


def time_torch_calls(calls: Sequence[Callable[[], object]], *, calls_per_replay: int = 20, warmup: int = 3,
                     repeats: int = 7, use_graph: bool = True) -> Timing:
    """:func:`time_calls` for closures that launch on torch's current stream (PyTorch SDPA,
    FlashInfer, fdpp called with torch tensors): ``torch.cuda.CUDAGraph`` captured on a torch
    stream. Same arguments and result."""
    return time_round_robin([(calls, "torch" if use_graph else "torch-eager")], calls_per_replay=calls_per_replay,
                            warmup=warmup, repeats=repeats)[0]


def rotation(k: int, r: int) -> list[int]:
    """The order of round ``r`` over ``k`` implementations: each round starts one later."""
    return [(r + i) % k for i in range(k)]


def time_round_robin(impls: Sequence[tuple[Any, ...]], *, calls_per_replay: int = 20,
                     warmup: int = 3, repeats: int = 7) -> list[Timing]:
    """Time several implementations interleaved, one :class:`Timing` each (µs per call).

    ``impls``: (closures, kind) or (closures, kind, context) tuples, kind from :data:`KINDS` (the
    closures as for :func:`time_calls` / :func:`time_torch_calls`), ``context`` a factory of the
    context manager the closures need while they are run eagerly and captured (a PyTorch SDPA
    backend, say). Each implementation runs its closures once
    eagerly and is captured in its own graph first; then every graph runs on one stream, ``warmup``
    rounds untimed, then ``repeats`` timed rounds, each timing every implementation once and
    starting one implementation later than the round before (:func:`rotation`), all queued before
    one synchronisation. A slow phase of the GPU (clocks, power, a neighbour) so falls on every
    implementation alike, and none of them runs concurrently with another.
    """
    import cupy

    specs = [(_check_args(im[0], calls_per_replay, warmup, repeats), im[1], im[2] if len(im) > 2 else None)
             for im in impls]
    if not specs:
        raise ValueError("impls must hold at least one implementation")
    for _, kind, _ in specs:
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    cupy.cuda.runtime.deviceSynchronize()  # inputs made on other streams (torch's, the legacy one) are ready
    cs = cupy.cuda.Stream(non_blocking=True)  # CuPy closures' capture stream
    tstream = None
    ts = cs  # the one stream every implementation is timed on
    if any(kind.startswith("torch") for _, kind, _ in specs):
        import torch

        torch.cuda.synchronize()
        dev = cupy.cuda.Device().id  # the events and CuPy graphs are on CuPy's current device: torch's stream too
        tstream = torch.cuda.Stream(device=dev)
        ts = cupy.cuda.ExternalStream(tstream.cuda_stream, dev)
    runs = []
    for calls, kind, ctx in specs:
        with ctx() if ctx is not None else contextlib.nullcontext():
            runs.append(_prepare(calls, kind, max(calls_per_replay, len(calls)), cs, ts, tstream, ctx))
    # Everything is queued before one synchronisation: each timed replay starts as soon as the
    # previous one ends, so the samples hold no graph-launch latency (a decode loop's steady state).
    for r in range(warmup):
        for j in rotation(len(runs), r):
            runs[j][0]()
    events = [[(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(repeats)] for _ in runs]
    for r in range(repeats):
        for j in rotation(len(runs), r):
            start, end = events[j][r]
            start.record(ts)
            runs[j][0]()
            end.record(ts)
    ts.synchronize()
    out = [Timing.from_samples([cupy.cuda.get_elapsed_time(s, e) * 1e3 / n for s, e in ev])
           for ev, (_, n, _) in zip(events, runs, strict=True)]
    del runs  # the graphs
    return out


def time_interleaved(impls: Sequence[tuple[Any, ...]], **kw: Any) -> tuple[list[Timing | Exception], str | None]:
    """:func:`time_round_robin` of ``impls``; when that fails (one implementation cannot be
    captured, say), each implementation alone, so that only the one that fails loses its timing.
    Returns (a Timing or the exception, per implementation; why the joint timing failed, None when
    it did not). The benchmarks' rows say which points were not interleaved."""
    if not impls:
        return [], None
    try:
        return list(time_round_robin(impls, **kw)), None
    except Exception as e:  # noqa: BLE001 - find the one that cannot be captured
        why = f"{type(e).__name__}: {e}"
    log.warning("interleaved timing failed (%s); timing each implementation alone", why)
    out: list[Timing | Exception] = []
    for im in impls:
        try:
            out.append(time_round_robin([im], **kw)[0])
        except Exception as e:  # noqa: BLE001 - reported by the caller, per implementation
            out.append(e)
    return out, why


def _prepare(calls: list[Callable[[], object]], kind: str, n: int, cs: Any, ts: Any,
             tstream: Any, ctx: Any = None) -> tuple[Callable[[], None], int, Any]:
    """(run one replay of ``n`` calls on the timing stream ``ts``, n, the graph to keep alive):
    the closures run once eagerly (compiles, allocates per-stream workspaces), then are captured;
    ``-eager`` kinds run their closures inside ``ctx`` each time instead."""
    within = ctx if ctx is not None else contextlib.nullcontext
    graph: Any = None
    if kind.startswith("cupy"):
        with cs:
            for c in calls:
                c()
            cs.synchronize()
            if kind == "cupy":
                cs.begin_capture()
                try:
                    _round_robin(calls, n)
                except BaseException:
                    try:
                        cs.end_capture()
                    except Exception:  # noqa: BLE001 - the capture is already broken; report the first error
                        pass
                    raise
                graph = cs.end_capture()
                graph.upload(ts)  # on the stream it is launched on
        if graph is not None:
            return (lambda: graph.launch(ts)), n, graph

        def eager() -> None:
            with ts, within():
                _round_robin(calls, n)
        return eager, n, None
    import torch

    with torch.cuda.stream(tstream):
        for c in calls:
            c()
    tstream.synchronize()
    if kind == "torch":
        graph = torch.cuda.CUDAGraph()
        # "relaxed": CuPy launches inside fdpp query the device; nothing here allocates outside
        # torch's graph pool, and outputs are checked separately from eager calls.
        with torch.cuda.graph(graph, stream=tstream, capture_error_mode="relaxed"):
            _round_robin(calls, n)

        def replay() -> None:
            with torch.cuda.stream(tstream):
                graph.replay()
        return replay, n, graph

    def torch_eager() -> None:
        with torch.cuda.stream(tstream), within():
            _round_robin(calls, n)
    return torch_eager, n, None


def time_cpu_calls(calls: Sequence[Callable[[], object]], *, warmup: int = 1, repeats: int = 7) -> Timing:
    """Wall-clock timing of host (NumPy) closures: one sample per round over all ``calls``,
    divided by their number. Used by ``fdpp.bench --emulator``."""
    calls = _check_args(calls, 1, warmup, repeats)
    for _ in range(warmup):
        _round_robin(calls, len(calls))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _round_robin(calls, len(calls))
        samples.append((time.perf_counter() - t0) * 1e6 / len(calls))
    return Timing.from_samples(samples)


def host_call_us(fn: Callable[[], object], n: int = 2000) -> float:
    """Host cost of one eager call, µs: wall time over ``n`` back-to-back calls (after a warm-up
    and a device synchronisation), with one synchronisation at the end."""
    import cupy

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    for _ in range(min(50, n)):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    return (time.perf_counter() - t0) * 1e6 / n


# ---- the floor: streaming read --------------------------------------------------------------
@dataclass(frozen=True)
class StreamReadConfig:
    """A variant of ``kernels_cu/stream_read.cu`` (fields = its template parameters). The grid is
    ``ctas_per_sm`` CTAs per SM, which is also the kernel's ``__launch_bounds__`` minimum."""

    unroll: int = 8
    num_warps: int = 8
    l2_prefetch: int = 0
    ctas_per_sm: int = 4

    @property
    def threads(self) -> int:
        return self.num_warps * 32

    def name_expression(self) -> str:
        return f"fdpp::stream_read<{self.unroll},{self.num_warps},{self.ctas_per_sm},{self.l2_prefetch}>"

    @property
    def key(self) -> str:
        return f"stream_read.u{self.unroll}.w{self.num_warps}.c{self.ctas_per_sm}.p{self.l2_prefetch}"

    @property
    def source(self) -> str:
        return "stream_read.cu"

    def smem_bytes(self) -> int:
        return 0

    def grid(self, n_vec: int, sm_count: int) -> int:
        """CTAs: ``ctas_per_sm`` per SM, fewer when the read is too small to give each thread
        UNROLL vectors (small reads are latency-bound; one round of loads is all they need)."""
        return max(1, min(self.ctas_per_sm * sm_count, math.ceil(n_vec / (self.threads * self.unroll))))


# Tried by stream_read_gbps and time_stream_read; the floor is the best of them.
STREAM_READ_VARIANTS = (
    StreamReadConfig(unroll=8, num_warps=8, l2_prefetch=0, ctas_per_sm=4),
    StreamReadConfig(unroll=8, num_warps=8, l2_prefetch=256, ctas_per_sm=4),
    StreamReadConfig(unroll=16, num_warps=8, l2_prefetch=256, ctas_per_sm=2),
)


@cache
def _sink(device_id: int) -> Any:
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.zeros(1, dtype=np.uint32)


def _stream_read_call(cfg: StreamReadConfig, ptr: int, nbytes: int, device_id: int) -> Callable[[], None]:
    from fdpp import registry

    if ptr % 16:
        raise ValueError(f"stream_read needs a 16-byte aligned pointer, got {ptr:#x}")
    kern = registry.get_kernel(cfg, device_id)
    sm = registry.device_limits(device_id).sm_count
    n_vec = nbytes // 16
    grid = (cfg.grid(n_vec, sm), 1, 1)
    block = (cfg.threads, 1, 1)
    args = (np.uint64(ptr), np.uint64(n_vec), np.uint64(_sink(device_id).data.ptr))

    def call() -> None:
        kern(grid, block, args)  # on CuPy's current stream

    return call


def time_stream_read(nbytes: int, *, ptrs: Sequence[int] | None = None,
                     variants: Sequence[StreamReadConfig] | None = None, device_id: int | None = None,
                     max_sets: int = 256, **kw: Any) -> Timing:
    """The floor of a call that must read ``nbytes``: the fastest stream_read variant reading
    exactly that many bytes (rounded down to 16), rotated over input sets, timed by
    :func:`time_calls` (``kw`` are its keyword arguments).

    ``ptrs``: device pointers of existing input sets (16-byte aligned, ``nbytes`` readable from
    each), e.g. the very KV caches a benchmark point uses; default: a fresh buffer holding
    ``rotation_count(nbytes, L2, max_sets=max_sets)`` sets.
    """
    import cupy

    if nbytes < 16:
        raise ValueError(f"nbytes must be >= 16, got {nbytes}")
    dev = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
    variants = tuple(variants or STREAM_READ_VARIANTS)
    buf = None
    with dev:
        if ptrs is None:
            stride = -(-nbytes // 256) * 256
            sets = rotation_count(stride, l2_bytes(dev.id), max_sets=max_sets)
            buf = cupy.empty(sets * stride, dtype=np.uint8)
            cupy.cuda.runtime.memset(buf.data.ptr, 0x5A, buf.nbytes)
            ptrs = [buf.data.ptr + i * stride for i in range(sets)]
        best: Timing | None = None
        for cfg in variants:
            calls = [_stream_read_call(cfg, p, nbytes, dev.id) for p in ptrs]
            t = time_calls(calls, **kw)
            log.debug("stream_read %s: %d B in %.2f us", cfg.key, nbytes, t.median_us)
            if best is None or t.median_us < best.median_us:
                best = t
    del buf
    assert best is not None
    return best


def stream_read_gbps(nbytes: int = 2 << 30, *, device_id: int | None = None, **kw: Any) -> float:
    """Peak streaming-read bandwidth of the device in GB/s (1e9 B/s): the best stream_read variant
    reading ``nbytes`` (one buffer, far larger than L2), timed by graph replay."""
    kw.setdefault("calls_per_replay", 5)
    t = time_stream_read(nbytes, device_id=device_id, max_sets=1, **kw)
    return nbytes / (t.median_us * 1e-6) / 1e9
