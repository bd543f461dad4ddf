"""The flat GEMM tuner and its measurement helpers (``python -m fdpp.bench gemm --tune``): candidate
plans per (shape, M), random weight sets rotated past L2, the float64 reference, the cuBLAS margin
rule, and :func:`tune_gemm`, which writes :mod:`fdpp.gemm`'s table.

On the engine the attention tuner uses: inputs from :func:`fdpp.timing.randn`, every candidate
verified then timed by :class:`fdpp.timing.VerifiedMeasure`, launched through the public call under
:func:`fdpp.dispatch.forced_plan`, entries (:class:`fdpp.gemm.GemmEntry`) written by
:func:`fdpp.tables.write_file`. The search itself is exhaustive (a few dozen candidates per point),
not Optuna's.

One-way: this module uses :mod:`fdpp.gemm` (configs, dispatch, the public call, the table writer);
``fdpp.gemm`` never imports it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fdpp.configs import DeviceLimits
from fdpp.dtypes import get_dtype
from fdpp.gemm import GemmEntry, flat_gemm, forced_plan, resident_ctas, table_paths, write_table
from fdpp.gemm_configs import (
    GEMV_M,
    L2_PREFETCH,
    FlatGemmConfig,
    GemmPlan,
    GemvConfig,
    iterations,
    m_max_for,
    m_tiles_for,
    tma_space,
)
from fdpp.timing import VerificationError, VerifiedMeasure, randn

log = logging.getLogger("fdpp.gemm_tune")


#: Candidates the tuner times per (shape, M): kernel tiles (m_tiles / m_max follow M) x grids.
TUNE_FLAT: tuple[tuple[int, int, int, int], ...] = (
    (64, 128, 4, 4), (32, 256, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (16, 512, 4, 3),
)
TUNE_GEMV: tuple[tuple[int, int, int], ...] = ((4, 2, 2), (4, 2, 4), (8, 2, 2))
#: Grids tried per kernel candidate: "wave" = SMs x resident CTAs (stream-K, every CTA the same
#: share), "tiles" = one CTA per tile (no split, no fix-up; several waves on big N).
TUNE_GRIDS: tuple[str, ...] = ("wave", "tiles")


def tune_candidates(m: int, dtype: str, device: DeviceLimits, wfmt: str = "") -> list[GemmPlan]:
    """Plans :func:`tune_gemm` times for M rows: flat tiles, GEMV shapes (M <= 4), cuBLAS
    (grid None: the tuner expands it into :data:`TUNE_GRIDS`); FP8 weights (``wfmt`` "e4m3"): the
    bulk-copy kernel's w8 variants only."""
    if wfmt:
        return [GemmPlan("tma", c, None, "tuner") for c in tma_space(dtype, (m_tiles_for(m),), device, w8=1)]
    plans = [GemmPlan("cublas", None, None, "tuner")]
    for bn, bk, w, s in TUNE_FLAT:
        for p in L2_PREFETCH:
            c = FlatGemmConfig(dtype, bn, bk, w, s, m_tiles_for(m), p)
            if c.is_valid(device):
                plans.append(GemmPlan("flat", c, None, "tuner"))
    plans += [GemmPlan("tma", c, None, "tuner") for c in tma_space(dtype, (m_tiles_for(m),), device)]
    if m <= max(GEMV_M):
        for w, r, u in TUNE_GEMV:
            for p in L2_PREFETCH:
                c2 = GemvConfig(dtype, w, r, u, m_max_for(m), p)
                if c2.is_valid(device):
                    plans.append(GemmPlan("gemv", c2, None, "tuner"))
    return plans


