"""Flat GEMM's kernel configs, search space, plans and heuristic (plain Python: CI checks them without a GPU).

The GEMM op's counterpart of :mod:`fdpp.configs`: :class:`FlatGemmConfig` (tensor-core kernel,
cp.async), :class:`FlatTmaConfig` (bulk-copy kernel, sm_90) and :class:`GemvConfig` (CUDA-core
kernel), whose fields are the template parameters of ``kernels_cu/flat_gemm.cu``; names and keys
are derived; ``check(device)`` decides validity before compiling; :func:`compile_space` is every
variant CI compiles; :class:`GemmPlan` is what one call launches; :func:`heuristic_plan` serves
shapes no tuned entry covers. Tables, dispatch and the public call are :mod:`fdpp.gemm`.

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

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from fdpp.configs import SM90, DeviceLimits
from fdpp.dtypes import DTYPES, get_dtype

GEMM_DTYPES = ("fp16", "bf16")
MAX_M = 64
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SOURCE = "flat_gemm.cu"


def _ceil_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def _r16(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


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

    def static_smem_bytes(self) -> int:
        """Static shared memory of the kernel, an upper bound (each ``__shared__`` array rounded up to
        16 bytes): s_last (2 ints), s_bias (BLOCK_N floats), the RMSNorm prologue's slice sums (M_CAP x
        warps floats) and the variant's own (:meth:`_extra_static`). CI compares it with ptxas."""
        return (_r16(8) + _r16(4 * self.block_n) + _r16(4 * self.m_cap * self.num_warps)  # type: ignore[attr-defined]
                + self._extra_static())

    def _extra_static(self) -> int:
        return 0

    def _smem_check(self, device: DeviceLimits) -> str | None:
        total = self.smem_bytes() + self.static_smem_bytes()  # type: ignore[attr-defined]
        if total > device.smem_per_block:
            return f"needs {total} B of shared memory > {device.smem_per_block} on {device.arch}"
        return None

    def _shared_check(self) -> str | None:
        """The rules every variant shares: a 16-bit dtype, a power-of-two warp count."""
        if self.dtype not in GEMM_DTYPES:  # type: ignore[attr-defined]
            return f"dtype {self.dtype!r} not in {GEMM_DTYPES}"  # type: ignore[attr-defined]
        if self.num_warps not in (1, 2, 4, 8, 16):  # type: ignore[attr-defined]
            return f"num_warps {self.num_warps} not a power of two in 1..16"  # type: ignore[attr-defined]
        return None


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
        if why := self._shared_check():
            return why
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
        if why := self._smem_check(device):
            return why
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

    def _extra_static(self) -> int:  # the stages' mbarriers, s_scale (W8: a float per row, else one)
        return _r16(8 * self.num_stages) + _r16(4 * (self.block_n if self.w8 else 1))

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
        if why := self._shared_check():
            return why
        if self.w8 not in (0, 1):
            return f"w8 {self.w8} not 0 or 1"
        if self.w8 and self.dtype != "fp16":
            return f"FP8 weights (w8) take fp16 activations, not {self.dtype}"
        if device.cc < (9, 0):
            return f"bulk copies need sm_90 or newer, not {device.arch}"
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
        if why := self._smem_check(device):
            return why
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
        if why := self._shared_check():
            return why
        if not 1 <= self.rows <= 8 or not 1 <= self.unroll <= 8:
            return "rows and unroll must be in 1..8"
        if self.m_max not in GEMV_M:
            return f"m_max {self.m_max} not in {GEMV_M}"
        if self.l2_prefetch not in (0, 256):
            return f"l2_prefetch {self.l2_prefetch} not 0 or 256"
        if why := self._smem_check(device):
            return why
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

    family: ClassVar[str] = "gemm"  # fdpp.dispatch.forced_plan's key

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


def _plan_wfmt(plan: GemmPlan) -> str:
    return "e4m3" if getattr(plan.config, "w8", 0) else ""


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
