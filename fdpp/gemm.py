"""Flat GEMM for decode-phase linear layers: ``y = x @ w.T (+ bias)`` with M = batch = 1..64.

Everything a GEMM call needs lives here, in the package's one-way data flow:

- **configs** (plain Python, CI checks them without a GPU): :class:`FlatGemmConfig` (tensor-core
  kernel) and :class:`GemvConfig` (CUDA-core kernel), whose fields are the template parameters of
  ``kernels_cu/flat_gemm.cu``; names and keys are derived; ``check(device)`` decides validity
  before compiling; :func:`compile_space` is every variant CI compiles.
- **dataflow** (:func:`choose`): GEMV, flat GEMM or cuBLAS (``cupy.matmul`` / ``torch.mm``) for a
  shape: a tuned table entry (``<GPU>_gemm.json``, shipped and user, written by :func:`fdpp.gemm_tune.tune_gemm`) if one
  applies, else :func:`heuristic_plan`.
- **public call** :func:`flat_gemm`: validation (TypeError/ValueError naming the argument),
  NumPy/CuPy/torch arrays, launch through :mod:`fdpp.registry`.

Table file (``TABLE_SCHEMA`` 1)::

    {"schema": 1, "kind": "flat_gemm", "device": "NVIDIA H200", "sm_count": 132,
     "source_hash": "<hash of flat_gemm.cu + headers>", "fdpp_version": "0.1.0",
     "written": "<ISO date>",
     "entries": {"fp16.n6144.k4096.m8": {"impl": "flat", "block_n": 64, "block_k": 128,
                 "num_warps": 4, "num_stages": 4, "grid": 396, "time_us": 12.1, "cublas_us": 15.6},
                 "fp16.n4096.k4096.m1": {"impl": "gemv", "num_warps": 4, "rows": 2, "unroll": 2,
                 "grid": 528, ...},
                 "fp16.n128.k128.m64": {"impl": "cublas", ...},
                 "fp16.e4m3.n6144.k4096.m8": {"impl": "tma", ..., "w8": 1, ...}}}   # FP8 weights

M is bucketed up to a power of two (1, 2, 4, ..., 64); ``m_tiles`` / ``m_max`` (x rows a variant
holds) always follow the actual M, so an entry serves any M of its bucket. Lookup: exact bucket,
else the nearest bucket of the same (dtype, N, K) whose plan fits M, else the heuristic. A header
for another device or another kernel source makes the whole file ignored, a malformed entry is
dropped alone (one :class:`fdpp.tables.TableWarning` each). Every kernel is in ``flat_gemm.cu``, so
the header's ``source_hash`` is every entry's (cuBLAS entries too: they were chosen against
those kernels' times).

Files (:func:`table_paths`), handled by :mod:`fdpp.tables` as the attention tables are: the shipped
``tuning/<GPU>_gemm.json``, then the user's ``<GPU>_gemm.json`` in ``$FDPP_TUNING_DIR`` (else the
platformdirs user cache dir ``fdpp``), user entries overriding shipped ones key by key;
``$FDPP_GEMM_TABLE``, when set, names the one file read instead (and written by the tuner).
Writes merge into the file under its lock and replace it atomically.

FP8 weights (W8A16, ``w_scale``): the bulk-copy kernel's ``w8`` variants only, their own table entries
(``fp16.e4m3.n....``); run U4 (results/device_runU4/): 1.23-1.83x cuBLAS on the 16-bit weights at
M <= 8, 60-98 % of their own floor (qkv lowest, o highest).

Measured (NVIDIA H200, fp16, Llama-3-8B shapes, M = 1..16; results/gemm_llama3-8b_h200.csv,
run J6, programmatic dependent launch, the table of run J3 with the 2 % cuBLAS margin): the
bulk-copy kernel (flat_tma) beats cuBLAS (torch.addmm, graph-timed in the same process) on o at
every M by 1.09-1.24x (11.2-13.0 us vs 13.7-14.2, 32-row tiles, one CTA per SM), on down M = 8 by
7 % (32.43 vs 34.71 us) and qkv M = 2 by 5 %; the table sends 11 points to cuBLAS, so the median
speedup is 1.00. The ceiling is close: cuBLAS / (stream-read floor of the same bytes) is
1.05-1.11 on gate_up, 1.14-1.15 on down at M <= 4 and 1.17-1.23 on qkv, so a kernel at the floor
everywhere would get a median of 1.19.
What the sweeps showed (results/gemm_sweep_h200.csv, an intermediate flat_tma without ``x_ring``
and ``groups``): the stream-K fix-up costs ~3 us, so one CTA per tile wins whenever that fills
the SMs; 1 KB bulk copies stream slower than 2 KB ones (o, M = 1: 14.3 vs 12.2 us); with 16-row
tiles, rings big enough to leave one CTA per SM lost (the final table's 32-row tiles at one CTA
per SM win on o, see the table's alternatives).
Tried and dropped the same day (o, M = 1, one CTA per tile): w loaded straight into registers
13.3 us (80 % of the floor; registers cap the bytes in flight), a lane-private cp.async ring
18.6 us; flat_gemm (cp.async, shared tiles) stays for pre-Hopper GPUs at ~65 %.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import re
import struct
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from fdpp import launch as _launch
from fdpp import plan as _plan
from fdpp import tables
from fdpp import workspace as _ws
from fdpp.configs import SM80, SM90, DeviceLimits
from fdpp.dtypes import DTYPES, get_dtype

log = logging.getLogger("fdpp.gemm")

GEMM_DTYPES = ("fp16", "bf16")
MAX_M = 64
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TABLE_SCHEMA = 1
ENV_TABLE = "FDPP_GEMM_TABLE"  # path of the one table file to read (and tune into) instead of the layers
SOURCE = "flat_gemm.cu"


def _ceil_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def m_bucket(m: int) -> int:
    """M rounded up to a power of two (the table's bucket): 3 -> 4, 17 -> 32."""
    return _ceil_pow2(m)


# ---- configs --------------------------------------------------------------------------------
class _KernelCfg:
    """What every flat_gemm.cu variant config shares (fields: ``dtype``, ``num_warps``; a
    ``m_cap`` property and a ``check(device)`` method)."""

    @property
    def threads(self) -> int:
        return self.num_warps * 32  # type: ignore[attr-defined]

    @property
    def source(self) -> str:
        return SOURCE

    def fits(self, m: int) -> bool:
        return 1 <= m <= self.m_cap  # type: ignore[attr-defined]

    def is_valid(self, device: DeviceLimits = SM90) -> bool:
        return self.check(device) is None  # type: ignore[attr-defined]


@dataclass(frozen=True)
class FlatGemmConfig(_KernelCfg):
    """Template parameters of ``fdpp::flat_gemm`` (tensor cores, cp.async pipeline).

    ``block_n`` rows of w per tile (16 per MMA group), ``block_k`` columns per pipeline stage,
    ``num_stages`` stages in shared memory, ``m_tiles`` tiles of 8 x rows (M <= 8 * m_tiles),
    ``l2_prefetch`` 0 or 256 (the .L2::256B prefetch-size hint on w's loads).
    """

    dtype: str
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    m_tiles: int = 1
    l2_prefetch: int = 0
    kernel: ClassVar[str] = "flat_gemm"
    TUNED: ClassVar[tuple[str, ...]] = ("block_n", "block_k", "num_warps", "num_stages", "l2_prefetch")

    # derived layout: mirrors FlatLayout in flat_gemm.cu
    @property
    def groups(self) -> int:
        return self.block_n // 16

    @property
    def warps_k(self) -> int:
        return 1 if self.groups >= self.num_warps else self.num_warps // max(1, self.groups)

    @property
    def groups_per_warp(self) -> int:
        return self.groups // self.num_warps if self.groups >= self.num_warps else 1

    @property
    def m_cap(self) -> int:
        return 8 * self.m_tiles

    def smem_bytes(self) -> int:
        vpr = self.block_k // 8
        stage = (self.block_n + self.m_cap) * vpr * 16
        red = self.warps_k * self.m_cap * (self.block_n + 4) * 4
        return self.num_stages * stage + red

    def estimated_registers(self) -> int:
        gpw = self.groups_per_warp
        return gpw * self.m_tiles * 4 + gpw * 8 + 4 + 56

    def template_args(self) -> str:
        return (f"{DTYPES[self.dtype].ctype},{self.block_n},{self.block_k},{self.num_warps},"
                f"{self.num_stages},{self.m_tiles},{self.l2_prefetch}")

    def name_expression(self) -> str:
        return f"fdpp::flat_gemm<{self.template_args()}>"

    @property
    def key(self) -> str:
        return (f"flat_gemm.{DTYPES[self.dtype].tag}.n{self.block_n}.k{self.block_k}"
                f".w{self.num_warps}.s{self.num_stages}.m{self.m_tiles}.p{self.l2_prefetch}")

    def check(self, device: DeviceLimits = SM90) -> str | None:
        """Why this variant cannot run on ``device`` (None: valid). Mirrors the static_asserts."""
        if self.dtype not in GEMM_DTYPES:
            return f"dtype {self.dtype!r} not in {GEMM_DTYPES}"
        if self.num_warps not in (1, 2, 4, 8, 16):
            return f"num_warps {self.num_warps} not a power of two in 1..16"
        if self.block_n < 16 or self.block_n % 16:
            return f"block_n {self.block_n} is not a positive multiple of 16"
        g, w = self.groups, self.num_warps
        if g % w and w % g:
            return f"{w} warps cannot tile {g} groups of 16 rows"
        if self.block_n > self.threads:
            return f"block_n {self.block_n} > {self.threads} threads (one thread per row loads the bias)"
        if self.block_k < 64 or self.block_k % 64:
            return f"block_k {self.block_k} is not a positive multiple of 64"
        if (self.block_k // self.warps_k) % 32:
            return f"block_k {self.block_k} split over {self.warps_k} warps is not a multiple of 32"
        if not 2 <= self.num_stages <= 8:
            return f"num_stages {self.num_stages} outside 2..8"
        if self.m_tiles not in (1, 2, 4, 8):
            return f"m_tiles {self.m_tiles} not in 1, 2, 4, 8"
        if self.l2_prefetch not in (0, 256):
            return f"l2_prefetch {self.l2_prefetch} not 0 or 256"
        if self.smem_bytes() > device.smem_per_block:
            return f"needs {self.smem_bytes()} B of shared memory > {device.smem_per_block} on {device.arch}"
        if self.estimated_registers() > 200:
            return f"needs about {self.estimated_registers()} registers per thread"
        return None

    def tile(self) -> tuple[int, int]:
        return self.block_n, self.block_k

    def for_m(self, m: int) -> FlatGemmConfig:
        return dataclasses.replace(self, m_tiles=m_tiles_for(m))


@dataclass(frozen=True)
class FlatTmaConfig(_KernelCfg):
    """Template parameters of ``fdpp::flat_tma`` (tensor cores, bulk-copy ring; sm_90 and newer).

    A tile is 16 * groups rows of w by 32 * ksteps * num_warps columns (each warp takes 32 * ksteps of
    them); ``num_stages`` tiles in the shared-memory ring; ``m_tiles`` tiles of 8 x rows;
    ``x_ring`` 1: x's rows are bulk-copied into every stage too, 0: read through L1;
    ``groups`` 1, 2 or 3 row groups of 16 per tile (2 halves the x reads per byte of w; 3 makes
    qkv's 6144 rows 128 tiles, one CTA per SM);
    ``w8`` 1: FP8 E4M3 weights with a float32 scale per row (W8A16; ``dtype`` fp16), 0: w in ``dtype``.
    """

    dtype: str
    num_warps: int = 4
    ksteps: int = 4
    m_tiles: int = 1
    num_stages: int = 2
    x_ring: int = 0
    groups: int = 1
    w8: int = 0
    kernel: ClassVar[str] = "flat_tma"
    TUNED: ClassVar[tuple[str, ...]] = ("num_warps", "ksteps", "num_stages", "x_ring", "groups", "w8")

    # derived layout: mirrors TmaLayout in flat_gemm.cu
    @property
    def block_n(self) -> int:
        return 16 * self.groups

    @property
    def block_k(self) -> int:
        return 32 * self.ksteps * self.num_warps

    @property
    def m_cap(self) -> int:
        return 8 * self.m_tiles

    def smem_bytes(self) -> int:  # mirrors TmaLayout::SMEM_BYTES
        red = self.num_warps * self.m_cap * (self.block_n + 4) * 4
        pitch = self.block_k * 2 + 64
        w_pitch = self.block_k + 32 if self.w8 else pitch
        stage = self.block_n * w_pitch + (self.m_cap * pitch if self.x_ring else 0)
        return self.num_stages * stage + red

    def estimated_registers(self) -> int:
        return ((1 if self.x_ring else self.ksteps) * self.m_tiles * 4 + self.groups * self.m_tiles * 4
                + 8 * self.groups + 48 + 4 * self.w8 * (1 + self.groups * self.m_tiles))

    def name_expression(self) -> str:
        return (f"fdpp::flat_tma<{DTYPES[self.dtype].ctype},{self.num_warps},{self.ksteps},"
                f"{self.m_tiles},{self.num_stages},{self.x_ring},{self.groups},{self.w8}>")

    @property
    def key(self) -> str:
        return (f"flat_tma.{DTYPES[self.dtype].tag}.w{self.num_warps}.s{self.ksteps}"
                f".m{self.m_tiles}.r{self.num_stages}.x{self.x_ring}.g{self.groups}" + (".e4m3" if self.w8 else ""))

    def check(self, device: DeviceLimits = SM90) -> str | None:
        """Why this variant cannot run on ``device`` (None: valid). Mirrors the static_asserts."""
        if self.dtype not in GEMM_DTYPES:
            return f"dtype {self.dtype!r} not in {GEMM_DTYPES}"
        if self.w8 not in (0, 1):
            return f"w8 {self.w8} not 0 or 1"
        if self.w8 and self.dtype != "fp16":
            return f"FP8 weights (w8) take fp16 activations, not {self.dtype}"
        if device.cc < (9, 0):
            return f"bulk copies need sm_90 or newer, not {device.arch}"
        if self.num_warps not in (1, 2, 4, 8, 16):
            return f"num_warps {self.num_warps} not a power of two in 1..16"
        if not 1 <= self.ksteps <= 16:
            return f"ksteps {self.ksteps} outside 1..16"
        if self.m_tiles not in (1, 2, 4, 8):
            return f"m_tiles {self.m_tiles} not in 1, 2, 4, 8"
        if not 2 <= self.num_stages <= 16:
            return f"num_stages {self.num_stages} outside 2..16"
        if self.x_ring not in (0, 1):
            return f"x_ring {self.x_ring} not 0 or 1"
        if self.groups not in (1, 2, 3):
            return f"groups {self.groups} not 1, 2 or 3"
        if self.block_n > self.threads:
            return f"block_n {self.block_n} > {self.threads} threads (one thread per row loads the bias)"
        if self.smem_bytes() > device.smem_per_block:
            return f"needs {self.smem_bytes()} B of shared memory > {device.smem_per_block} on {device.arch}"
        cap = min(200, device.regs_per_sm // self.threads)  # one CTA must fit: __launch_bounds__(., 1)
        if self.estimated_registers() > cap:
            return f"needs about {self.estimated_registers()} registers per thread (> {cap})"
        return None

    def for_m(self, m: int) -> FlatTmaConfig:
        return dataclasses.replace(self, m_tiles=m_tiles_for(m))


@dataclass(frozen=True)
class GemvConfig(_KernelCfg):
    """Template parameters of ``fdpp::gemv`` (CUDA cores, w streamed into registers).

    Each of ``num_warps`` warps owns ``rows`` rows of a tile; a lane loads ``unroll`` 16-byte
    vectors per row per step (a step is 256 * unroll columns). ``m_max``: x rows held (M <= m_max).
    ``l2_prefetch``: 0 or 256 (the .L2::256B prefetch-size hint on w's loads).
    """

    dtype: str
    num_warps: int = 4
    rows: int = 2
    unroll: int = 2
    m_max: int = 1
    l2_prefetch: int = 0
    kernel: ClassVar[str] = "gemv"
    TUNED: ClassVar[tuple[str, ...]] = ("num_warps", "rows", "unroll", "l2_prefetch")

    @property
    def block_n(self) -> int:
        return self.num_warps * self.rows

    @property
    def block_k(self) -> int:
        return 256 * self.unroll

    @property
    def m_cap(self) -> int:
        return self.m_max

    def smem_bytes(self) -> int:
        return self.m_max * (self.block_n + 4) * 4

    def estimated_registers(self) -> int:
        return 2 * self.rows * self.unroll * 4 + self.rows * 8 + 8 + self.rows * self.m_max + 40

    def name_expression(self) -> str:
        return (f"fdpp::gemv<{DTYPES[self.dtype].ctype},{self.num_warps},{self.rows},{self.unroll},"
                f"{self.m_max},{self.l2_prefetch}>")

    @property
    def key(self) -> str:
        return (f"gemv.{DTYPES[self.dtype].tag}.w{self.num_warps}.r{self.rows}.u{self.unroll}"
                f".m{self.m_max}.p{self.l2_prefetch}")

    def check(self, device: DeviceLimits = SM90) -> str | None:
        if self.dtype not in GEMM_DTYPES:
            return f"dtype {self.dtype!r} not in {GEMM_DTYPES}"
        if self.num_warps not in (1, 2, 4, 8, 16):
            return f"num_warps {self.num_warps} not a power of two in 1..16"
        if not 1 <= self.rows <= 8 or not 1 <= self.unroll <= 8:
            return "rows and unroll must be in 1..8"
        if self.m_max not in GEMV_M:
            return f"m_max {self.m_max} not in {GEMV_M}"
        if self.l2_prefetch not in (0, 256):
            return f"l2_prefetch {self.l2_prefetch} not 0 or 256"
        if self.smem_bytes() > device.smem_per_block:
            return f"needs {self.smem_bytes()} B of shared memory"
        if self.estimated_registers() > 160:
            return f"needs about {self.estimated_registers()} registers per thread"
        return None

    def for_m(self, m: int) -> GemvConfig:
        return dataclasses.replace(self, m_max=m_max_for(m))


GEMV_M = (1, 2, 4)
KernelCfg = FlatGemmConfig | FlatTmaConfig | GemvConfig


def m_tiles_for(m: int) -> int:
    """Tiles of 8 x rows a flat_gemm variant needs for M rows (1, 2, 4 or 8)."""
    return _ceil_pow2(math.ceil(m / 8))


def m_max_for(m: int) -> int:
    return _ceil_pow2(m)


@dataclass(frozen=True)
class GemmPlan:
    """What one call launches. ``impl`` "tma" | "flat" | "gemv" | "cublas"; ``config`` None for cuBLAS;
    ``grid`` CTAs of the stream-K split (None: SMs x resident CTAs, i.e. one full wave)."""

    impl: str
    config: KernelCfg | None = None
    grid: int | None = None
    source: str = field(default="heuristic", compare=False)  # "heuristic" | "table" | "forced"

    def describe(self) -> str:
        if self.config is None:
            return self.impl
        return f"{self.config.key}.g{self.grid if self.grid else 'auto'}"


# ---- search space ---------------------------------------------------------------------------
#: (block_n, block_k, num_warps, num_stages) of the flat kernel; each for every m_tiles.
FLAT_TILES: tuple[tuple[int, int, int, int], ...] = (
    (16, 512, 4, 3), (32, 256, 4, 4), (64, 64, 4, 6), (64, 128, 4, 4), (64, 256, 4, 3),
    (64, 128, 8, 4), (128, 128, 4, 3),
)
#: (num_warps, rows, unroll) of the GEMV kernel; each for every m_max.
GEMV_SHAPES: tuple[tuple[int, int, int], ...] = ((4, 2, 2), (4, 2, 4), (8, 2, 2))
#: (num_warps, ksteps, num_stages, x_ring, groups) of the bulk-copy kernel (sm_90); each for every
#: m_tiles. Mostly 2 KB copies (block_k 1024): 1 KB copies lost to them in the H200 sweeps, and
#: 16-row tiles of >= 4 KB copies (one CTA per SM) lost to 2-3 CTAs per SM. groups = 2 (32-row
#: tiles, one CTA per SM) halves x's reads per byte of w; it wins on o (4096 x 4096).
TMA_SHAPES: tuple[tuple[int, int, int, int, int], ...] = (
    (8, 4, 2, 0, 1), (4, 8, 2, 0, 1), (8, 4, 3, 0, 1), (2, 16, 2, 0, 1),
    (8, 4, 2, 1, 1), (4, 8, 2, 1, 1), (8, 4, 3, 1, 1), (4, 4, 2, 1, 1),
    (8, 4, 2, 0, 2), (8, 4, 3, 0, 2), (8, 4, 2, 1, 2), (4, 8, 2, 1, 2),
    (8, 4, 2, 0, 3),  # 48-row tiles: N = 6144 (qkv) in 128 tiles, one CTA per SM
)
#: The same for FP8 weights (w8 = 1, fp16 x): a row of w is BLOCK_K bytes, so tiles of 2048 columns
#: keep the 2 KB copies of the 16-bit search space (and 1 KB ones are searched beside them).
TMA_SHAPES_W8: tuple[tuple[int, int, int, int, int], ...] = (
    (8, 8, 2, 0, 1), (4, 16, 2, 0, 1), (8, 8, 3, 0, 1), (8, 4, 2, 0, 1), (8, 4, 4, 0, 1),
    (8, 8, 2, 1, 1), (8, 8, 2, 0, 2), (8, 8, 3, 0, 2), (8, 4, 3, 0, 2), (8, 8, 2, 1, 2),
    (8, 2, 2, 1, 1),  # the one that fits M = 33..64 (x in the ring, 512-column tiles)
    (8, 8, 2, 0, 3), (8, 4, 3, 0, 3),  # 48-row tiles (qkv: 128 tiles)
)
#: l2_prefetch values searched. 256 (the .L2::256B hint) was never faster on the H200 (tuning
#: run of 2026-11-30: 0.3-4 % slower at every point), so it is not searched; EXTRA_VARIANTS keeps
#: two variants with it compiled in CI and the GPU tests force them.
L2_PREFETCH = (0,)


def flat_space(dtype: str, m_tiles: Iterable[int] = (1, 2, 4, 8),
               device: DeviceLimits = SM90) -> list[FlatGemmConfig]:
    return [c for mt in m_tiles for (bn, bk, w, s) in FLAT_TILES for p in L2_PREFETCH
            if (c := FlatGemmConfig(dtype, bn, bk, w, s, mt, p)).is_valid(device)]


def tma_space(dtype: str, m_tiles: Iterable[int] = (1, 2, 4, 8),
              device: DeviceLimits = SM90, w8: int = 0) -> list[FlatTmaConfig]:
    """The bulk-copy kernel's search space (``w8`` 1: the FP8-weight variants, fp16 only)."""
    if w8 and dtype != "fp16":
        return []
    return [c for mt in m_tiles for (w, st, ns, xr, gr) in (TMA_SHAPES_W8 if w8 else TMA_SHAPES)
            if (c := FlatTmaConfig(dtype, w, st, mt, ns, xr, gr, w8)).is_valid(device)]


def gemv_space(dtype: str, m_max: Iterable[int] = GEMV_M,
               device: DeviceLimits = SM90) -> list[GemvConfig]:
    return [c for mm in m_max for (w, r, u) in GEMV_SHAPES for p in L2_PREFETCH
            if (c := GemvConfig(dtype, w, r, u, mm, p)).is_valid(device)]


def extra_variants(dtype: str) -> list[KernelCfg]:
    """Variants outside the search space that the GPU tests force (the L2 prefetch hint)."""
    return [FlatGemmConfig(dtype, 64, 256, 4, 3, 1, 256), FlatGemmConfig(dtype, 64, 256, 4, 3, 2, 256),
            GemvConfig(dtype, 4, 2, 4, 1, 256), GemvConfig(dtype, 4, 2, 4, 4, 256)]


def compile_space(dtype: str) -> list[KernelCfg]:
    """Every variant of ``flat_gemm.cu`` for one dtype CI compiles: the search space (valid on
    sm_90) and :func:`extra_variants`."""
    return [*flat_space(dtype), *tma_space(dtype), *tma_space(dtype, w8=1), *gemv_space(dtype),
            *extra_variants(dtype)]


# ---- heuristic ------------------------------------------------------------------------------
def heuristic_plan(m: int, n: int, k: int, dtype: str = "fp16", device: DeviceLimits = SM90,
                   wfmt: str = "") -> GemmPlan:
    """The plan used where no tuned entry applies (from the H200 sweeps in results/).

    sm_90 and newer: the bulk-copy kernel (4 warps x 8 steps = 1024-column tiles, 2 stages, x
    through L1; within 4 % of the best tuned variant on qkv, o and down at M = 1 in the H200
    table's alternatives), one CTA per 16-row tile when that fills the SMs, else one stream-K wave.
    Older GPUs: M = 1 the GEMV kernel, otherwise the cp.async flat kernel with 64 x 256 tiles.
    FP8 weights (``wfmt`` "e4m3"): the bulk-copy kernel with 8 warps x 8 steps (2048-column tiles:
    2 KB copies of one-byte codes; M > 32: 8 warps x 2 steps, x in the ring), one CTA per tile when
    the tiles fill one wave of two CTAs per SM, else a stream-K wave (run U3's probe); sm_90 only
    (ValueError elsewhere).
    """
    dt = get_dtype(dtype).name
    mt = m_tiles_for(m)
    if wfmt:
        why = ""
        for shape in ((8, 8, 2, 0, 1), (8, 2, 2, 1, 1)):  # the second for M = 33..64
            t = FlatTmaConfig(dt, shape[0], shape[1], mt, *shape[2:], 1)
            why = t.check(device)
            if not why:  # one CTA per tile while they fit one wave (2 CTAs per SM), else a stream-K wave
                tiles = math.ceil(n / t.block_n)
                return GemmPlan("tma", t, tiles if device.sm_count <= tiles <= 2 * device.sm_count else None,
                                source="heuristic")
        raise ValueError(f"FP8 weights (w_scale given) run on the bulk-copy kernel only: {why}")
    for t in (FlatTmaConfig(dt, 4, 8, mt, 2, 0), FlatTmaConfig(dt, 8, 2, mt, 2, 0)):
        if t.is_valid(device):
            tiles = math.ceil(n / t.block_n)
            return GemmPlan("tma", t, tiles if tiles >= device.sm_count else None, source="heuristic")
    if m == 1:
        g = GemvConfig(dt, 8, 2, 2, 1)
        if g.is_valid(device):
            return GemmPlan("gemv", g, None, source="heuristic")
    for bn, bk, w, s in ((64, 256, 4, 3), (64, 128, 4, 4), (64, 64, 4, 6)):
        cfg = FlatGemmConfig(dt, bn, bk, w, s, mt)
        if cfg.is_valid(device):
            return GemmPlan("flat", cfg, None, source="heuristic")
    raise ValueError(f"no valid flat_gemm variant for M={m} on {device.arch}")  # pragma: no cover


def table_key(dtype: str, n: int, k: int, m: int, wfmt: str = "") -> str:
    """``fp16.n6144.k4096.m8``; FP8 weights (``wfmt`` "e4m3"): ``fp16.e4m3.n6144.k4096.m8``."""
    return f"{get_dtype(dtype).name}{'.' + wfmt if wfmt else ''}.n{n}.k{k}.m{m_bucket(m)}"


def table_filename(device_name: str) -> str:
    """``NVIDIA H200`` -> ``NVIDIA_H200_gemm.json``."""
    return tables.table_filename(device_name, "_gemm")


def table_paths(device_name: str) -> list[Path]:
    """The GEMM table files lookups read, later ones overriding earlier ones entry by entry:
    ``$FDPP_GEMM_TABLE`` alone when it is set, else the shipped table and the user's (the layers
    of the attention tables, :func:`fdpp.tables.layer_paths`). :func:`fdpp.gemm_tune.tune_gemm` writes the last."""
    env = os.environ.get(ENV_TABLE)
    return [Path(env)] if env else [p for _, p in tables.layer_paths(table_filename(device_name))]


def current_source_hash() -> str:
    from fdpp.registry import source_hash

    return source_hash(SOURCE)


def plan_from_entry(entry: dict[str, Any], dtype: str, m: int) -> GemmPlan:
    """The plan an entry describes, for M rows (raises KeyError/ValueError/TypeError if malformed)."""
    impl = entry["impl"]
    grid = entry.get("grid")
    grid = None if grid is None else int(grid)
    if impl == "cublas":
        return GemmPlan("cublas", None, None, source="table")
    if impl == "flat":
        cfg: KernelCfg = FlatGemmConfig(dtype, **{f: int(entry[f]) for f in FlatGemmConfig.TUNED},
                                        m_tiles=m_tiles_for(m))
    elif impl == "tma":
        cfg = FlatTmaConfig(dtype, **{f: int(entry[f]) for f in FlatTmaConfig.TUNED if f != "w8"},
                            w8=int(entry.get("w8", 0)), m_tiles=m_tiles_for(m))
    elif impl == "gemv":
        cfg = GemvConfig(dtype, **{f: int(entry[f]) for f in GemvConfig.TUNED}, m_max=m_max_for(m))
    else:
        raise ValueError(f"unknown impl {impl!r}")
    return GemmPlan(impl, cfg, grid, source="table")


def entry_from_plan(plan: GemmPlan, **extra: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"impl": plan.impl}
    if plan.config is not None:
        d.update({f: getattr(plan.config, f) for f in type(plan.config).TUNED})
        d["grid"] = plan.grid
    d.update(extra)
    return d


class GemmTable:
    """Loaded entries: of one file (``path``, ``header``; ``error`` says why it was ignored, None:
    in use), or (:func:`table_for`) of the files in ``layers`` merged, later ones overriding."""

    def __init__(self, path: Path | None, header: dict[str, Any], entries: dict[str, dict[str, Any]],
                 error: str | None = None, layers: Sequence[GemmTable] = ()) -> None:
        self.path, self.header, self.entries, self.error = path, header, entries, error
        self.layers = list(layers)
        self._memo: dict[tuple[str, int, int, int, DeviceLimits, str], GemmPlan | None] = {}

    def lookup(self, dtype: str, m: int, n: int, k: int, device: DeviceLimits, wfmt: str = "") -> GemmPlan | None:
        """Exact M bucket, else the nearest bucket (in octaves, ties to the larger) whose plan is
        valid for M on ``device``, else the same for the other 16-bit dtype (fp16 <-> bf16 read the
        same bytes through the same kernels); None when (N, K) has no entry. Memoised per shape:
        this runs on every flat_gemm call. FP8 weights (``wfmt`` "e4m3") read only their own
        entries (``fp16.e4m3.*``)."""
        key = (dtype, m, n, k, device, wfmt)
        if key not in self._memo:
            self._memo[key] = self._lookup(dtype, m, n, k, device, wfmt)
        return self._memo[key]

    def _lookup(self, dtype: str, m: int, n: int, k: int, device: DeviceLimits, wfmt: str = "") -> GemmPlan | None:
        dt = get_dtype(dtype).name
        want = m_bucket(m)
        cands = sorted(M_BUCKETS, key=lambda b: (abs(math.log2(b) - math.log2(want)), -b))
        # the other 16-bit type last: same bytes, same kernels, same speed (tuned in one of them)
        keys = [(dt, b) for b in cands]
        if not wfmt:
            keys += [(o, b) for o in GEMM_DTYPES if o != dt for b in cands]
        for src_dt, b in keys:
            e = self.entries.get(table_key(src_dt, n, k, b, wfmt))
            if e is None:
                continue
            try:
                plan = plan_from_entry(e, dt, m)
            except (KeyError, ValueError, TypeError) as err:
                log.debug("table entry %s.n%d.k%d.m%d malformed: %s", dt, n, k, b, err)
                continue
            if plan.config is not None and (not plan.config.is_valid(device) or not plan.config.fits(m)):
                continue
            if _plan_wfmt(plan) != wfmt:  # never FP8 kernels for 16-bit weights, nor the other way
                continue
            return plan
        return None


def _plan_wfmt(plan: GemmPlan) -> str:
    return "e4m3" if getattr(plan.config, "w8", 0) else ""


_KEY = re.compile(r"(?P<dt>fp16|bf16)(\.(?P<wf>e4m3))?\.n\d+\.k\d+\.m(?P<m>\d+)")


def _entry_error(key: str, entry: Any) -> str | None:
    """Why an entry is malformed (None: it is not; whether it runs on a device is left to lookup)."""
    mk = _KEY.fullmatch(key)
    if mk is None or int(mk["m"]) not in M_BUCKETS:
        return f"key {key!r} is not <fp16|bf16>[.e4m3].n<N>.k<K>.m<M bucket>"
    try:
        plan = plan_from_entry(entry, mk["dt"], int(mk["m"]))
    except (KeyError, ValueError, TypeError) as e:
        return f"malformed entry ({type(e).__name__}: {e})"
    if _plan_wfmt(plan) != (mk["wf"] or ""):
        return f"key {key!r} and its plan disagree on the weight format"
    return None


def read_table(path: Path | str, device: DeviceLimits) -> GemmTable:
    """Load one GEMM table file for ``device``. Never raises: a missing file is silently empty; a
    corrupt file or a header for another device / kernel source is ignored whole, a malformed entry
    alone; each warns (:class:`fdpp.tables.TableWarning`) once per load."""
    path = Path(path)
    raw, why = tables.load_json(path)
    if raw is None and why is None:
        return GemmTable(path, {}, {}, error="absent")
    if raw is not None and not isinstance(raw.get("entries"), dict):
        why = "not a table (no 'entries' object)"
    if why:
        tables.warn_ignored(f"fdpp: GEMM table {path} unreadable ({why}); using the heuristic")
        return GemmTable(path, {}, {}, error=why)
    header = {k: v for k, v in raw.items() if k != "entries"}
    if header.get("schema") != TABLE_SCHEMA or header.get("kind") != "flat_gemm":
        why = f"schema {header.get('schema')!r}/{header.get('kind')!r}, expected {TABLE_SCHEMA}/'flat_gemm'"
    elif header.get("device") != device.name:
        why = f"written for {header.get('device')!r}, this GPU is {device.name!r}"
    elif header.get("source_hash") != current_source_hash():
        why = "kernels_cu/flat_gemm.cu changed since it was tuned"
    if why:
        tables.warn_ignored(f"fdpp: GEMM table {path} ignored: {why}; using the heuristic")
        return GemmTable(path, header, {}, error=why)
    entries, rejected = {}, {}
    for key, e in raw["entries"].items():
        if (why := _entry_error(key, e)) is None:
            entries[key] = e
        else:
            rejected[key] = why
    if rejected:
        tables.warn_ignored(f"fdpp: ignoring {len(rejected)} of {len(raw['entries'])} entries of GEMM table "
                            f"{path}: {'; '.join(sorted(set(rejected.values()))[:4])}")
    return GemmTable(path, header, entries)


def write_table(path: Path | str, device: DeviceLimits, entries: dict[str, dict[str, Any]], *,
                merge: bool = True) -> Path:
    """Write ``entries`` into the table file ``path``, atomically under its lock
    (:func:`fdpp.tables.update_file`); with ``merge`` the valid entries already there are kept
    unless ``entries`` has the same key (a stale or foreign file is replaced, with its warning)."""
    from fdpp import __version__

    path = Path(path)

    def render() -> str:
        out = dict(read_table(path, device).entries) if merge else {}
        out.update(entries)
        doc = {"schema": TABLE_SCHEMA, "kind": "flat_gemm", "device": device.name,
               "sm_count": device.sm_count, "source_hash": current_source_hash(),
               "fdpp_version": __version__,
               "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "entries": dict(sorted(out.items()))}
        return json.dumps(doc, indent=1) + "\n"

    tables.update_file(path, render)
    _loaded_tables.clear()
    global _table_generation
    _table_generation += 1  # launch records chose their plans from the old tables
    return path


_loaded_tables: dict[tuple, GemmTable] = {}


def table_for(device: DeviceLimits) -> GemmTable:
    """The merged tables of ``device`` (:func:`table_paths`), memoised per device and location."""
    key = (device, os.environ.get(ENV_TABLE), tables.user_dir_str(), tables.shipped_dir())
    t = _loaded_tables.get(key)
    if t is None:
        layers = [read_table(p, device) for p in table_paths(device.name)]
        entries = {k: e for layer in layers for k, e in layer.entries.items()}
        t = _loaded_tables[key] = GemmTable(None, {}, entries, layers=layers)
    return t


# ---- dataflow -------------------------------------------------------------------------------
_forced: ContextVar[GemmPlan | None] = ContextVar("fdpp_forced_gemm_plan", default=None)


@contextlib.contextmanager
def forced_plan(plan: GemmPlan) -> Iterator[GemmPlan]:
    """Make every ``flat_gemm`` call in this context launch ``plan`` (tests, the tuner).
    A kernel plan's m_tiles / m_max are adapted to each call's M."""
    token = _forced.set(plan)
    try:
        yield plan
    finally:
        _forced.reset(token)


def choose(m: int, n: int, k: int, device: DeviceLimits = SM90, dtype: str = "fp16",
           table: GemmTable | None = None, wfmt: str = "") -> GemmPlan:
    """GEMV, flat GEMM or cuBLAS for y[m, n] = x[m, k] w[n, k]^T on ``device`` (``wfmt`` "e4m3":
    w holds FP8 codes, only the bulk-copy kernel's w8 variants apply).

    A forced plan (:func:`forced_plan`) wins; then the tuned table (``table``, default the ones for
    this device, :func:`table_for`); then :func:`heuristic_plan`.
    """
    dt = get_dtype(dtype).name
    forced = _forced.get()
    if forced is not None:
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
    t = table if table is not None else table_for(device)
    plan = t.lookup(dt, m, n, k, device, wfmt) if t.entries else None
    return plan if plan is not None else heuristic_plan(m, n, k, dt, device, wfmt)


def GemmConfigAsDtype(cfg: KernelCfg, dtype: str) -> KernelCfg:  # noqa: N802 - reads like a cast
    """``cfg`` with its dtype replaced (a forced plan serves fp16 and bf16 calls alike)."""
    return cfg if cfg.dtype == dtype else dataclasses.replace(cfg, dtype=dtype)


def iterations(cfg: KernelCfg, n: int, k: int) -> tuple[int, int, int]:
    """(tiles, column blocks per tile, total stream-K iterations) of a problem under ``cfg``."""
    tiles = math.ceil(n / cfg.block_n)
    kb = math.ceil(k / cfg.block_k)
    return tiles, kb, tiles * kb


def workspace_floats(cfg: KernelCfg, grid: int) -> int:
    """fp32 partials the stream-K fix-up may need: two slots (first, last tile) per CTA."""
    return grid * 2 * cfg.m_cap * cfg.block_n


# ---- public API -----------------------------------------------------------------------------
@cache
def _warn_fallback() -> None:
    warnings.warn("fdpp: no GPU found (CuPy sees no CUDA device); flat_gemm computes in NumPy "
                  "float32 on the CPU", RuntimeWarning, stacklevel=3)


#: dtype names FP8 E4M3 weight codes may have: uint8 (CuPy, NumPy), ml_dtypes / torch float8_e4m3fn.
W8_DTYPES = ("uint8", "float8_e4m3fn", "torch.uint8", "torch.float8_e4m3fn")


def _check(x: Any, w: Any, bias: Any, out: Any, w_scale: Any = None
           ) -> tuple[str, dict[str, Any], tuple[int, int, int], str, str]:
    """Validate a flat_gemm call: (array kind, views, (M, N, K), x's dtype name, weight format:
    "" for w in x's dtype, "e4m3" for FP8 codes with ``w_scale``)."""
    from fdpp.api import _overlaps, gather_views

    kind, views = gather_views("x", x, {"w": w, "bias": bias, "out": out, "w_scale": w_scale}, required=("w",))
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
    if out is not None:
        ov = views["out"]
        if ov.shape != (m, n):
            raise ValueError(f"out must have shape [M, N] = {(m, n)}, got {ov.shape}")
        if ov.strides != (n, 1) and not (m == 1 and ov.strides[-1] == 1):
            raise ValueError(f"out must be C-contiguous, got element strides {ov.strides}")
        for nm in ("x", "w", "bias", "w_scale"):
            if nm in views and _overlaps(ov, views[nm]):
                raise ValueError(f"out must not overlap {nm}")
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


def flat_gemm(x: Any, w: Any, *, w_scale: Any = None, bias: Any = None, out: Any = None) -> Any:
    """y = x @ w.T (+ bias): a decode-phase linear layer, memory-bound on reading ``w``.

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
        (the bulk-copy kernel) or NumPy.
    bias : array [N], optional
        Added in fp32 before the output is rounded.
    out : array [M, N], optional
        C-contiguous, x's dtype and array type, not overlapping the inputs; written and returned.

    Returns
    -------
    y : array [M, N], x's dtype and array type (fp32 accumulation inside)

    Notes
    -----
    Device arrays need unit stride along K and 16-byte aligned pointers and row strides.
    The kernel (GEMV, flat GEMM on tensor cores, or cuBLAS) comes from :func:`choose`: the tuned
    table of this GPU, else a heuristic. Device calls do no host synchronisation, so they can be
    captured in CUDA graphs after one warm-up call (which compiles the kernel and allocates the
    stream's workspace). NumPy in, NumPy out: on the GPU when CuPy sees one, else computed by
    NumPy in float32 with a one-time RuntimeWarning.
    """
    rkey, ptrs = _probe_key(x, w, bias, w_scale, out)  # ptrs: x, w, bias, w_scale, out (0 for None)
    if rkey is not None:
        rec = _records.get(rkey)
        if rec is not None:
            if rec.pointers_ok(ptrs[:4], ptrs[4]):
                return rec.run(ptrs[:4], out, x)
            # misaligned or overlapping: the full path raises the precise error
    kind, views, (m, n, k), dt, wfmt = _check(x, w, bias, out, w_scale)
    if kind == "numpy":
        return _numpy_call(x, w, bias, out, w_scale)
    from fdpp import registry

    dev = views["x"].device
    plan = choose(m, n, k, registry.device_limits(dev), dt, wfmt=wfmt)
    return _device_call(kind, x, w, bias, out, views, plan, (m, n, k), dt, dev, rkey, w_scale)


def _numpy_call(x: np.ndarray, w: np.ndarray, bias: Any, out: Any, w_scale: Any = None) -> np.ndarray:
    from fdpp.api import gpu_available

    if gpu_available():
        import cupy

        wd = cupy.asarray(w.view(np.uint8) if w_scale is not None else w)
        y = cupy.asnumpy(flat_gemm(cupy.asarray(x), wd, w_scale=None if w_scale is None else cupy.asarray(w_scale),
                                   bias=None if bias is None else cupy.asarray(bias)))
    else:
        _warn_fallback()
        if w_scale is None:
            w32 = np.asarray(w, dtype=np.float32)
        else:  # float32(code) * scale, exactly as the kernel's fp16(code) times the row's scale
            from fdpp.quant import fp8_decode_bits

            w32 = fp8_decode_bits(np.asarray(w).view(np.uint8), "fp8_e4m3") * np.asarray(w_scale, np.float32)[:, None]
        y32 = np.asarray(x, dtype=np.float32) @ w32.T
        if bias is not None:
            y32 += np.asarray(bias, dtype=np.float32)
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
                 w_scale: Any = None) -> Any:
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
    rec = GemmRecord(kind, plan, mnk, dev, views, x.dtype)
    if rkey is not None:
        if len(_records) >= _RECORDS_MAX:
            _records.clear()
        _records[rkey] = rec
    return rec.run(_plan.pointers(kind, (x, w, bias, w_scale)), out, x)


# ---- launch records -------------------------------------------------------------------------
_records: dict[tuple, GemmRecord] = {}
_RECORDS_MAX = 1024
_TABLE_ENV = None  # the EnvWatch of ENV_TABLE, made on first use
_table_generation = 0  # bumped by write_table: the tables' plans may change


def _record_key(x: Any, w: Any, bias: Any, out: Any, w_scale: Any = None) -> tuple | None:
    """What fixes a device call's launch: array types, shapes, strides, dtypes, devices, the
    forced plan, ``$FDPP_GEMM_TABLE``, ``$FDPP_TUNING_DIR``, the table generation and
    :data:`fdpp.launch.PDL` (None: not a device call)."""
    return _probe_key(x, w, bias, w_scale, out)[0]


def _probe_key(x: Any, w: Any, bias: Any, w_scale: Any, out: Any) -> tuple[tuple | None, tuple[int, ...]]:
    """(:func:`_record_key`, the pointers of x, w, bias, w_scale, out) in one pass over the arrays."""
    global _TABLE_ENV
    from fdpp import api

    kind = api._KINDS.get(type(x))
    if kind is None:
        kind = api._KINDS[type(x)] = api._kind(x)
    if kind != "cupy" and kind != "torch":
        return None, ()
    try:
        sig, ptrs = _plan.probe(kind, (x, w, bias, w_scale, out))
    except AttributeError:  # mixed array types: the full path says which argument
        return None, ()
    if _TABLE_ENV is None:
        from fdpp.launch import EnvWatch

        _TABLE_ENV = EnvWatch(ENV_TABLE)
    return (kind, sig, _forced.get(), _TABLE_ENV(), _plan._TABLES_DIR(), _table_generation, _launch.PDL,
            _launch.L2_PREFETCH_BYTES), ptrs


class GemmRecord:
    """What one flat_gemm call signature launches: the kernel's function, grid, block, shared
    memory and its constant arguments; a call fills in the pointers, allocates ``out`` (unless
    given) and launches on the current stream of its array type. Shapes, strides and dtypes
    were validated when the record was built and are in its key; the pointer checks
    (:meth:`pointers_ok`) run on every call."""

    def __init__(self, kind: str, plan: GemmPlan, mnk: tuple[int, int, int], dev: int, views: dict[str, Any],
                 dtype: Any):
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
                     i32(prefetch))
        # the driver launchers read the arguments by address from one struct of fields
        self.args = np.zeros(1, dtype=GEMM_ARGS)
        for name, v in zip(GEMM_ARGS.names[7:], self.tail, strict=True):
            self.args[name] = v
        self._args_buf = memoryview(self.args).cast("B")
        self.call = launch.KernelCall(cfg, self.grid, dev, self.args, fields=True, fn=self.fn, pdl=pdl)
        self.spans = tuple(views[nm].nbytes_span if nm in views else 0 for nm in ("x", "w", "bias", "w_scale"))
        self.out_span = m * n * xv.itemsize
        self._stream = launch.current_stream_fn(kind, dev)
        self._ws_args: dict[int, tuple] = {}  # stream -> (its partials, pointer args, its tickets entry)
        if kind == "torch":
            import torch

            self._empty, self._tdev = torch.empty, torch.device("cuda", dev)
        else:
            import cupy

            self._empty, self._getdev, self._cp_device = cupy.empty, cupy.cuda.runtime.getDevice, cupy.cuda.Device
            nbytes = m * n * np.dtype(dtype).itemsize
            self._reuse = _plan._Reuse(self._cupy_alloc) if _plan.REUSE_OUTPUTS and nbytes <= _plan.REUSE_MAX_BYTES \
                else None

    def pointers_ok(self, ptrs: tuple[int, ...], out_ptr: int) -> bool:
        """x and w 16-byte aligned; ``out`` overlapping none of x, w, bias, w_scale."""
        if ptrs[0] % 16 or ptrs[1] % 16:
            return False
        if out_ptr:
            end = out_ptr + self.out_span
            for p, span in zip(ptrs, self.spans, strict=True):
                if span and p < end and out_ptr < p + span:
                    return False
        return True

    def run(self, ptrs: tuple[int, int, int, int], out: Any, x: Any = None) -> Any:
        """Launch with ``ptrs`` = (x, w, bias or 0, w_scale or 0); return ``out`` (allocated unless given; torch:
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
            part = _ws.partials(self.device, sptr, self.ws_floats)
            p1 = _ws.tickets(self.device, stream, self.tiles)
            p0 = part.data.ptr
            ws_args = self._ws_args[sptr] = (part, np.uint64(p0), np.uint64(p1), p0, p1, _ws._tickets[key])
        if _launch.LAUNCHER != "cupy":
            _PACK_GEMM_PTRS(self._args_buf, 0, ptrs[0], ptrs[1], ptrs[2], out_ptr, ws_args[3], ws_args[4], ptrs[3])
            self.call(stream)
            return
        u64 = np.uint64
        self.fn(self.grid, self.block, (u64(ptrs[0]), u64(ptrs[1]), u64(ptrs[2]), u64(out_ptr), ws_args[1],
                                        ws_args[2], u64(ptrs[3]), *self.tail), shared_mem=self.smem, stream=stream)


#: flat_gemm's kernel arguments, in order (``kernels_cu/flat_gemm.cu``: x, w, bias, y, ws, counters,
#: w_scale, ldx, ldw, ldy, M, N, K, kb_per_tile, total_iters, grid, prefetch), as one struct of
#: fields for the launchers that pass arguments by address.
GEMM_ARGS = np.dtype({"names": ["x", "w", "bias", "y", "ws", "counters", "w_scale", "ldx", "ldw", "ldy", "m", "n",
                                "k", "kb_per_tile", "total_iters", "grid", "prefetch"],
                      "formats": [np.uint64] * 7 + [np.int64] * 3 + [np.int32] * 7}, align=True)
_PACK_GEMM_PTRS = struct.Struct("=7Q").pack_into


__all__ = [
    "FlatGemmConfig", "GemvConfig", "GemmPlan", "GemmTable", "choose", "compile_space", "flat_gemm",
    "forced_plan", "heuristic_plan", "read_table", "write_table", "SM80", "SM90",
]
