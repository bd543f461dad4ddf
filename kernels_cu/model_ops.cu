#line 2 "kernels_cu/model_ops.cu"
// The elementwise steps of a Llama decode step (fdpp.models: the CuPy and torch front ends), one
// kernel each instead of a chain of array-library kernels: RMSNorm (alone, or with the residual add
// before it fused in), RoPE with the q / k / v split (alone, or with the contiguous-cache append
// fused in), SiLU-mul, the residual add, the embedding
// gather and the contiguous-cache append. T is the model
// dtype (half_t, bfloat16_t or float); every op widens to float32, computes in float32 and rounds
// once (fdpp/models/_backends.py states the formulas; the NumPy front end is the reference).
#include "common.cuh"
#include "rope.cuh"

namespace fdpp {

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

// y = x * rsqrt(mean(x^2) + eps) * w; one CTA per row (blockDim a multiple of 32, at most 1024).
// The first RMS_CACHE * blockDim elements of the row and of w are loaded once, all loads in flight
// together, and kept in registers for the scaling pass; a longer row reads the rest twice.
// ADD (add_rmsnorm, the residual add fused in front): x += r first, rounded to T and written back
// (a thread re-reads only what it wrote), and the norm is of that rounded row: the values of
// add_inplace followed by rmsnorm, bit for bit, in one launch.
constexpr int RMS_CACHE = 8;
template <typename T, bool ADD>
__device__ __forceinline__ void rmsnorm_row(T* x, const T* r, const T* w, T* out, int n, float eps) {
  using TT = TypeTraits<T>;
  __shared__ float red[32];
  const long long row = (long long)blockIdx.x * n;
  T* xr = x + row;
  T* o = out + row;
  auto value = [&](int i) {  // element i of the row to normalise (written back when ADD)
    float v = TT::load(xr + i);
    if constexpr (ADD) {
      v = round_to<T>(v + TT::load(r + row + i));
      TT::store(xr + i, v);
    }
    return v;
  };
  float xv[RMS_CACHE], wv[RMS_CACHE];
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < RMS_CACHE; ++c) {
    const int i = threadIdx.x + c * blockDim.x;
    xv[c] = i < n ? value(i) : 0.f;
    wv[c] = i < n ? TT::load(w + i) : 0.f;
  }
#pragma unroll
  for (int c = 0; c < RMS_CACHE; ++c) s += xv[c] * xv[c];
  for (int i = threadIdx.x + RMS_CACHE * blockDim.x; i < n; i += blockDim.x) { float v = value(i); s += v * v; }
  const float rs = rsqrtf(block_sum(s, red) / (float)n + eps);
#pragma unroll
  for (int c = 0; c < RMS_CACHE; ++c) {
    const int i = threadIdx.x + c * blockDim.x;
    if (i < n) TT::store(o + i, xv[c] * rs * wv[c]);
  }
  for (int i = threadIdx.x + RMS_CACHE * blockDim.x; i < n; i += blockDim.x)
    TT::store(o + i, TT::load(xr + i) * rs * TT::load(w + i));
}

template <typename T>
__global__ void rmsnorm(const T* x, const T* w, T* out, int n, float eps) {
  rmsnorm_row<T, false>(const_cast<T*>(x), nullptr, w, out, n, eps);
}

// x += r (rounded to T), then out = rmsnorm(x) * w: a residual add and the next RMSNorm
template <typename T>
__global__ void add_rmsnorm(T* x, const T* r, const T* w, T* out, int n, float eps) {
  rmsnorm_row<T, true>(x, r, w, out, n, eps);
}

