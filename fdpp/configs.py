"""Problems, kernel configurations, validity rules, the search space and the split heuristic.

Everything here is plain Python (no CuPy), so CI checks it on a CPU-only machine. A config's
fields mirror the template parameters of ``kernels_cu/decode_split.cu`` and
``kernels_cu/decode_combine.cu``; the template instantiation string and the variant key are
derived from the fields, never typed by hand.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from fdpp.dtypes import DTYPES, get_dtype

HEAD_DIMS = (64, 96, 128, 256)
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


@dataclass(frozen=True)
class DecodeProblem:
    """One decode-attention call shape: q [batch, num_q_heads, head_dim] over KV of seqlen tokens."""

    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    seqlen: int  # N_max, the KV cache capacity per request
    dtype: str = "fp16"

    @property
    def ratio(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def kv_bytes(self) -> int:
        """Bytes of K and V that one call must read when every request uses the whole cache."""
        isz = DTYPES[self.dtype].itemsize
        return 2 * self.batch * self.seqlen * self.num_kv_heads * self.head_dim * isz


def group_size_for(ratio: int) -> int:
    """Query heads per CTA: the largest divisor of the GQA ratio that is at most 8."""
    return max(g for g in range(1, min(ratio, 8) + 1) if ratio % g == 0)


@dataclass(frozen=True)
class DecodeConfig:
    """Compile-time parameters of ``decode_split`` (or ``decode_nosplit``, where group_size is 1)."""

    dtype: str
    head_dim: int
    group_size: int = 1
    num_warps: int = 4
    num_stages: int = 2
    unroll: int = 2
    kernel: str = "decode_split"
    mma: bool = False  # tensor-core phase 1 (decode_split_mma; fp16/bf16, head_dim 64/128/256)

    # ---- derived layout (mirrors RowLayout in decode_split.cu)
    @property
    def vec(self) -> int:
        return 16 // DTYPES[self.dtype].itemsize

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
            pipeline = self.num_stages * 2 * self.tile_tokens * self.head_dim * DTYPES[self.dtype].itemsize
        else:
            pipeline = self.num_stages * self.unroll * 2 * self.nv * self.threads * 16
        merge = self.num_warps * self.group_size * (self.head_dim + 2) * 4
        return max(pipeline, merge)

    def estimated_registers(self) -> int:
        """Estimate of registers per thread, calibrated on ptxas reports (tests/test_compile.py
        checks that every config under the limit compiles without spills)."""
        if self.mma:  # O fragments (4 per 8 columns), Q fragments, loader and softmax state
            nt = self.head_dim // 8
            return 4 * nt + self.head_dim // 8 + 24 * self.unroll + 40
        e = self.nv * self.vec
        return 2 * self.group_size * e + self.unroll * self.group_size + e + 48

    # ---- names
    def template_args(self) -> str:
        dt = DTYPES[self.dtype].ctype
        if self.kernel == "decode_nosplit":
            return f"{dt},{self.head_dim},{self.num_warps},{self.num_stages},{self.unroll}"
        # decode_split and decode_split_mma share the parameter list
        return (f"{dt},{self.head_dim},{self.group_size},{self.num_warps},"
                f"{self.num_stages},{self.unroll}")

    @property
    def function(self) -> str:
        return "decode_split_mma" if self.mma else self.kernel

    def name_expression(self) -> str:
        return f"fdpp::{self.function}<{self.template_args()}>"

    @property
    def key(self) -> str:
        return (f"{self.function}.{DTYPES[self.dtype].tag}.d{self.head_dim}.g{self.group_size}"
                f".w{self.num_warps}.s{self.num_stages}.u{self.unroll}")

    @property
    def source(self) -> str:
        return "decode_split.cu"

    # ---- validity
    def check(self, device: DeviceLimits = SM90) -> str | None:
        """Return why this config cannot run on ``device``, or None when it is valid."""
        if self.dtype not in DTYPES:
            return f"dtype {self.dtype!r} unknown"
        if self.mma:
            if self.dtype not in MMA_DTYPES:
                return f"the tensor-core path takes {MMA_DTYPES}, not {self.dtype}"
            if self.head_dim % 64:
                return f"the tensor-core path takes head_dim 64, 128 or 256, not {self.head_dim}"
            if self.num_stages < 2:
                return "the tensor-core path pipelines at least 2 stages"
            if self.kernel != "decode_split":
                return "only decode_split has a tensor-core variant"
        if self.head_dim % self.vec:
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
            return f"needs {self.smem_bytes()} B of shared memory > {device.smem_per_block} on {device.arch}"
        if self.estimated_registers() > 255:
            return f"needs about {self.estimated_registers()} registers per thread (> 255)"
        return None

    def is_valid(self, device: DeviceLimits = SM90) -> bool:
        return self.check(device) is None


@dataclass(frozen=True)
class CombineConfig:
    """Compile-time parameters of ``decode_combine``."""

    dtype: str
    head_dim: int
    num_warps: int = 4

    def name_expression(self) -> str:
        return f"fdpp::decode_combine<{DTYPES[self.dtype].ctype},{self.head_dim},{self.num_warps}>"

    @property
    def key(self) -> str:
        return f"decode_combine.{DTYPES[self.dtype].tag}.d{self.head_dim}.w{self.num_warps}"

    @property
    def source(self) -> str:
        return "decode_combine.cu"

    def smem_bytes(self) -> int:
        return 0  # static only

    def check(self, device: DeviceLimits = SM90) -> str | None:
        if self.head_dim % 4:
            return f"head_dim {self.head_dim} not a multiple of 4"
        if self.num_warps not in (1, 2, 4, 8):
            return f"num_warps {self.num_warps} not in 1, 2, 4, 8"
        return None

    def is_valid(self, device: DeviceLimits = SM90) -> bool:
        return self.check(device) is None


@dataclass(frozen=True)
class LaunchPlan:
    """What one call launches: phase 1 with its split count, and phase 2 unless num_splits == 1."""

    split: DecodeConfig
    num_splits: int
    combine: CombineConfig | None = None
    source: str = field(default="heuristic", compare=False)  # "heuristic" | "table" | "user"

    def chunk(self, seqlen: int) -> int:
        return max(1, math.ceil(seqlen / self.num_splits))

    def effective_splits(self, seqlen: int) -> int:
        """Splits actually launched: ceil(seqlen / chunk) (<= num_splits; 1 for an empty cache)."""
        return max(1, math.ceil(seqlen / self.chunk(seqlen)))


# ---- search space ---------------------------------------------------------------------------
MMA_DTYPES = ("fp16", "bf16")
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


def kernel_space(dtype: str, head_dim: int, group_size: int) -> list[DecodeConfig]:
    """Phase-1 variants the tuner may pick for one (dtype, head_dim, group_size), valid or not."""
    out = [DecodeConfig(dtype, head_dim, group_size, w, s, u)
           for w, s, u in itertools.product(*SPACE.values())]
    if mma_supported(dtype, head_dim):
        out += [DecodeConfig(dtype, head_dim, group_size, w, s, u, mma=True)
                for w, s, u in itertools.product(*MMA_SPACE.values())]
    return out


def compile_space(dtype: str, head_dim: int) -> list[DecodeConfig]:
    """Every phase-1 variant of the tuning space for one dtype and head_dim (any group size)."""
    return [c for g in GROUP_SIZES for c in kernel_space(dtype, head_dim, g)]


def nosplit_config(dtype: str, head_dim: int) -> DecodeConfig:
    return DecodeConfig(dtype, head_dim, 1, 4, 2, 2, kernel="decode_nosplit")


def combine_config(dtype: str, head_dim: int) -> CombineConfig:
    return CombineConfig(dtype, head_dim, 4)


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


def default_config(problem: DecodeProblem, device: DeviceLimits = SM90) -> LaunchPlan:
    """The heuristic plan used where no tuned table entry exists."""
    dt = get_dtype(problem.dtype).name
    g = group_size_for(problem.ratio)
    if mma_supported(dt, problem.head_dim):
        cfg = DecodeConfig(dt, problem.head_dim, g, num_warps=4, num_stages=3, unroll=1, mma=True)
    else:
        cfg = DecodeConfig(dt, problem.head_dim, g, num_warps=8, num_stages=2, unroll=4)
    if not cfg.is_valid(device):  # pragma: no cover - the defaults are valid for every HEAD_DIM
        raise ValueError(f"default config {cfg.key} invalid: {cfg.check(device)}")
    splits = split_heuristic(problem, device)
    comb = combine_config(dt, problem.head_dim) if splits > 1 else None
    return LaunchPlan(cfg, splits, comb, source="heuristic")