def expand_grids(plan: GemmPlan, n: int, k: int, device_id: int,
                 grids: Sequence[str] = TUNE_GRIDS) -> list[GemmPlan]:
    """``plan`` with each grid choice of ``grids`` made explicit (duplicates dropped)."""
    if plan.config is None:
        return [plan]
    from fdpp import registry

    tiles, _, total = iterations(plan.config, n, k)
    wave = resident_ctas(plan.config, device_id) * registry.device_limits(device_id).sm_count
    out: list[GemmPlan] = []
    seen: set[int] = set()
    for g in grids:
        v = min(total, wave if g == "wave" else tiles)
        if v not in seen:
            seen.add(v)
            out.append(GemmPlan(plan.impl, plan.config, v, plan.source))
    return out


def time_plan(plan: GemmPlan, sets: list[dict[str, Any]], repeats: int = 7,
              calls_per_replay: int = 20) -> tuple[Any, str]:
    """Graph-replay timing of ``plan`` over rotated input sets: (Timing, how it ran)."""
    from fdpp import timing

    impls, hows = plan_impls([(plan, sets)])
    return timing.time_round_robin(impls, repeats=repeats, calls_per_replay=calls_per_replay)[0], hows[0]


def plan_impls(runs: Sequence[tuple[GemmPlan, list[dict[str, Any]]]]) -> tuple[list[tuple[list, str]], list[str]]:
    """(the :func:`fdpp.timing.time_round_robin` implementations, how each runs) of (plan, its
    rotated input sets) pairs. cuBLAS runs through torch (``torch.addmm`` on the same memory) when
    torch imports, since CuPy refuses cuBLAS calls during stream capture; without torch,
    ``cupy.matmul`` eagerly."""
    impls: list[tuple[list, str]] = []
    hows: list[str] = []
    for plan, sets in runs:
        if plan.impl != "cublas":
            impls.append(([lambda s=s, p=plan: _forced_call(p, s) for s in sets], "cupy"))
            hows.append(plan.describe())
            continue
        try:
            import torch  # noqa: F401
        except ImportError:
            impls.append(([lambda s=s, p=plan: _forced_call(p, s) for s in sets], "cupy-eager"))
            hows.append("cupy.matmul (eager)")
            continue
        impls.append(([lambda s=s: _torch_addmm(s) for s in [_torch_views(s) for s in sets]], "torch"))
        hows.append("torch.addmm")
    return impls, hows


def _forced_call(plan: GemmPlan, s: dict[str, Any]) -> Any:
    with forced_plan(plan):
        return _call_set(s)


def _torch_views(s: dict[str, Any]) -> dict[str, Any]:
    """torch views of a CuPy input set (raw 16-bit words through DLPack)."""
    import cupy
    import torch

    tdt = torch.float16 if get_dtype(s["x"].dtype).name == "fp16" else torch.bfloat16
    return {nm: torch.from_dlpack(s[nm].view(cupy.int16)).view(tdt) for nm in ("x", "w", "bias", "out")}


def _torch_addmm(s: dict[str, Any]) -> Any:
    import torch

    return torch.addmm(s["bias"], s["x"], s["w"].t(), out=s["out"])


def run_plan(plan: GemmPlan, s: dict[str, Any]) -> np.ndarray:
    """The output of one eager call of ``plan`` on input set ``s`` (poisoned first), as float64 NumPy."""
    dt = get_dtype(s["x"].dtype)
    poison(s["out"])
    if plan.impl == "cublas":
        try:
            import torch

            _torch_addmm(_torch_views(s))
            torch.cuda.synchronize()
        except ImportError:
            with forced_plan(plan):
                _call_set(s)
    else:
        with forced_plan(plan):
            _call_set(s)
    return to_host_f64(s["out"], dt)


