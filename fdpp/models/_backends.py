"""The array-module layer of :mod:`fdpp.models.llama`: one small class per front end ("numpy",
"torch", "cupy") with the elementwise work of a decode step, each op writing a preallocated
output (so a step allocates nothing and CUDA graphs can capture it), and a counter-based random
generator that gives bit-identical values on every front end.

Elementwise numerics (all front ends): inputs are widened to float32, the op is computed in
float32 and the result is rounded once to the model dtype.

- RMSNorm: ``y = x * rsqrt(mean(x^2) + eps) * w``
- RoPE (rotate-half convention of Hugging Face Llama): for each head row ``x = [x1, x2]`` (halves
  of D), ``y = [x1 c - x2 s, x2 c + x1 s]`` with ``c, s = cos/sin(pos * theta^(-2i/D))`` read from
  a float32 table made in float64 on the host, ``pos = seqlens[b] - 1`` read on the device
- SiLU-mul: ``a = g / (1 + exp(-g)) * u`` with ``[g | u]`` the gate_up output
- residual: ``x += y``
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

from fdpp.dtypes import DTYPES

M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B
CHUNK = 1 << 25  # elements generated per pass (bounds the int64 temporaries)


# ---- counter-based generator ------------------------------------------------------------------
def _mix_host(x: int) -> int:
    x &= M32
    x = ((x ^ (x >> 16)) * _MIX) & M32
    x = ((x ^ (x >> 16)) * _MIX) & M32
    return x ^ (x >> 16)


def stream_keys(seed: int, name: str) -> tuple[int, int]:
    """Two 32-bit keys of the random stream ``name`` under ``seed`` (host ints)."""
    k1 = _mix_host(zlib.crc32(name.encode()) ^ _mix_host(int(seed) * 0x9E3779B9 + 0x7F4A7C15))
    return k1, _mix_host(k1 + 0x632BE5AB)


def uniform_scale(std: float) -> float:
    """Multiplier of the odd integers in [-(2^24 - 1), 2^24 - 1] that gives a uniform distribution
    of standard deviation ``std`` (half-width ``std * sqrt(3)``)."""
    return float(np.float32(std * math.sqrt(3.0) / (1 << 24)))


def hash_values(xp: Any, idx: Any, k1: int, k2: int, scale: float, f32: Any) -> Any:
    """float32 values of the stream at int64 indices ``idx`` (< 2**32), with array module ``xp``
    (numpy, cupy or torch: only int64 ``+ ^ >> * &``, one int64 -> float32 conversion and one
    float32 multiplication, so every front end gives the same bits)."""

    def mix(x: Any) -> Any:
        x = ((x ^ (x >> 16)) * _MIX) & M32
        x = ((x ^ (x >> 16)) * _MIX) & M32
        return x ^ (x >> 16)

    x = mix(mix((idx + k1) & M32) ^ k2)
    odd = (x >> 8) * 2 - ((1 << 24) - 1)  # odd integers, exact in float32
    return _to(xp, odd, f32) * scale


def _to(xp: Any, a: Any, dt: Any) -> Any:
    return a.to(dt) if type(a).__module__.startswith("torch") else a.astype(dt)


# ---- front ends ----------------------------------------------------------------------------
class NumpyOps:
    """Host arrays; the fdpp calls run their NumPy paths (emulator / float32 GEMM without a GPU)."""

    name = "numpy"
    device = None

    def __init__(self, dtype: str, device: int | None = None):
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype].np_dtype
        self.int32 = np.int32

    # memory
    def empty(self, shape: tuple, dtype: Any = None) -> Any:
        return np.zeros(shape, dtype=self.dtype if dtype is None else dtype)

    def from_numpy(self, a: np.ndarray) -> Any:
        return np.array(a)

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def copy_(self, dst: Any, src: Any) -> None:
        dst[...] = src

    def random(self, shape: tuple, seed: int, name: str, std: float, offset: int = 0, mean: float = 0.0) -> Any:
        """A new array of the model dtype: stream ``name`` at flat indices offset..offset+size-1,
        uniform with standard deviation ``std`` around ``mean``."""
        n = int(np.prod(shape))
        if offset + n > 1 << 32:
            raise ValueError(f"random stream {name!r} needs indices < 2**32, got {offset + n}")
        k1, k2 = stream_keys(seed, name)
        out = self.empty((n,))
        sc = uniform_scale(std)
        for s in range(0, n, CHUNK):
            e = min(n, s + CHUNK)
            v = self._hash(offset + s, offset + e, k1, k2, sc)
            if mean:
                v = v + np.float32(mean)
            self._store(out, s, e, v)
        return out.reshape(shape)

    def _hash(self, lo: int, hi: int, k1: int, k2: int, sc: float) -> Any:
        return hash_values(np, np.arange(lo, hi, dtype=np.int64), k1, k2, np.float32(sc), np.float32)

    def _store(self, out: Any, s: int, e: int, v: Any) -> None:
        out[s:e] = v.astype(self.dtype)

    # elementwise ops of a step (write ``out``)
    def rmsnorm(self, x: Any, w: Any, eps: float, out: Any) -> None:
        x32 = x.astype(np.float32)
        r = 1.0 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(eps))
        out[...] = (x32 * r * w.astype(np.float32)).astype(self.dtype)

    def rope_qkv(self, qkv: Any, cos: Any, sin: Any, seqlens: Any, q: Any, k: Any, v: Any) -> None:
        b, hq, d = q.shape
        hkv = k.shape[1]
        pos = np.clip(np.asarray(seqlens, dtype=np.int64) - 1, 0, cos.shape[0] - 1)
        c, s = cos[pos][:, None, :], sin[pos][:, None, :]
        x = qkv.reshape(b, hq + 2 * hkv, d)
        qk = x[:, :hq + hkv].astype(np.float32)
        x1, x2 = qk[..., :d // 2], qk[..., d // 2:]
        r = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(self.dtype)
        q[...] = r[:, :hq]
        k[...] = r[:, hq:]
        v[...] = x[:, hq + hkv:]

    def silu_mul(self, gu: Any, out: Any) -> None:
        i = out.shape[1]
        g, u = gu[:, :i].astype(np.float32), gu[:, i:].astype(np.float32)
        out[...] = (g / (np.float32(1) + np.exp(-g)) * u).astype(self.dtype)

    def add_(self, x: Any, y: Any) -> None:
        x[...] = (x.astype(np.float32) + y.astype(np.float32)).astype(self.dtype)

    def embed(self, table: Any, ids: Any, out: Any) -> None:
        out[...] = table[np.asarray(ids, dtype=np.int64)]

    def contiguous_append(self, kc: Any, vc: Any, k: Any, v: Any, seqlens: Any) -> None:
        """Write ``k``, ``v`` [B, Hkv, D] at position ``seqlens[b] - 1`` of ``kc``, ``vc``
        [B, N_max, Hkv, D]."""
        pos = np.asarray(seqlens, dtype=np.int64) - 1
        rows = np.arange(k.shape[0])
        kc[rows, pos] = k
        vc[rows, pos] = v


class TorchOps(NumpyOps):
    """torch CUDA tensors; elementwise work through torch ops on torch's current stream."""

    name = "torch"

    def __init__(self, dtype: str, device: int | None = None):
        import torch

        self.torch = torch
        self.dtype_name = dtype
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        self.int32 = torch.int32
        self.device = torch.cuda.current_device() if device is None else int(device)
        self.tdev = torch.device("cuda", self.device)

    def empty(self, shape: tuple, dtype: Any = None) -> Any:
        dt = self.dtype if dtype is None else ({np.int32: self.torch.int32, np.float32: self.torch.float32}
                                               .get(dtype, dtype))
        return self.torch.zeros(shape, dtype=dt, device=self.tdev)

    def from_numpy(self, a: np.ndarray) -> Any:
        return self.torch.from_numpy(np.ascontiguousarray(a)).to(self.tdev)

    def to_numpy(self, x: Any) -> np.ndarray:
        t = x.detach().cpu()
        if t.dtype == self.torch.bfloat16:
            return t.view(self.torch.int16).numpy().view(DTYPES["bf16"].np_dtype)
        return t.numpy()

    def copy_(self, dst: Any, src: Any) -> None:
        if isinstance(src, np.ndarray):
            src = self.torch.from_numpy(np.ascontiguousarray(src))
        dst.copy_(src)

    def _hash(self, lo: int, hi: int, k1: int, k2: int, sc: float) -> Any:
        t = self.torch
        return hash_values(t, t.arange(lo, hi, dtype=t.int64, device=self.tdev), k1, k2, sc, t.float32)

    def _store(self, out: Any, s: int, e: int, v: Any) -> None:
        out[s:e] = v.to(self.dtype)

    def rmsnorm(self, x: Any, w: Any, eps: float, out: Any) -> None:
        x32 = x.float()
        out.copy_(x32 * self.torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps) * w.float())

    def rope_qkv(self, qkv: Any, cos: Any, sin: Any, seqlens: Any, q: Any, k: Any, v: Any) -> None:
        t = self.torch
        b, hq, d = q.shape
        hkv = k.shape[1]
        pos = (seqlens.long() - 1).clamp_(0, cos.shape[0] - 1)
        c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
        x = qkv.view(b, hq + 2 * hkv, d)
        qk = x[:, :hq + hkv].float()
        x1, x2 = qk[..., :d // 2], qk[..., d // 2:]
        r = t.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        q.copy_(r[:, :hq])
        k.copy_(r[:, hq:])
        v.copy_(x[:, hq + hkv:])

    def silu_mul(self, gu: Any, out: Any) -> None:
        i = out.shape[1]
        g = gu[:, :i].float()
        out.copy_(g / (1.0 + self.torch.exp(-g)) * gu[:, i:].float())

    def add_(self, x: Any, y: Any) -> None:
        x.add_(y)

    def embed(self, table: Any, ids: Any, out: Any) -> None:
        self.torch.index_select(table, 0, ids, out=out)

    def contiguous_append(self, kc: Any, vc: Any, k: Any, v: Any, seqlens: Any) -> None:
        pos = seqlens.long() - 1
        rows = self.torch.arange(k.shape[0], device=k.device)
        kc.index_put_((rows, pos), k)
        vc.index_put_((rows, pos), v)


_CUPY_SOURCE = r"""
// fp16 stored as raw 16-bit words (no CUDA headers needed): PTX conversions, round to nearest even
typedef unsigned short T;
__device__ __forceinline__ float ld(const T* p) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(*p));
  return f;
}
__device__ __forceinline__ void st(T* p, float f) {
  T h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  *p = h;
}

__device__ __forceinline__ float block_sum(float s, float* red) {
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x < 32) {
    s = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x == 0) red[0] = s;
  }
  __syncthreads();
  return red[0];
}

extern "C" {
// one CTA per row (blockDim a multiple of 32, at most 1024)
__global__ void rmsnorm(const T* x, const T* w, T* out, int n, float eps) {
  __shared__ float red[32];
  const T* xr = x + (long long)blockIdx.x * n;
  T* o = out + (long long)blockIdx.x * n;
  float s = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) { float v = ld(xr + i); s += v * v; }
  float r = rsqrtf(block_sum(s, red) / (float)n + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) st(o + i, ld(xr + i) * r * ld(w + i));
}

// one CTA per (request, head of q | k | v); pos = seqlens[b] - 1
__global__ void rope_qkv(const T* qkv, const float* cos_t, const float* sin_t, const int* seqlens,
                         T* q, T* k, T* v, int hq, int hkv, int d, int n_pos) {
  int heads = hq + 2 * hkv;
  int b = blockIdx.x / heads, h = blockIdx.x % heads, hd = d / 2;
  const T* src = qkv + ((long long)b * heads + h) * d;
  int pos = min(max(seqlens[b] - 1, 0), n_pos - 1);
  for (int i = threadIdx.x; i < hd; i += blockDim.x) {
    if (h < hq + hkv) {
      float x1 = ld(src + i), x2 = ld(src + i + hd);
      float c = cos_t[(long long)pos * hd + i], s = sin_t[(long long)pos * hd + i];
      T* dst = h < hq ? q + ((long long)b * hq + h) * d : k + ((long long)b * hkv + (h - hq)) * d;
      st(dst + i, x1 * c - x2 * s);
      st(dst + i + hd, x2 * c + x1 * s);
    } else {
      T* dst = v + ((long long)b * hkv + (h - hq - hkv)) * d;
      dst[i] = src[i];
      dst[i + hd] = src[i + hd];
    }
  }
}

__global__ void silu_mul(const T* gu, T* out, int rows, int inter) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)rows * inter) return;
  long long b = i / inter, j = i % inter;
  float g = ld(gu + b * 2 * inter + j), u = ld(gu + b * 2 * inter + inter + j);
  st(out + i, g / (1.f + expf(-g)) * u);
}

__global__ void add_inplace(T* x, const T* y, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) st(x + i, ld(x + i) + ld(y + i));
}

__global__ void embed(const T* table, const int* ids, T* out, int hidden) {
  const T* src = table + (long long)ids[blockIdx.x] * hidden;
  T* dst = out + (long long)blockIdx.x * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
}

// kc, vc: [B, n_max, row] (row = Hkv * D); k, v: [B, row]; written at seqlens[b] - 1
__global__ void contiguous_append(T* kc, T* vc, const T* k, const T* v, const int* seqlens,
                                  int n_max, int row) {
  int b = blockIdx.y;
  int pos = seqlens[b] - 1;
  if (pos < 0 || pos >= n_max) return;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < row; i += gridDim.x * blockDim.x) {
    long long dst = ((long long)b * n_max + pos) * row + i;
    kc[dst] = k[(long long)b * row + i];
    vc[dst] = v[(long long)b * row + i];
  }
}
}
"""
#: the kernels of :data:`_CUPY_SOURCE` (tests compile them offline with NVRTC)
CUPY_KERNELS = ("rmsnorm", "rope_qkv", "silu_mul", "add_inplace", "embed", "contiguous_append")

_cupy_modules: dict[int, Any] = {}


class CupyOps(NumpyOps):
    """CuPy arrays (fp16); elementwise work in small RawKernels on CuPy's current stream."""

    name = "cupy"
    THREADS = 256

    def __init__(self, dtype: str, device: int | None = None):
        import cupy

        if dtype != "fp16":
            raise ValueError(f"the CuPy front end runs fp16 models (CuPy has no bfloat16 arithmetic), "
                             f"got dtype={dtype!r}; use backend='torch' for bf16")
        self.cp = cupy
        self.dtype_name = dtype
        self.dtype = np.dtype(np.float16)
        self.int32 = np.int32
        self.device = cupy.cuda.Device().id if device is None else int(device)
        with cupy.cuda.Device(self.device):
            mod = _cupy_modules.get(self.device)
            if mod is None:
                mod = _cupy_modules[self.device] = cupy.RawModule(code=_CUPY_SOURCE, options=("-std=c++17",))
            self.k = {n: mod.get_function(n) for n in CUPY_KERNELS}

    def empty(self, shape: tuple, dtype: Any = None) -> Any:
        with self.cp.cuda.Device(self.device):
            return self.cp.zeros(shape, dtype=self.dtype if dtype is None else dtype)

    def from_numpy(self, a: np.ndarray) -> Any:
        with self.cp.cuda.Device(self.device):
            return self.cp.asarray(a)

    def to_numpy(self, x: Any) -> np.ndarray:
        return self.cp.asnumpy(x)

    def copy_(self, dst: Any, src: Any) -> None:
        if isinstance(src, np.ndarray):
            dst.set(np.ascontiguousarray(src, dtype=dst.dtype))
        else:
            dst[...] = src

    def _hash(self, lo: int, hi: int, k1: int, k2: int, sc: float) -> Any:
        cp = self.cp
        with cp.cuda.Device(self.device):
            return hash_values(cp, cp.arange(lo, hi, dtype=cp.int64), k1, k2, np.float32(sc), cp.float32)

    def _store(self, out: Any, s: int, e: int, v: Any) -> None:
        out[s:e] = v.astype(self.dtype)

    def _grid(self, n: int) -> tuple[int, int, int]:
        return (-(-n // self.THREADS), 1, 1)

    def rmsnorm(self, x: Any, w: Any, eps: float, out: Any) -> None:
        rows, n = x.shape
        self.k["rmsnorm"]((rows, 1, 1), (self.THREADS, 1, 1), (x, w, out, np.int32(n), np.float32(eps)))

    def rope_qkv(self, qkv: Any, cos: Any, sin: Any, seqlens: Any, q: Any, k: Any, v: Any) -> None:
        b, hq, d = q.shape
        hkv = k.shape[1]
        threads = max(32, min(self.THREADS, d // 2))
        self.k["rope_qkv"]((b * (hq + 2 * hkv), 1, 1), (threads, 1, 1),
                           (qkv, cos, sin, seqlens, q, k, v, np.int32(hq), np.int32(hkv), np.int32(d),
                            np.int32(cos.shape[0])))

    def silu_mul(self, gu: Any, out: Any) -> None:
        rows, inter = out.shape
        self.k["silu_mul"](self._grid(rows * inter), (self.THREADS, 1, 1),
                           (gu, out, np.int32(rows), np.int32(inter)))

    def add_(self, x: Any, y: Any) -> None:
        self.k["add_inplace"](self._grid(x.size), (self.THREADS, 1, 1), (x, y, np.int64(x.size)))

    def embed(self, table: Any, ids: Any, out: Any) -> None:
        self.k["embed"]((out.shape[0], 1, 1), (self.THREADS, 1, 1), (table, ids, out, np.int32(out.shape[1])))

    def contiguous_append(self, kc: Any, vc: Any, k: Any, v: Any, seqlens: Any) -> None:
        b, n_max = kc.shape[:2]
        row = k.shape[1] * k.shape[2]
        self.k["contiguous_append"]((max(1, min(64, -(-row // self.THREADS))), b, 1), (self.THREADS, 1, 1),
                                    (kc, vc, k, v, seqlens, np.int32(n_max), np.int32(row)))


OPS = {"numpy": NumpyOps, "torch": TorchOps, "cupy": CupyOps}


def make_ops(backend: str, dtype: str, device: int | None = None) -> NumpyOps:
    if backend not in OPS:
        raise ValueError(f"backend must be one of {sorted(OPS)}, got {backend!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if backend == "numpy" and device is not None:
        raise ValueError("device must be None for backend='numpy'")
    return OPS[backend](dtype, device)


def rope_tables(max_pos: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``cos``, ``sin`` tables [max_pos, head_dim / 2]: angle ``p * theta^(-2i / D)``
    computed in float64 (positions stay exact up to 2**53)."""
    inv = float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
