"""Problems, kernel configurations, validity rules, the search space and the split heuristic.

Everything here is plain Python (no CuPy), so CI checks it on a CPU-only machine. A config's
fields mirror the template parameters of ``kernels_cu/decode_split.cu`` and
``kernels_cu/decode_combine.cu``; the template instantiation string and the variant key are
derived from the fields, never typed by hand.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from fdpp.dtypes import DTYPES, ELEMENT_TYPES, INT4_FORMATS, KV_FORMATS, get_dtype, is_quantized, kv_row_bytes
from fdpp.launch import ParamStruct

HEAD_DIMS = (64, 96, 128, 256)
PAGE_SIZES = tuple(1 << i for i in range(9))  # 1 .. 256; 0 means a contiguous cache
MAX_SPLITS = 1024
MIN_CHUNK = 64  # tokens; chunks shorter than this cost more in partials than they gain


@dataclass(frozen=True)
class DeviceLimits:
    """What the validity rules and the heuristic need to know about a GPU."""

    name: str
    cc: tuple[int, int]
    sm_count: int
    smem_per_block: int  # opt-in maximum of dynamic + static shared memory per block, bytes
    regs_per_sm: int = 65536
    max_threads_per_sm: int = 2048

    @property
    def arch(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"


# Reference devices for offline (CPU-only) checks; at run time the registry reads the real ones.
SM80 = DeviceLimits("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912)
SM90 = DeviceLimits("NVIDIA H200", (9, 0), 132, 232448)
#: The H100 SXM's limits (sm_90 as the H200's, its own table: tuning/NVIDIA_H100_80GB_HBM3.json).
H100 = DeviceLimits("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448)


@dataclass(frozen=True)
class DecodeProblem:
    """One decode-attention call shape: q [batch, num_q_heads, head_dim] over KV of seqlen tokens.

    ``kv_dtype`` is the K/V element type ("" means q's ``dtype``), or a quantised format of
    :data:`fdpp.dtypes.KV_FORMATS` ("fp8_e4m3", "fp8_e5m2") or :data:`fdpp.dtypes.INT4_FORMATS`
    (INT4 with its group size: "int4_g32", "int4_g64", "int4_g128"); ``page_size`` 0 is a contiguous
    cache, else a paged one with pages of that many tokens (``seqlen`` is then the tokens a
    request's block-table row can address: pages per row x page_size).
    """

    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    seqlen: int  # N_max, the KV cache capacity per request
    dtype: str = "fp16"
    kv_dtype: str = ""
    page_size: int = 0

    def __post_init__(self) -> None:
        if not self.kv_dtype:
            object.__setattr__(self, "kv_dtype", self.dtype)

    @property
    def ratio(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def quantized(self) -> bool:
        return is_quantized(self.kv_dtype)

    def kv_bytes(self) -> int:
        """Bytes of K and V that one call must read when every request uses the whole cache
        (FP8: the codes and the float32 K and V descales of every (request, KV head); INT4: the
        packed codes and every row's fp16 scales and zeros)."""
        rows = 2 * self.batch * self.seqlen * self.num_kv_heads
        return rows * kv_row_bytes(self.kv_dtype, self.head_dim) + (
            8 * self.batch * self.num_kv_heads if self.kv_dtype in KV_FORMATS else 0)


def cache_parts(dtype: str, kv_dtype: str, page_size: int) -> list[str]:
    """Key parts naming the cache where it differs from the default (K/V in q's dtype, contiguous):
    ``kv<tag>`` for another K/V type, ``p<page_size>`` for a paged cache. Shared by variant keys
    and bucket keys, so a contiguous same-dtype key reads as it did before paging existed."""
    parts = []
    if kv_dtype and kv_dtype != dtype:
        f = KV_FORMATS.get(kv_dtype)
        parts.append(f"kv{f.tag if f else ELEMENT_TYPES[kv_dtype].tag}")  # INT4: kvi4g64
    if page_size:
        parts.append(f"p{page_size}")
    return parts


#: The decode family's kernel argument (``fdpp::DecodeParams`` in kernels_cu/kv_cache.cuh).
DECODE_PARAMS = ParamStruct("fdpp::DecodeParams", [
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("seqlens", "ptr"), ("block_table", "ptr"),
    ("k_descale", "ptr"), ("v_descale", "ptr"), ("k_zero", "ptr"), ("v_zero", "ptr"),
    ("out", "ptr"), ("lse", "ptr"), ("o_part", "ptr"), ("lse_part", "ptr"), ("counters", "ptr"),
    ("q_sb", "i64"), ("q_sh", "i64"), ("k_sb", "i64"), ("k_sn", "i64"), ("k_sh", "i64"),
    ("v_sb", "i64"), ("v_sn", "i64"), ("v_sh", "i64"), ("bt_sb", "i64"),
    ("kd_sb", "i64"), ("kd_sh", "i64"), ("vd_sb", "i64"), ("vd_sh", "i64"),
    ("kd_sn", "i64"), ("vd_sn", "i64"),
    ("kz_sb", "i64"), ("kz_sn", "i64"), ("kz_sh", "i64"), ("vz_sb", "i64"), ("vz_sn", "i64"), ("vz_sh", "i64"),
    ("n_max", "i32"), ("num_pages", "i32"), ("num_q_heads", "i32"), ("ratio", "i32"),
    ("chunk", "i32"), ("num_splits", "i32"), ("bucket", "i32"), ("scale_log2", "f32"),
    ("k_scale", "f32"), ("v_scale", "f32"), ("umax2", "f32"), ("l2_prefetch", "i32"),
])


def group_size_for(ratio: int) -> int:
    """Query heads per CTA: the largest divisor of the GQA ratio that is at most 8."""
    return max(g for g in range(1, min(ratio, 8) + 1) if ratio % g == 0)


@dataclass(frozen=True)
class DecodeConfig:
    """Compile-time parameters of ``decode_split`` (or ``decode_nosplit``, where group_size is 1).

    ``kv_dtype`` ("" = ``dtype``) and ``page_size`` (0 = contiguous) pick the KV-type and
    cache-access policies; they come from the problem, the others are tuned.
    """

    dtype: str
    head_dim: int
    group_size: int = 1
    num_warps: int = 4
    num_stages: int = 2
    unroll: int = 2
    kernel: str = "decode_split"
    mma: bool = False  # tensor-core phase 1 (decode_split_mma; fp16/bf16, head_dim 64/128/256)
    kv_dtype: str = ""
    page_size: int = 0
    cluster: int = 1  # > 1: decode_split_mma_cluster, that many splits merged in one thread-block cluster
    umax: bool = False  # softmax_mode "unified_max": the *_umax twin of a tensor-core kernel (head dim <= 128)

    def __post_init__(self) -> None:
        if not self.kv_dtype:
            object.__setattr__(self, "kv_dtype", self.dtype)

    # ---- derived layout (mirrors RowLayout in decode_split.cu)
    @property
    def vec(self) -> int:
        return 16 // ELEMENT_TYPES[self.kv_dtype].itemsize

    @property
    def nv(self) -> int:
        return max(1, math.ceil(self.head_dim // self.vec / 32))

    @property
    def tpr(self) -> int:
        return 1 << max(0, math.ceil(math.log2(math.ceil(self.head_dim // self.vec / self.nv))))

    @property
    def threads(self) -> int:
        return self.num_warps * 32

    @property
    def tile_tokens(self) -> int:
        """Tokens a CTA reads per pipeline stage."""
        if self.mma:
            return self.num_warps * 16 * self.unroll
        return self.threads // self.tpr * self.unroll

    def smem_bytes(self) -> int:
        """Dynamic shared memory of one CTA: the cp.async stages, or the final merge if larger."""
        if self.mma:
            row = self.head_dim * ELEMENT_TYPES[self.kv_dtype].itemsize  # bytes; 8-bit V rows padded by 16
            extra = 16 if row < 2 * self.head_dim else 0
            i4 = INT4_FORMATS.get(self.kv_dtype)
            if i4 is not None:  # code pairs; each row's 4 parameter rows of SLOTS words (decode_split.cu)
                row //= 2
                groups = self.head_dim // i4.group_size
                extra += 16 * (2 if groups == 1 else groups // 2)
            pipeline = self.num_stages * self.tile_tokens * (2 * row + extra)
        else:
            pipeline = self.num_stages * self.unroll * 2 * self.nv * self.threads * 16
        # the per-warp states (and, merged in a cluster, the CTA's own state after them)
        merge = (self.num_warps + (self.cluster > 1)) * self.group_size * (self.head_dim + 2) * 4
        fused = self.threads * 6 * 4  # the fused merge's per-thread states (kernels_cu/merge.cuh)
        role = 16  # the fused merge's role word, past both merge areas (merge.cuh, FusedRole)
        return max(pipeline, max(merge, fused) + role)

    def estimated_registers(self) -> int:
        """Estimate of registers per thread, calibrated on ptxas reports (tests/test_compile.py
        checks that every config under the limit compiles without spills)."""
        paged = 8 if self.page_size else 0  # page indices of the next tile, pool strides
        if self.mma:  # O fragments (4 per 8 columns), Q fragments, loader and softmax state
            nt = self.head_dim // 8
            if self.page_size:  # block-table entries held for the next tile, their checked copies, row pointers
                paged = 16 + 8 * self.mma_page_runs
            kv8 = self.head_dim // 8 if ELEMENT_TYPES[self.kv_dtype].itemsize == 1 else 0  # K/V words held
            if self.kv_dtype in INT4_FORMATS:  # the loader's parameter-row pointers and strides
                kv8 += 12 if self.head_dim == 64 else 6
            return 4 * nt + self.head_dim // 8 + 24 * self.unroll + 40 + paged + kv8
        e = self.nv * self.vec
        return 2 * self.group_size * e + self.unroll * self.group_size + e + 48 + paged

    @property
    def mma_page_runs(self) -> int:
        """Block-table entries one loader thread reads per tile in decode_split_mma (NLOC there):
        its LROWS consecutive rows, RUN = min(page_size, LROWS) of them per page (pages >= 2)."""
        lrows = self.tile_tokens // max(1, self.threads // (self.head_dim // 8))
        run = min(self.page_size, lrows) if self.page_size >= 2 else 1
        return max(1, lrows // run)

    # ---- names (derived from the fields; C++ template parameters in the same order)
    @property
    def cache_type(self) -> str:
        return f"fdpp::PagedCache<{self.page_size}>" if self.page_size else "fdpp::Contiguous"

    def template_args(self) -> str:
        shape = [self.head_dim] + ([] if self.kernel == "decode_nosplit" else [self.group_size])
        shape += [self.num_warps, self.num_stages, self.unroll] + ([self.cluster] if self.cluster > 1 else [])
        types = [DTYPES[self.dtype].ctype, ELEMENT_TYPES[self.kv_dtype].ctype, self.cache_type]
        return ",".join(types + [str(x) for x in shape])

    @property
    def function(self) -> str:
        twin = "_umax" if self.umax else ""
        if self.cluster > 1:
            return "decode_split_mma_cluster" + twin
        return "decode_split_mma" + twin if self.mma else self.kernel

    def name_expression(self) -> str:
        return f"fdpp::{self.function}<{self.template_args()}>"

    @property
    def key(self) -> str:
        parts = [self.function, DTYPES[self.dtype].tag, *cache_parts(self.dtype, self.kv_dtype, self.page_size),
                 f"d{self.head_dim}", f"g{self.group_size}", f"w{self.num_warps}", f"s{self.num_stages}",
                 f"u{self.unroll}"] + ([f"c{self.cluster}"] if self.cluster > 1 else [])
        return ".".join(parts)

    @property
    def source(self) -> str:
        return "decode_split.cu"

    def grid(self, problem: DecodeProblem, splits: int) -> tuple[int, int, int]:
        if self.kernel == "decode_nosplit":
            return (1, problem.num_q_heads, problem.batch)
        if self.cluster > 1:  # one cluster per (request, KV-head group), whatever the length
            return (self.cluster, problem.num_q_heads // self.group_size, problem.batch)
        return (splits, problem.num_q_heads // self.group_size, problem.batch)

    # ---- validity
    def check(self, device: DeviceLimits = SM90) -> str | None:
        """Return why this config cannot run on ``device``, or None when it is valid."""
        if self.dtype not in DTYPES or self.kv_dtype not in ELEMENT_TYPES:
            return f"dtype {self.dtype!r} / kv_dtype {self.kv_dtype!r} unknown"
        if self.kv_dtype != self.dtype:
            if (self.dtype, self.kv_dtype) not in KV_COMBOS:
                return f"K/V of {self.kv_dtype} with q of {self.dtype}: no such KV-type policy"
            if self.head_dim not in QUANT_HEAD_DIMS:
                return f"quantised K/V take head_dim {QUANT_HEAD_DIMS}, not {self.head_dim}"
            if self.kernel == "decode_nosplit":
                return "decode_nosplit (the baseline) reads unquantised caches only"
            if self.kv_dtype in INT4_FORMATS:
                if not self.mma:
                    return "INT4 K/V are read by the tensor-core path (mma) only"
                if INT4_FORMATS[self.kv_dtype].group_size > self.head_dim:
                    return f"INT4 group {INT4_FORMATS[self.kv_dtype].group_size} > head_dim {self.head_dim}"
        if self.page_size and self.page_size not in PAGE_SIZES:
            return f"page_size {self.page_size} is not a power of two in 1..256"
        if self.mma:
            if self.dtype not in MMA_DTYPES:
                return f"the tensor-core path takes {MMA_DTYPES}, not {self.dtype}"
            if self.head_dim % 64:
                return f"the tensor-core path takes head_dim 64, 128 or 256, not {self.head_dim}"
            if self.num_stages < 2:
                return "the tensor-core path pipelines at least 2 stages"
            if self.kernel != "decode_split":
                return "only decode_split has a tensor-core variant"
        if self.umax and not self.mma:
            return "the unified-max softmax (umax) is a tensor-core (mma) variant"
        if self.umax and self.head_dim > 128:
            return "the unified-max softmax (umax) takes head_dim 64 or 128 (256: the registers are full)"
        if self.cluster != 1:
            if not 2 <= self.cluster <= MAX_CLUSTER:
                return f"cluster {self.cluster} outside 2..{MAX_CLUSTER}"
            if device.cc[0] < 9:
                return f"thread-block clusters need sm_90 or newer, not {device.arch}"
            if not self.mma or self.kernel != "decode_split":
                return "the cluster merge is a tensor-core (mma) decode_split variant"
        if self.kv_dtype not in INT4_FORMATS and self.head_dim % self.vec:
            return f"head_dim {self.head_dim} is not a multiple of the 16-byte vector ({self.vec})"
        if self.tpr > 32:
            return f"a row needs {self.tpr} threads (> one warp)"
        if self.kernel == "decode_nosplit" and self.group_size != 1:
            return "decode_nosplit serves one query head per CTA"
        if not 1 <= self.group_size <= 8:
            return f"group_size {self.group_size} outside 1..8"
        if self.num_warps not in (1, 2, 4, 8, 16):
            return f"num_warps {self.num_warps} not a power of two in 1..16"
        if not 1 <= self.num_stages <= 8 or self.unroll < 1:
            return "num_stages must be in 1..8 and unroll >= 1"
        if self.smem_bytes() > device.smem_per_block:
            return (f"needs {self.smem_bytes()} B of shared memory > "
                    f"{device.smem_per_block} on {device.arch}")
        if self.estimated_registers() > 255:
            return f"needs about {self.estimated_registers()} registers per thread (> 255)"
        if (self.mma and device.cc[0] < 9 and self.num_stages >= 4 and self.unroll >= 2
                and self.estimated_registers() > 128):
            # seen with NVRTC 13.0 and 13.5: ptxas holds these sm_80 variants to 128 registers and
            # spills (a paged d64 w4 s4 u2 variant: 128 registers, 12-16 B of stack)
            return (f"on {device.arch} a 4-stage, unroll-2 tensor-core variant is held to 128 registers "
                    f"and this one needs about {self.estimated_registers()}")
        return None

    def is_valid(self, device: DeviceLimits = SM90) -> bool:
        return self.check(device) is None


@dataclass(frozen=True)
class CombineConfig:
    """Compile-time parameters of ``decode_combine``."""

    dtype: str
    head_dim: int
    num_warps: int = 4
    slices: int = 1  # CTAs per (request, query head) row, each merging head_dim / slices columns

    def name_expression(self) -> str:
        return (f"fdpp::decode_combine<{DTYPES[self.dtype].ctype},{self.head_dim},{self.num_warps},"
                f"{self.slices}>")

    @property
    def key(self) -> str:
        tail = f".s{self.slices}" if self.slices != 1 else ""
        return f"decode_combine.{DTYPES[self.dtype].tag}.d{self.head_dim}.w{self.num_warps}{tail}"

    @property
    def source(self) -> str:
        return "decode_combine.cu"

    @property
    def threads(self) -> int:
        return self.num_warps * 32

    def grid(self, problem: DecodeProblem, splits: int) -> tuple[int, int, int]:
        return (problem.batch * problem.num_q_heads, self.slices, 1)

    def smem_bytes(self) -> int:
        return 0  # static only

    def check(self, device: DeviceLimits = SM90) -> str | None:
        if self.head_dim % 4:
            return f"head_dim {self.head_dim} not a multiple of 4"
        if self.num_warps not in (1, 2, 4, 8):
            return f"num_warps {self.num_warps} not in 1, 2, 4, 8"
        if self.slices not in COMBINE_SLICES or self.head_dim % (4 * self.slices):
            return f"slices {self.slices} does not split head_dim {self.head_dim} into float4 columns"
        return None

    def is_valid(self, device: DeviceLimits = SM90) -> bool:
        return self.check(device) is None


@dataclass(frozen=True)
class LaunchPlan:
    """What one call launches: a sequence of kernel configs, run in order on one stream, all
    taking the same DecodeParams, and the split count they share.

    - two-launch split-KV: (phase 1, combine); with one split the combine is dropped
      (:meth:`launches`);
    - fused (``fused=True``): phase 1 alone; the last CTA of each (request, KV-head group) to
      finish merges the group's partials in the same launch (self-resetting tickets), in
      first-level buckets of ``bucket`` splits when that is > 0 and < the split count
      (:func:`merge_bucket` picks it when 0);
    - cluster (phase 1 with ``cluster`` > 1, sm_90): phase 1 alone, ``cluster`` splits whatever the
      length, merged through distributed shared memory inside one thread-block cluster per
      (request, KV-head group): no partials in global memory, no tickets.
    A fast path with a fallback would be another sequence.
    """

    kernels: tuple[DecodeConfig | CombineConfig, ...]
    num_splits: int
    source: str = field(default="heuristic", compare=False)  # "heuristic" | "table" | "user" | …
    fused: bool = False
    bucket: int = 0
    fixed_chunk: int = 0  # tokens per split whatever the seqlen (batch-invariant plans); 0: derived

    @classmethod
    def cluster_merge(cls, split: DecodeConfig, num_splits: int, source: str = "heuristic") -> LaunchPlan:
        """Phase 1 as a cluster of ``num_splits`` CTAs (:data:`CLUSTER_SIZES`) per (request, KV-head
        group), merged in the cluster."""
        return cls.split_kv(replace(split, cluster=int(num_splits)), int(num_splits), source=source)

    @classmethod
    def split_kv(cls, split: DecodeConfig, num_splits: int, combine: CombineConfig | None = None,
                 source: str = "heuristic", *, fused: bool = False, bucket: int = 0) -> LaunchPlan:
        """Phase 1 with ``num_splits`` splits, then ``combine`` (default config) to merge them, or
        (``fused``) merged inside phase 1; no merge for one split. A cluster variant of phase 1
        (``split.cluster`` > 1) takes its own split count and merges in its cluster."""
        if split.cluster > 1:
            return cls((split,), split.cluster, source)
        if num_splits == 1:
            return cls((split,), 1, source)
        if fused:
            return cls((split,), num_splits, source, fused=True, bucket=int(bucket))
        if combine is None:
            combine = combine_config(split.dtype, split.head_dim)
        return cls((split, combine), num_splits, source)

    @property
    def split(self) -> DecodeConfig:
        """The attention kernel (the first launch)."""
        return self.kernels[0]  # type: ignore[return-value]

    def unified_max(self) -> LaunchPlan:
        """This plan with its phase 1 replaced by the unified-max twin (``DecodeConfig.umax``) where
        one exists (tensor cores, head dim <= 128), else the plan itself (exact softmax)."""
        s = self.split
        if s.umax or not s.mma or s.head_dim > 128:
            return self
        return replace(self, kernels=(replace(s, umax=True), *self.kernels[1:]))

    @property
    def combine(self) -> CombineConfig | None:
        """The merge kernel, if the plan has one."""
        return self.kernels[1] if len(self.kernels) > 1 else None  # type: ignore[return-value]

    @property
    def page_size(self) -> int:
        return self.split.page_size

    @property
    def mode(self) -> str:
        """"fused", "cluster", "two-launch" or "single" (one split: no merge at all)."""
        if self.split.cluster > 1:
            return "cluster"
        return "fused" if self.fused else ("two-launch" if self.combine is not None else "single")

    def chunk(self, seqlen: int) -> int:
        """Tokens per split: ceil(seqlen / num_splits), rounded up to whole pages when paged."""
        c = self.fixed_chunk or max(1, math.ceil(seqlen / self.num_splits))
        p = self.page_size
        return -(-c // p) * p if p else c

    def effective_splits(self, seqlen: int) -> int:
        """Splits actually launched: ceil(seqlen / chunk) (<= num_splits; 1 for an empty cache); a
        cluster plan launches its whole cluster (trailing splits past the cache are empty)."""
        if self.split.cluster > 1:
            return self.split.cluster
        return max(1, math.ceil(seqlen / self.chunk(seqlen)))

    def launches(self, seqlen: int) -> tuple[DecodeConfig | CombineConfig, ...]:
        """The kernels run at ``seqlen``: a merge is skipped when only one split runs."""
        if self.effective_splits(seqlen) == 1 and isinstance(self.combine, CombineConfig):
            return self.kernels[:1]
        return self.kernels

    def merge_bucket(self, seqlen: int) -> int:
        """Fused plans: splits per first-level merge bucket at ``seqlen`` (>= splits: one level)."""
        s = self.effective_splits(seqlen)
        return merge_bucket(s) if self.bucket <= 0 else min(self.bucket, s)

    def counter_words(self, problem: DecodeProblem, seqlen: int) -> int:
        """Fused plans: the uint32 tickets a launch uses (0 when nothing is merged in-kernel)."""
        s = self.effective_splits(seqlen)
        if not self.fused or s == 1:
            return 0
        nb = -(-s // self.merge_bucket(seqlen))
        cohorts = problem.batch * (problem.num_q_heads // self.split.group_size)
        return cohorts * (nb + 1 if nb > 1 else 1)


#: ``num_splits`` stand-in of a batch-invariant call (``batch_invariant=True``), and its split size.
BATCH_INVARIANT = "batch_invariant"
BATCH_INVARIANT_CHUNK = 1024


def batch_invariant_plan(problem: DecodeProblem, device: DeviceLimits = SM90) -> LaunchPlan:
    """A plan whose result for a request depends on nothing but that request: splits of a fixed
    ``BATCH_INVARIANT_CHUNK`` tokens (whole pages), the phase-1 kernel the heuristic takes for a
    split sequence whatever the batch, and a one-level fused merge (fixed order; empty splits
    add exact zeros). So a request gives bitwise the same output alone or inside any batch, at
    any position, and for any N_max of the cache."""
    cfg = default_kernel(problem, device, split=True)
    return LaunchPlan((cfg,), MAX_SPLITS, "batch-invariant", fused=True, bucket=1 << 30,
                      fixed_chunk=BATCH_INVARIANT_CHUNK)


def merge_bucket(splits: int) -> int:
    """The fused merge's default first-level bucket: every split in one level up to 16 splits,
    else about sqrt(splits) (two short merges instead of one long one: the last CTA of a
    few-KV-head problem would otherwise merge 100+ partials alone)."""
    return splits if splits <= 16 else math.ceil(math.sqrt(splits))


# ---- search space ---------------------------------------------------------------------------
MMA_DTYPES = ("fp16", "bf16")
#: Split counts of the cluster merge (decode_split_mma_cluster): one thread-block cluster of that many
#: CTAs per (request, KV-head group); 16 is the H100 / H200 non-portable maximum (opted in at load).
CLUSTER_SIZES = (2, 4, 8, 16)
#: Largest cluster a variant may take (any size 2..16 compiles and runs; the tuner searches
#: CLUSTER_SIZES, probes may force others).
MAX_CLUSTER = 16
# A cluster variant takes the shared memory its pipeline needs, so two of its CTAs may share an SM.
# Reserving a whole SM per CTA (more than half of the 228 KB) was slower wherever a launch holds
# several clusters (on the H200, 8 clusters of 16 for llama3-8b at N = 64k ran 92.7 us against
# 72.7; with one CTA per SM not every GPC holds a cluster of 16 at once) and 1-3 % faster with one
# cluster (llama3-70b TP-8 heads, B = 1). A development experiment of 2026-12-02; its logs were
# lost with that session's machine, so the figures are as noted then.


def cluster_within(num_splits: int) -> int:
    """The largest of :data:`CLUSTER_SIZES` not above ``num_splits`` (1: none fits, no cluster)."""
    return max((c for c in CLUSTER_SIZES if c <= num_splits), default=1)


#: (q dtype, K/V element type) pairs the kernels read: unquantised caches in q's type, FP8 codes
#: under fp16/bf16 q (tensor cores; the CUDA-core path reads them too), INT4 code pairs under
#: fp16/bf16 q (tensor cores only; each group size of D 64 / 128 that fits: ``kv_combos``).
KV_COMBOS = (tuple((dt, dt) for dt in DTYPES) + tuple((dt, f) for dt in MMA_DTYPES for f in KV_FORMATS)
             + tuple((dt, f) for dt in MMA_DTYPES for f in INT4_FORMATS))
QUANT_HEAD_DIMS = (64, 128)  # d256: the FP8 tensor-core variant spills (255 registers, ptxas)
SPACE = {  # CUDA-core decode_split (every dtype and head_dim)
    "num_warps": (4, 8),
    "num_stages": (2, 3),
    "unroll": (2, 4),
}
MMA_SPACE = {  # tensor-core decode_split_mma (fp16/bf16, head_dim 64/128/256)
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
    "unroll": (1, 2),
}
GROUP_SIZES = tuple(range(1, 9))


def mma_supported(dtype: str, head_dim: int) -> bool:
    return dtype in MMA_DTYPES and head_dim % 64 == 0


def kernel_space(dtype: str, head_dim: int, group_size: int, page_size: int = 0,
                 kv_dtype: str = "") -> list[DecodeConfig]:
    """Phase-1 variants the tuner may pick for one (dtype, head_dim, group_size, cache, K/V type),
    valid or not."""
    kw = {"page_size": page_size, "kv_dtype": kv_dtype}
    out = [DecodeConfig(dtype, head_dim, group_size, w, s, u, **kw) for w, s, u in itertools.product(*SPACE.values())]
    if mma_supported(dtype, head_dim):
        out += [DecodeConfig(dtype, head_dim, group_size, w, s, u, mma=True, **kw)
                for w, s, u in itertools.product(*MMA_SPACE.values())]
    return out


def compile_space(dtype: str, head_dim: int, page_size: int = 0, kv_dtype: str = "") -> list[DecodeConfig]:
    """Every phase-1 variant of the tuning space for one dtype, head_dim, cache and K/V type (any
    group size)."""
    return [c for g in GROUP_SIZES for c in kernel_space(dtype, head_dim, g, page_size, kv_dtype)]


def nosplit_config(dtype: str, head_dim: int, page_size: int = 0) -> DecodeConfig:
    return DecodeConfig(dtype, head_dim, 1, 4, 2, 2, kernel="decode_nosplit", page_size=page_size)


def kv_combos(head_dim: int) -> tuple[tuple[str, str], ...]:
    """The (q dtype, kernel K/V type) pairs that read caches of ``head_dim``."""
    return tuple(c for c in KV_COMBOS if c[0] == c[1] or (
        head_dim in QUANT_HEAD_DIMS and (c[1] not in INT4_FORMATS or INT4_FORMATS[c[1]].group_size <= head_dim)))


COMBINE_SLICES = (1, 2, 4, 8)


def combine_config(dtype: str, head_dim: int, rows: int = 0, device: DeviceLimits | None = None) -> CombineConfig:
    """The heuristic combine: 4 warps; with few rows (batch x query heads, when given) the head
    dim is sliced over up to 8 CTAs per row so that the merge uses about one SM per CTA."""
    slices = 1
    if rows:
        sms = (device or SM90).sm_count
        for s in COMBINE_SLICES:
            if rows * s <= sms and head_dim % (4 * s) == 0:
                slices = s
    return CombineConfig(dtype, head_dim, 4, slices)


def split_heuristic(problem: DecodeProblem, device: DeviceLimits, ctas_per_sm: int = 1) -> int:
    """Number of KV splits: about ``ctas_per_sm`` CTAs per SM, chunks of >= MIN_CHUNK tokens, no
    split when batch x head-groups already fill half the GPU (FlashAttention-2 / FlashDecoding
    style). One CTA per SM measured best for the tensor-core kernel on the H200 (16 splits for
    llama3-8b at B=1: results/probe_h200_split_sweep.log)."""
    groups = problem.num_q_heads // group_size_for(problem.ratio)
    base = problem.batch * groups
    if base >= device.sm_count * ctas_per_sm // 2:
        return 1
    want = device.sm_count * ctas_per_sm // base  # rounded down: a partial second wave costs a whole one
    most = max(1, problem.seqlen // MIN_CHUNK)
    return int(max(1, min(want, most, MAX_SPLITS)))


#: Longest N_max at which the heuristic merges its splits inside a thread-block cluster (sm_90).
CLUSTER_HEURISTIC_MAX_SEQLEN = 4096
#: The cluster sizes the heuristic takes: 2 where it splits in two, 8 where it splits in 8 or more.
CLUSTER_HEURISTIC_SIZES = (2, 8)
#: Query heads per CTA for which the heuristic takes the cluster merge: those the cluster merge's
#: GPU tests have run with (tests/test_gpu_fused.py: 1, 3, 4 and 8 in run Y1; 2, 5, 6 and 7, GQA
#: ratios such as qwen2.5-7b's 28 / 4, in run Z1).
CLUSTER_HEURISTIC_GROUPS = (1, 2, 3, 4, 5, 6, 7, 8)


def heuristic_cluster(problem: DecodeProblem, device: DeviceLimits, split: DecodeConfig, num_splits: int) -> int:
    """The cluster the heuristic merges ``num_splits`` splits of ``split`` in, or 1 (the fused merge).

    On sm_90 for tensor-core variants over unquantised or FP8 caches at N_max <= 4096: two splits
    merge in a cluster of 2, eight or more in one of 8 (that many splits). Where the tuner searched
    these buckets on the H200 (tuning/NVIDIA_H200.json) the cluster merge won every contiguous and
    paged llama3-8b and llama3-70b TP-8 bucket of 1k and 4k at B = 1 and 8, unquantised and FP8;
    the table's own plans are these at llama3-8b B = 1 4k (8.46 against the fused heuristic's
    9.98 us), B = 8 1k (11.45 against 12.76) and llama3-70b TP-8 B = 8 4k (9.42 against 12.96), and
    on an H100 80GB at llama3-8b B = 1 4k (9.83 against 11.61 us, run Y2). At head configurations
    no table holds (run Z1, an H100: 28 / 4, 16 / 8, 40 / 8, 12 / 2 at 1k-4k) it was 1.1-1.8 x
    faster than the fused merge at B = 1 and 3-21 % at B = 8, but for 12 / 2 at 4k (2 % slower).
    Not taken: INT4 caches
    (the tuner kept two-launch combines at 4k) and 3-7 splits launched (MHA heads at B = 1: the
    tuner kept the fused merge at 4k; paged caches whose chunks of whole pages launch fewer), and
    group sizes outside :data:`CLUSTER_HEURISTIC_GROUPS`. Longer caches keep the fused merge (one
    CTA per SM, more splits)."""
    if (device.cc[0] < 9 or not split.mma or problem.kv_dtype in INT4_FORMATS
            or problem.seqlen > CLUSTER_HEURISTIC_MAX_SEQLEN or split.group_size not in CLUSTER_HEURISTIC_GROUPS):
        return 1
    # the splits launched (paged: chunks of whole pages may launch fewer than asked)
    n = LaunchPlan.split_kv(split, num_splits, fused=True).effective_splits(problem.seqlen)
    size = 2 if n == 2 else 8 if n >= 8 else 1
    if size == 1 or not replace(split, cluster=size).is_valid(device):
        return 1
    return size


def default_config(problem: DecodeProblem, device: DeviceLimits = SM90) -> LaunchPlan:
    """The heuristic plan used where no tuned table entry exists: :func:`split_heuristic`'s split
    count of :func:`default_kernel`, merged in the same launch (fused), or inside a thread-block
    cluster where :func:`heuristic_cluster` says so."""
    splits = split_heuristic(problem, device)
    cfg = default_kernel(problem, device, split=splits > 1)
    if not cfg.is_valid(device):  # pragma: no cover - the defaults are valid for every HEAD_DIM
        raise ValueError(f"default config {cfg.key} invalid: {cfg.check(device)}")
    cluster = heuristic_cluster(problem, device, cfg, splits)
    if cluster > 1:
        return LaunchPlan.cluster_merge(cfg, cluster)
    return LaunchPlan.split_kv(cfg, splits, source="heuristic", fused=True)


def default_kernel(problem: DecodeProblem, device: DeviceLimits = SM90, split: bool = True) -> DecodeConfig:
    """The heuristic's phase-1 variant for ``problem``: the first valid one of a short list.

    Tensor cores where the dtype and head_dim allow. A contiguous cache takes 4 warps, 3 stages.
    A paged one takes 8 warps when the sequence is split (few CTAs: its loader forms a row
    address from a block-table entry per page run, and more warps hide that; on the H200 at
    B=1, N=64k, page 16, 8 warps ran 70.0 us against 80.2 us for 4 warps,
    results/device_run1/probe_plans3.log), 4 when batch x heads already fill the GPU
    (``split=False``: an 8-warp CTA of ~190 registers leaves one CTA per SM, 4 warps two; at
    B=64, N=1k, page 1 the 8-warp variant ran 91.7 us against 65.0 us contiguous,
    results/device_runA2/)."""
    dt = get_dtype(problem.dtype).name
    g = group_size_for(problem.ratio)
    policy = {"kv_dtype": problem.kv_dtype, "page_size": problem.page_size}
    if mma_supported(dt, problem.head_dim):
        shapes = [(8, 3, 1), (8, 2, 1)] if problem.paged and split else []
        shapes += [(4, 3, 1), (4, 2, 1)]
        for w, s, u in shapes:
            cfg = DecodeConfig(dt, problem.head_dim, g, w, s, u, mma=True, **policy)
            if cfg.is_valid(device):
                return cfg
    for w, s, u in ((8, 2, 4), (8, 2, 2), (4, 2, 2), (4, 2, 1)):  # CUDA cores; fewer registers last
        cfg = DecodeConfig(dt, problem.head_dim, g, num_warps=w, num_stages=s, unroll=u, **policy)
        if cfg.is_valid(device):
            return cfg
    return cfg


# ---- compile sets (tests/test_compile.py) ---------------------------------------------------
def template_values(config: DecodeConfig) -> tuple[tuple[str, object], ...]:
    """The (parameter, value) pairs that pick a phase-1 variant's template instantiation: what a
    compile sample must cover."""
    fields = ("kernel", "dtype", "kv_dtype", "head_dim", "group_size", "num_warps", "num_stages", "unroll",
              "mma", "page_size")
    return tuple((f, getattr(config, f)) for f in fields)


def full_compile_space(device: DeviceLimits) -> list[DecodeConfig]:
    """Every valid phase-1 variant on ``device`` the tuner may pick: the tuning space of every
    dtype, K/V type, head_dim and cache (contiguous and every page size), plus each
    decode_nosplit (contiguous unquantised caches: ``decode_attention_nosplit``)."""
    out = []
    for d, p in itertools.product(HEAD_DIMS, (0, *PAGE_SIZES)):
        for dt, kv in kv_combos(d):
            out += [c for c in compile_space(dt, d, p, kv) if c.is_valid(device)]
            if kv == dt and p == 0:
                out += [c for c in (nosplit_config(dt, d),) if c.is_valid(device)]
    return out


def heuristic_variants(device: DeviceLimits) -> list[DecodeConfig | CombineConfig]:
    """Every kernel the heuristic can launch on ``device`` (valid there or not: tests check):
    ``default_kernel`` for every dtype, K/V type, head_dim, cache and GQA ratio 1..64 (group
    sizes 1..8) and its cluster twins (:func:`heuristic_cluster`), ``nosplit_config`` for every
    dtype and head_dim (contiguous caches: the only ones ``decode_attention_nosplit`` takes),
    ``combine_config`` for every dtype, head_dim and slice count."""
    out: dict[str, DecodeConfig | CombineConfig] = {}
    for d, p in itertools.product(HEAD_DIMS, (0, *PAGE_SIZES)):
        for dt, kv in kv_combos(d):
            for ratio in range(1, 65):
                prob = DecodeProblem(1, ratio, 1, d, 4096, dt, kv, page_size=p)
                c = default_kernel(prob, device)
                out.setdefault(c.key, c)
                for n in CLUSTER_HEURISTIC_SIZES:  # the cluster twins heuristic_cluster may take
                    if heuristic_cluster(prob, device, c, n) > 1:
                        twin = replace(c, cluster=n)
                        out.setdefault(twin.key, twin)
            if kv == dt and p == 0:
                out.setdefault(nosplit_config(dt, d).key, nosplit_config(dt, d))
    for dt, d, rows in itertools.product(DTYPES, HEAD_DIMS, (1, 32, 64, 1 << 20)):
        c = combine_config(dt, d, rows, device)
        out.setdefault(c.key, c)
    return list(out.values())


def table_variants(device: DeviceLimits, directory: str | None = None) -> list[DecodeConfig | CombineConfig]:
    """Every kernel named by the decode tables in ``directory`` (default: the shipped ``tuning/``)
    written for a GPU of ``device``'s compute capability, valid or not. Source hashes are not
    checked: an entry a kernel edit made stale is still a variant a re-tune may pick again."""
    import json
    from pathlib import Path

    from fdpp.tables import ATTENTION, Entry, shipped_dir

    out: dict[str, DecodeConfig | CombineConfig] = {}
    for path in sorted((Path(directory) if directory else shipped_dir()).glob("*.json")):
        raw = json.loads(path.read_text())
        dev = raw.get("device")
        if not isinstance(dev, dict) or tuple(dev.get("cc", ())) != tuple(device.cc) \
                or raw.get("op", ATTENTION.name) != ATTENTION.name:
            continue  # another GPU's table, or another op's (flat GEMM)
        for d in raw.get("entries", {}).values():
            for k in Entry.from_json(d, str(path)).plan().kernels:
                out.setdefault(k.key, k)
    return list(out.values())


def covering_sample(device: DeviceLimits, covered: list[DecodeConfig] | tuple[DecodeConfig, ...] = (),
                    seed: int = 0) -> list[DecodeConfig]:
    """A deterministic sample of :func:`full_compile_space` such that

    - the sample by itself holds every value of every parameter of :func:`template_values` and
      every page size (0 = contiguous) with each mma value some valid variant has;
    - the sample together with ``covered`` (variants compiled anyway) holds every pair of
      (parameter, value) choices that some valid variant combines (strength-2 coverage).

    Greedy (each step takes the variant that adds the most missing targets); ties are broken by a
    crc32 of the key salted with ``seed``, so the sample is stable across runs and Python versions."""
    import heapq
    import zlib

    space = sorted(full_compile_space(device), key=lambda c: zlib.crc32(f"{seed}/{c.key}".encode()))
    done = {p for c in covered for p in itertools.combinations(template_values(c), 2)}

    def targets(c: DecodeConfig) -> set:
        v = template_values(c)
        own = {("own", x) for x in v} | {("own", ("page_size", c.page_size), ("mma", c.mma))}
        return own | (set(itertools.combinations(v, 2)) - done)

    wants = [targets(c) for c in space]
    got: set = set()
    heap = [(-len(t), i) for i, t in enumerate(wants)]
    heapq.heapify(heap)
    out = []
    while heap:
        neg, i = heapq.heappop(heap)
        gain = len(wants[i] - got)
        if gain == 0:
            continue  # gains only shrink: this one never adds anything again
        if gain < -neg:
            heapq.heappush(heap, (-gain, i))  # stale upper bound: re-rank
            continue
        got |= wants[i]
        out.append(space[i])
    return out


#: The INT4 heuristic variants CI compiles in full (on sm_90): fp16 q, groups of 64 (the
#: quantizers' default), 1, 4 or 8 query heads per CTA, every head dim and cache.
#: Query heads per CTA of the quantized heuristic variants CI compiles in full on sm_90 (llama-style
#: GQA, 4 query heads per KV head); the other group sizes change only constants of the same code.
QUANT_CI_GROUPS = (4,)
#: INT4 variants CI compiles in full on sm_90: (q dtype, format, group sizes).
INT4_CI = ("fp16", "int4_g64", QUANT_CI_GROUPS)
#: Query heads per CTA of the unquantized heuristic variants CI compiles in full on sm_8x (no shipped
#: table targets it): the power-of-two GQA groups (MHA and the presets' 4 and 8, and 2); 3, 5, 6
#: and 7 through the sample.
SM8X_CI_GROUPS = (1, 2, 4, 8)
#: Page sizes of the paged heuristic variants CI compiles in full (both archs): 1 (one row per
#: page: the per-row loader), 16 and 64 (vLLM's and FlashInfer's usual pages, and the shipped
#: table's), 256 (the largest). 2, 4, 8, 32 and 128 come through the sample: a page size enters the
#: kernel as the shift and mask of ``tok / PAGE`` and as the loader's run length min(PAGE, rows per
#: thread), which pages of 16 and more saturate. Compiled at every page size for sm_90, 12 variants
#: (CUDA-core and tensor-core, 16-bit, FP8 and INT4 caches) had the same registers at pages 16..256,
#: or within 5, and no spill at any page size.
CI_PAGE_SIZES = (1, 16, 64, 256)
#: Query heads per CTA of the unquantized tensor-core heuristic variants CI compiles in full (both
#: archs; the others through the sample): the group is the MMAs' padded M (N for FP8) dimension, so
#: only masks change; compiled at every group size on sm_90, 6 variants (16-bit, FP8 and INT4 caches,
#: pages 1..256) took registers within 6 of each other and no spill.
MMA_CI_GROUPS = (1, 4, 8)
#: Page sizes of the paged heuristic variants CI compiles in full on sm_8x (no shipped table
#: targets it): vLLM's 16; the others come through the sample, and sm_90 compiles CI_PAGE_SIZES.
SM8X_CI_PAGE_SIZES = (16,)


def sampled_only(config: DecodeConfig | CombineConfig, device: DeviceLimits) -> bool:
    """A heuristic variant CI compiles only through the covering sample (CI time: each tensor-core
    kernel costs ~0.3 CI seconds, and there are ~320 heuristic variants per quantized format and
    arch). Compiled in full on sm_90: the FP8 E4M3 and the :data:`INT4_CI` variants with
    :data:`QUANT_CI_GROUPS` query heads per CTA (40 and 20); through the sample: the other group
    sizes (only constants of the same code change), E5M2 (the E4M3 code with another two-code
    conversion, ``KvDecode`` in kv_cache.cuh), the other INT4 groups and q dtypes, and on sm_8x
    every quantized variant and the unquantized ones whose group size is not in
    :data:`SM8X_CI_GROUPS`; paged variants whose page size is not in :data:`CI_PAGE_SIZES`
    (sm_8x: :data:`SM8X_CI_PAGE_SIZES`); unquantized tensor-core variants whose group size is not
    in :data:`MMA_CI_GROUPS`; the heuristic's cluster twins (:func:`heuristic_cluster`) but those of
    contiguous fp16 / bf16 / E4M3 caches, head_dim 128 and 4 query heads per CTA. Variants a shipped
    table selects are always compiled. The slow test compiles the whole space on both archs."""
    if not isinstance(config, DecodeConfig):
        return False
    if config.cluster > 1 and not (config.page_size == 0 and config.head_dim == 128 and config.group_size == 4
                                   and config.kv_dtype in (*MMA_DTYPES, "fp8_e4m3")):
        return True  # the heuristic's cluster twins (heuristic_cluster): through the sample but llama's
    if config.page_size and config.page_size not in (CI_PAGE_SIZES if device.cc[0] >= 9 else SM8X_CI_PAGE_SIZES):
        return True
    if config.mma and config.kv_dtype == config.dtype and config.group_size not in MMA_CI_GROUPS:
        return True
    if config.kv_dtype in INT4_FORMATS:
        dt, kv, groups = INT4_CI
        return device.cc[0] < 9 or config.dtype != dt or config.kv_dtype != kv or config.group_size not in groups
    if config.kv_dtype not in KV_FORMATS:
        return device.cc[0] < 9 and config.group_size not in SM8X_CI_GROUPS
    return device.cc[0] < 9 or config.kv_dtype != "fp8_e4m3" or config.group_size not in QUANT_CI_GROUPS


def ci_compile_set(device: DeviceLimits) -> list[DecodeConfig | CombineConfig]:
    """The variants CI compiles for ``device`` (deterministic, without duplicates): every valid
    kernel the shipped tables (:func:`table_variants`) and the heuristic (:func:`heuristic_variants`)
    can select (but :func:`sampled_only` heuristic ones), plus a :func:`covering_sample` of the whole space that makes every pair of
    template-parameter values some valid variant combines appear at least once. The full space is
    compiled by the slow test (``FDPP_SLOW=1 pytest tests/test_compile.py``)."""
    out: dict[str, DecodeConfig | CombineConfig] = {}
    for c in table_variants(device):
        if c.is_valid(device):
            out.setdefault(c.key, c)
    for c in heuristic_variants(device):
        if c.is_valid(device) and not sampled_only(c, device):
            out.setdefault(c.key, c)
    for c in covering_sample(device, [c for c in out.values() if isinstance(c, DecodeConfig)]):
        out.setdefault(c.key, c)
    for c in umax_twins(list(out.values())):
        out.setdefault(c.key, c)
    return list(out.values())


def umax_twins(configs: list[DecodeConfig | CombineConfig]) -> list[DecodeConfig]:
    """The unified-max twins (``DecodeConfig.umax``) CI compiles: of every tensor-core variant of
    head dim <= 128 in ``configs`` that a shipped table selects (what a unified-max call runs
    with the table) or that is contiguous with 4 query heads per CTA (the llama-style GQA kernels
    of each dtype and K/V type: the twin's code differs from its variant only in the softmax)."""
    table = {c.key for dev in (SM80, SM90) for c in table_variants(dev)}
    return [replace(c, umax=True) for c in configs
            if isinstance(c, DecodeConfig) and c.mma and not c.umax and c.head_dim <= 128
            and (c.key in table or (c.page_size == 0 and c.group_size == 4 and c.cluster == 1))]