def tune_gemm(shapes: Sequence[tuple[int, int]], Ms: Sequence[int], *, dtype: str = "fp16",  # noqa: N803
              path: Path | str | None = None, grids: Sequence[str] = TUNE_GRIDS,
              repeats: int = 7, check: bool = True, progress: bool = True,
              keep: int = 5, wfmt: str = "") -> dict[str, GemmEntry]:
    """Measure GEMV, flat GEMM and cuBLAS for each (N, K) in ``shapes`` and M in ``Ms``; return
    the table entries (the winner's parameters, its time, cuBLAS's time and the next ``keep - 1``
    candidates) and merge them into the table file ``path`` (default the user's ``<GPU>_gemm.json`` in
    ``$FDPP_TUNING_DIR`` or the user cache dir: the last of :func:`table_paths`; ``""`` skips writing).
    ``wfmt`` "e4m3": FP8 weights (the w8 variants; entries ``fp16.e4m3.*``, cuBLAS not timed).

    Every candidate is checked against a float64 reference before it is timed (``check``:
    :class:`fdpp.timing.VerifiedMeasure`, ``max_rel_err <= 2 rtol``); a candidate that fails or
    cannot run is skipped and logged. Timing: :func:`time_plan` (CUDA graph of 20 calls, weight
    sets rotated over >= 4x L2, median of ``repeats``).
    """
    import cupy

    from fdpp import registry, timing

    dev = cupy.cuda.Device().id
    limits = registry.device_limits(dev)
    dt = get_dtype(dtype)
    l2 = timing.l2_bytes(dev)
    entries: dict[str, GemmEntry] = {}
    target = None if path == "" else Path(path) if path else table_paths(limits.name)[-1]
    todo = [(nk, mm) for nk in shapes for mm in Ms]
    bar = _progress(len(todo), progress, "tune_gemm")
    for (n, k), mm in todo:
        sets = _rotated_inputs(n, k, mm, dt, l2, wfmt=wfmt)
        ref = _reference(sets[0]) if check else None
        measure = VerifiedMeasure(lambda p, s0=sets[0]: run_plan(p, s0), ref,
                                  lambda p, ss=sets: time_plan(p, ss, repeats)[0].median_us, dt.name,
                                  tol=2 * dt.rtol)
        results: list[tuple[float, GemmPlan]] = []
        cublas_us = math.nan
        for base in tune_candidates(mm, dt.name, limits, wfmt):
            for plan in expand_grids(base, n, k, dev, grids):
                try:
                    us = measure(plan) if ref is not None else measure.time_fn(plan)
                except VerificationError as e:
                    log.warning("tune_gemm: %s fails the reference at N=%d K=%d M=%d (%s); skipped",
                                plan.describe(), n, k, mm, e)
                    continue
                except Exception as e:  # noqa: BLE001 - a candidate that cannot run is skipped
                    log.warning("tune_gemm: %s failed at N=%d K=%d M=%d: %s", plan.describe(), n, k, mm, e)
                    continue
                if plan.impl == "cublas":
                    cublas_us = us
                results.append((us, plan))
        if results:
            results = rank_candidates(results, cublas_us)
            e = GemmEntry.of(results[0][1], dt.name, n, k, mm, wfmt, time_us=results[0][0],
                             cublas_us=round(cublas_us, 3) if math.isfinite(cublas_us) else None,
                             alternatives={p.describe(): round(us, 3) for us, p in results[1:keep]})
            entries[e.key] = e
        del sets
        if target is not None:  # after every point: an interrupted run keeps what it measured
            write_table(target, limits, entries.values())
        bar.update(1)
    bar.close()
    if target is not None:
        log.info("tune_gemm: wrote %d entries to %s", len(entries), target)
    return entries


#: A kernel of fdpp's replaces cuBLAS in a tuned entry only when it measured at least this much
#: faster: cuBLAS's own time varies by a few per cent between runs (llama3-8b gate_up at M = 1 on
#: the H200: 61.9 us while tuning, 57.2 us in the bench after it, run J3), so a win inside that
#: noise would be a coin toss that can make a model step slower.
CUBLAS_MARGIN = 0.02


