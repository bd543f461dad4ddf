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
- residual + RMSNorm (``add_rmsnorm``): ``x += y`` (rounded to the model dtype), then RMSNorm of
  that rounded ``x``: the residual add and the RMSNorm after it, bit for bit, in one op
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
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

    def rope_qkv_append(self, qkv: Any, cos: Any, sin: Any, seqlens: Any, q: Any, kc: Any, vc: Any) -> None:
        """:meth:`rope_qkv` with k and v written straight into the contiguous caches ``kc``, ``vc``
        [B, N_max, Hkv, D] at position ``seqlens[b] - 1`` (:meth:`contiguous_append`), not into buffers."""
        b, _, hkv, d = kc.shape
        k, v = self.empty((b, hkv, d)), self.empty((b, hkv, d))
        self.rope_qkv(qkv, cos, sin, seqlens, q, k, v)
        self.contiguous_append(kc, vc, k, v, seqlens)

    def silu_mul(self, gu: Any, out: Any) -> None:
        i = out.shape[1]
        g, u = gu[:, :i].astype(np.float32), gu[:, i:].astype(np.float32)
        out[...] = (g / (np.float32(1) + np.exp(-g)) * u).astype(self.dtype)

    def add_(self, x: Any, y: Any) -> None:
        x[...] = (x.astype(np.float32) + y.astype(np.float32)).astype(self.dtype)

    def add_rmsnorm(self, x: Any, y: Any, w: Any, eps: float, out: Any) -> None:
        """``x += y``, then ``out = rmsnorm(x, w)``."""
        self.add_(x, y)
        self.rmsnorm(x, w, eps, out)

    def embed(self, table: Any, ids: Any, out: Any) -> None:
        out[...] = table[np.asarray(ids, dtype=np.int64)]

    def contiguous_append(self, kc: Any, vc: Any, k: Any, v: Any, seqlens: Any) -> None:
        """Write ``k``, ``v`` [B, Hkv, D] at position ``seqlens[b] - 1`` of ``kc``, ``vc``
        [B, N_max, Hkv, D]."""
        pos = np.asarray(seqlens, dtype=np.int64) - 1
        rows = np.arange(k.shape[0])
        kc[rows, pos] = k
        vc[rows, pos] = v


@dataclass(frozen=True)
class ModelOpKernel:
    """One kernel of ``kernels_cu/model_ops.cu`` for one model dtype (a registry kernel config)."""

    name: str
    dtype: str
    source: str = "model_ops.cu"

    @property
    def key(self) -> str:
        return f"model_ops.{self.name}.{self.dtype}"

    def name_expression(self) -> str:
        return f"fdpp::{self.name}<{DTYPES[self.dtype].ctype}>"

    def smem_bytes(self) -> int:
        return 0


RMS_CACHE = 8  # kernels_cu/model_ops.cu: row elements per thread held in registers by rmsnorm
#: the kernels of ``kernels_cu/model_ops.cu`` (CI compiles each for every dtype, sm_80 and sm_90)
MODEL_OPS = ("rmsnorm", "add_rmsnorm", "rope_qkv", "rope_qkv_append", "silu_mul", "add_inplace", "embed",
             "contiguous_append")