// qkv [B, (hq + 2 hkv) * d] -> q [B, hq, d], k [B, hkv, d] rotated (rotate-half, rope.cuh) at
// pos = clamp(seqlens[b] - 1, 0, n_pos - 1), v [B, hkv, d] copied; one CTA per (request, head).
// APPEND (rope_qkv_append): k and v go straight into the contiguous caches kc, vc [B, n_max, hkv, d]
// at seqlens[b] - 1 (nothing written outside [0, n_max)) instead of into k, v: rope_qkv followed
// by contiguous_append, bit for bit, in one launch.
template <typename T, bool APPEND>
__device__ __forceinline__ void rope_qkv_row(const T* qkv, const float* cos_t, const float* sin_t, const int* seqlens,
                                             T* q, T* k, T* v, int hq, int hkv, int d, int n_pos, int n_max) {
  using TT = TypeTraits<T>;
  const int heads = hq + 2 * hkv;
  const int b = blockIdx.x / heads, h = blockIdx.x % heads, hd = d / 2;
  const T* src = qkv + ((long long)b * heads + h) * d;
  const int slot = seqlens[b] - 1;
  const int pos = min(max(slot, 0), n_pos - 1);
  T* dst;
  if (h < hq) {
    dst = q + ((long long)b * hq + h) * d;
  } else {
    const int kvh = h < hq + hkv ? h - hq : h - hq - hkv;
    if constexpr (APPEND) {
      if (slot < 0 || slot >= n_max) return;
      dst = (h < hq + hkv ? k : v) + (((long long)b * n_max + slot) * hkv + kvh) * d;
    } else {
      dst = (h < hq + hkv ? k : v) + ((long long)b * hkv + kvh) * d;
    }
  }
  for (int i = threadIdx.x; i < hd; i += blockDim.x) {
    if (h < hq + hkv) {
      const float x1 = TT::load(src + i), x2 = TT::load(src + i + hd);
      const float c = cos_t[(long long)pos * hd + i], s = sin_t[(long long)pos * hd + i];
      TT::store(dst + i, rope_lo(x1, x2, c, s));
      TT::store(dst + i + hd, rope_hi(x1, x2, c, s));
    } else {
      dst[i] = src[i];
      dst[i + hd] = src[i + hd];
    }
  }
}

template <typename T>
__global__ void rope_qkv(const T* qkv, const float* cos_t, const float* sin_t, const int* seqlens,
                         T* q, T* k, T* v, int hq, int hkv, int d, int n_pos) {
  rope_qkv_row<T, false>(qkv, cos_t, sin_t, seqlens, q, k, v, hq, hkv, d, n_pos, 0);
}

template <typename T>
__global__ void rope_qkv_append(const T* qkv, const float* cos_t, const float* sin_t, const int* seqlens,
                                T* q, T* kc, T* vc, int hq, int hkv, int d, int n_pos, int n_max) {
  rope_qkv_row<T, true>(qkv, cos_t, sin_t, seqlens, q, kc, vc, hq, hkv, d, n_pos, n_max);
}

// out [rows, inter] = silu(g) * u with gu = [g | u] [rows, 2 inter]
template <typename T>
__global__ void silu_mul(const T* gu, T* out, int rows, int inter) {
  using TT = TypeTraits<T>;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)rows * inter) return;
  const long long b = i / inter, j = i % inter;
  const float g = TT::load(gu + b * 2 * inter + j), u = TT::load(gu + b * 2 * inter + inter + j);
  TT::store(out + i, g / (1.f + expf(-g)) * u);
}

// x += y (n elements)
template <typename T>
__global__ void add_inplace(T* x, const T* y, long long n) {
  using TT = TypeTraits<T>;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) TT::store(x + i, TT::load(x + i) + TT::load(y + i));
}

// out [B, hidden] = table[ids[b]]; one CTA per request
template <typename T>
__global__ void embed(const T* table, const int* ids, T* out, int hidden) {
  const T* src = table + (long long)ids[blockIdx.x] * hidden;
  T* dst = out + (long long)blockIdx.x * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
}

// kc, vc [B, n_max, row] (row = hkv * d); k, v [B, row] written at seqlens[b] - 1 (nothing outside
// [0, n_max)); grid (x, B)
template <typename T>
__global__ void contiguous_append(T* kc, T* vc, const T* k, const T* v, const int* seqlens, int n_max,
                                  int row) {
  const int b = blockIdx.y;
  const int pos = seqlens[b] - 1;
  if (pos < 0 || pos >= n_max) return;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < row; i += gridDim.x * blockDim.x) {
    const long long dst = ((long long)b * n_max + pos) * row + i;
    kc[dst] = k[(long long)b * row + i];
    vc[dst] = v[(long long)b * row + i];
  }
}

}  // namespace fdpp