def rank_candidates(results: Sequence[tuple[float, GemmPlan]], cublas_us: float,
                    margin: float = CUBLAS_MARGIN) -> list[tuple[float, GemmPlan]]:
    """(median µs, plan) pairs fastest first, except that cuBLAS stays first unless the fastest
    kernel beats it by ``margin`` (a fraction of cuBLAS's time)."""
    ranked = sorted(results, key=lambda r: r[0])
    if not math.isfinite(cublas_us) or ranked[0][1].impl == "cublas":
        return ranked
    if ranked[0][0] <= cublas_us * (1.0 - margin):
        return ranked
    cub = next(r for r in ranked if r[1].impl == "cublas")
    return [cub, *(r for r in ranked if r is not cub)]


def _progress(total: int, enabled: bool, desc: str) -> Any:
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, disable=not enabled)
    except ImportError:  # pragma: no cover
        class _Null:
            def update(self, _: int) -> None: ...
            def close(self) -> None: ...
        return _Null()


def _rotated_inputs(n: int, k: int, m: int, dt: Any, l2: int, seed: int = 0,
                    wfmt: str = "") -> list[dict[str, Any]]:
    """Input sets (x, w, bias, out on the GPU) whose weights together exceed 4x the L2 (>= 2 sets).
    ``wfmt`` "e4m3": w is FP8 codes of random fp16 weights (:func:`fdpp.quantize_weight`) and the
    set holds their ``w_scale``."""
    import cupy

    from fdpp import timing

    nsets = max(2, timing.rotation_count(n * k * (1 if wfmt else dt.itemsize), l2))
    rs = cupy.random.RandomState(seed)
    sets = []
    for _ in range(nsets):
        s = {
            "x": randn(cupy, (m, k), dt.np_dtype, rs),
            "w": randn(cupy, (n, k), dt.np_dtype, rs, scale=1.0 / math.sqrt(k)),
            "bias": randn(cupy, (n,), dt.np_dtype, rs),
            "out": cupy.empty((m, n), dtype=dt.np_dtype),
        }
        if wfmt:
            from fdpp.quant import quantize_weight

            s["w"], s["w_scale"] = quantize_weight(s["w"])
        sets.append(s)
    return sets


def _call_set(s: dict[str, Any]) -> Any:
    return flat_gemm(s["x"], s["w"], w_scale=s.get("w_scale"), bias=s["bias"], out=s["out"])


def to_host_f64(a: Any, dt: Any) -> np.ndarray:
    """A CuPy fp16/bf16 array as float64 NumPy (through its raw 16-bit words: no CuPy bf16 math)."""
    import cupy

    return cupy.asnumpy(a.view(cupy.uint16)).view(dt.np_dtype).astype(np.float64)


def poison(a: Any) -> None:
    """Fill a CuPy fp16/bf16 array with NaN (0xFFFF is a NaN in both formats)."""
    import cupy

    a.view(cupy.uint16).fill(0xFFFF)


def _dev_f64(a: Any, dt: Any) -> Any:
    """A CuPy fp16/bf16 array as CuPy float64 (bf16 widened through its bits)."""
    import cupy

    u = a.view(cupy.uint16)
    if dt.name == "fp16":
        return u.view(cupy.float16).astype(cupy.float64)
    return (u.astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)


def _reference(s: dict[str, Any]) -> np.ndarray:
    """float64 y = x w^T + bias of an input set, as NumPy (CuPy float64 matmul: no fdpp kernel)."""
    import cupy

    dt = get_dtype(s["x"].dtype)
    x, b = (_dev_f64(s[nm], dt) for nm in ("x", "bias"))
    if "w_scale" in s:  # FP8 codes: float64(code) * scale through a 256-entry table of the format
        from fdpp.quant import fp8_decode_bits

        lut = cupy.asarray(fp8_decode_bits(np.arange(256, dtype=np.uint8), "fp8_e4m3").astype(np.float64))
        w = lut[s["w"].view(cupy.uint8)] * s["w_scale"].astype(cupy.float64)[:, None]
    else:
        w = _dev_f64(s["w"], dt)
    return cupy.asnumpy(x @ w.T + b)