class _KernelOps(NumpyOps):
    """The elementwise ops of a step as fdpp kernels (``kernels_cu/model_ops.cu``, one launch
    each) on the front end's current stream; ``_arg`` turns an array into a kernel argument."""

    THREADS = 256

    def _load_kernels(self) -> None:
        from fdpp import registry

        self.k = {n: registry.get_kernel(ModelOpKernel(n, self.dtype_name), self.device).kernel for n in MODEL_OPS}

    def _arg(self, a: Any) -> Any:
        return a

    def _stream(self) -> Any:
        raise NotImplementedError

    def _launch(self, name: str, grid: tuple[int, int, int], threads: int, args: tuple) -> None:
        self.k[name](grid, (threads, 1, 1), tuple(self._arg(a) if not isinstance(a, np.generic) else a
                                                  for a in args), stream=self._stream())

    def _grid(self, n: int) -> tuple[int, int, int]:
        return (-(-n // self.THREADS), 1, 1)

    @staticmethod
    def _norm_threads(n: int) -> int:
        return min(1024, max(32, -(-n // (RMS_CACHE * 32)) * 32))  # every element in registers up to n = 8192

    def rmsnorm(self, x: Any, w: Any, eps: float, out: Any) -> None:
        rows, n = x.shape
        self._launch("rmsnorm", (rows, 1, 1), self._norm_threads(n), (x, w, out, np.int32(n), np.float32(eps)))

    def add_rmsnorm(self, x: Any, y: Any, w: Any, eps: float, out: Any) -> None:
        rows, n = x.shape
        self._launch("add_rmsnorm", (rows, 1, 1), self._norm_threads(n), (x, y, w, out, np.int32(n), np.float32(eps)))

    def rope_qkv(self, qkv: Any, cos: Any, sin: Any, seqlens: Any, q: Any, k: Any, v: Any) -> None:
        b, hq, d = q.shape
        hkv = k.shape[1]
        threads = max(32, min(self.THREADS, d // 2))
        self._launch("rope_qkv", (b * (hq + 2 * hkv), 1, 1), threads,
                     (qkv, cos, sin, seqlens, q, k, v, np.int32(hq), np.int32(hkv), np.int32(d),
                      np.int32(cos.shape[0])))

    def rope_qkv_append(self, qkv: Any, cos: Any, sin: Any, seqlens: Any, q: Any, kc: Any, vc: Any) -> None:
        b, hq, d = q.shape
        n_max, hkv = kc.shape[1], kc.shape[2]
        threads = max(32, min(self.THREADS, d // 2))
        self._launch("rope_qkv_append", (b * (hq + 2 * hkv), 1, 1), threads,
                     (qkv, cos, sin, seqlens, q, kc, vc, np.int32(hq), np.int32(hkv), np.int32(d),
                      np.int32(cos.shape[0]), np.int32(n_max)))

    def silu_mul(self, gu: Any, out: Any) -> None:
        rows, inter = out.shape
        self._launch("silu_mul", self._grid(rows * inter), self.THREADS, (gu, out, np.int32(rows), np.int32(inter)))

    def add_(self, x: Any, y: Any) -> None:
        n = math.prod(x.shape)
        self._launch("add_inplace", self._grid(n), self.THREADS, (x, y, np.int64(n)))

    def embed(self, table: Any, ids: Any, out: Any) -> None:
        self._launch("embed", (out.shape[0], 1, 1), self.THREADS, (table, ids, out, np.int32(out.shape[1])))

    def contiguous_append(self, kc: Any, vc: Any, k: Any, v: Any, seqlens: Any) -> None:
        b, n_max = kc.shape[:2]
        row = k.shape[1] * k.shape[2]
        self._launch("contiguous_append", (max(1, min(64, -(-row // self.THREADS))), b, 1), self.THREADS,
                     (kc, vc, k, v, seqlens, np.int32(n_max), np.int32(row)))


class TorchOps(_KernelOps):
    """torch CUDA tensors (fp16, bf16, fp32); elementwise work in fdpp kernels on torch's current stream."""

    name = "torch"

    def __init__(self, dtype: str, device: int | None = None):
        import torch

        self.torch = torch
        self.dtype_name = dtype
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        self.int32 = torch.int32
        self.device = torch.cuda.current_device() if device is None else int(device)
        self.tdev = torch.device("cuda", self.device)
        from fdpp import launch

        self._stream = launch.current_stream_fn("torch", self.device)  # type: ignore[method-assign]
        self._load_kernels()

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

    def _arg(self, a: Any) -> Any:
        return np.uint64(a.data_ptr())


class CupyOps(_KernelOps):
    """CuPy arrays (fp16); elementwise work in fdpp kernels on CuPy's current stream."""

    name = "cupy"

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
        self._load_kernels()
        self._stream = lambda: cupy.cuda.get_current_stream(self.device)  # type: ignore[method-assign]

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
