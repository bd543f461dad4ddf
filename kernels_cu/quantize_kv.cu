#line 2 "kernels_cu/quantize_kv.cu"
// Quantize a contiguous KV cache (fdpp.quantize_kv on CuPy / torch arrays) and dequantize one
// (fdpp.dequantize_kv). Byte layouts and rounding: fdpp/quant.py and README "Quantized KV caches".
//
// Input K / V: [B, N, Hkv, D] (NHD) or [B, Hkv, N, D] (HND), fp16 / bf16 / fp32, any element
// strides with the head_dim stride 1 and 16-byte aligned rows (32-byte for fp32). Outputs are
// contiguous in the input's layout; "row" r is one (request, token, head) of D elements, rows
// numbered in that layout's order (NHD: (b * N + n) * Hkv + h; HND: (b * Hkv + h) * N + n).
//
// FP8 (three launches, grid.y = 2: y 0 is K, y 1 is V):
//   kv_amax<DType>          grid (B * Hkv, 2, splits), block AMAX_THREADS: block (bh, y, s) writes
//                           amax[(y * B * Hkv + bh) * splits + s] = max |x| over its chunk of
//                           ceil(N / splits) tokens, of tokens n < seqlens[b] (clamped to [0, N];
//                           all N when seqlens is null), and all of head_dim; NaN propagates.
//   kv_descale<FMT>         grid (1, 2), block AMAX_THREADS: amax of (b, h) = max over its splits;
//                           descale = amax / FP8_MAX (IEEE float32 division), 1.0 where amax == 0,
//                           at least 2^-149 elsewhere;
//                           per_tensor: one value from the max of every (b, h) amax.
//   quantize_fp8<DType,FMT> grid (ceil(rows * D / 8 / QUANT_THREADS), 2): 8 elements a thread,
//                           code = f32_to_fp8(x / descale) (quant.cuh; saturating = clip first).
// INT4 (one launch):
//   quantize_int4<DType,G>  grid (ceil(rows * D / 8 / QUANT_THREADS), 2): 8 elements a thread, G / 8
//                           lanes a group (max / min by shuffles), packed codes, fp16 scale / zero
//                           [rows, D / G].
// Dequantization (one launch per tensor, grid ceil(rows * D / 8 / QUANT_THREADS)): float32 out,
//   dequant_fp8<FMT>: fp8_to_f32(code) * descale (one float32 rounding);
//   dequant_int4<G>:  fma.rn.f16(n, scale, zero) (float16(n * scale + zero), rounded once), as f32.
#include "quant.cuh"

namespace fdpp {

constexpr int AMAX_THREADS = 256;
constexpr int QUANT_THREADS = 128;

// The quantize kernels' argument (Python mirror: fdpp.quant.QUANT_PARAMS). Strides in elements.
struct QuantKVParams {
  const void* k_src;
  const void* v_src;
  void* k_out;               // fp8: 1 byte per element; int4: D / 2 bytes per row
  void* v_out;
  float* k_descale;          // fp8: [B * Hkv] (per head) or [1] (per tensor)
  float* v_descale;
  unsigned short* k_scale;   // int4: fp16 [rows, D / G]
  unsigned short* v_scale;
  unsigned short* k_zero;
  unsigned short* v_zero;
  float* amax;               // fp8: scratch [2, B * Hkv, splits]
  const int* seqlens;        // int32 [B] or nullptr
  long long k_sb, k_sn, k_sh;  // input strides: request, token, head
  long long v_sb, v_sn, v_sh;
  long long rows;            // B * N * Hkv
  int batch, seqlen, heads, head_dim;
  int hnd;                   // 1: HND row order
  int per_tensor;            // fp8: one descale per tensor
  int splits;                // fp8: token chunks per (b, h) in kv_amax (gridDim.z)
  int pad_;
};
static_assert(sizeof(QuantKVParams) == 184, "QuantKVParams size");

// The dequantize kernels' argument (Python mirror: fdpp.quant.DEQUANT_PARAMS).
struct DequantKVParams {
  const void* codes;
  float* out;
  const float* descale;          // fp8
  const unsigned short* scale;   // int4
  const unsigned short* zero;
  long long rows;
  int seqlen, heads, head_dim, hnd, per_tensor, pad_;
};
static_assert(sizeof(DequantKVParams) == 72, "DequantKVParams size");

// (b, h, n) of row r.
__device__ __forceinline__ void row_bhn(long long r, int seqlen, int heads, int hnd, int& b, int& h, long long& n) {
  if (hnd) {
    n = r % seqlen;
    const long long t = r / seqlen;
    h = (int)(t % heads);
    b = (int)(t / heads);
  } else {
    h = (int)(r % heads);
    const long long t = r / heads;
    n = t % seqlen;
    b = (int)(t / seqlen);
  }
}

// The thread's 8-element vector of a grid of QUANT_THREADS-thread blocks over rows * vpt of them:
// row r, vector j of the row; false past the last vector.
__device__ __forceinline__ bool thread_vec(long long rows, int vpt, long long& r, int& j) {
  const long long i = (long long)blockIdx.x * QUANT_THREADS + threadIdx.x;
  if (i >= rows * vpt) return false;
  r = i / vpt;
  j = (int)(i - r * vpt);
  return true;
}

// The first input element of vector j of row (b, h, n) of K (is_v false) or V.
template <typename DType>
__device__ __forceinline__ const DType* src_vec(const QuantKVParams& p, bool is_v, int b, int h, long long n, int j) {
  return static_cast<const DType*>(is_v ? p.v_src : p.k_src) + b * (is_v ? p.v_sb : p.k_sb) +
         n * (is_v ? p.v_sn : p.k_sn) + h * (is_v ? p.v_sh : p.k_sh) + j * 8;
}

// nan_max of m over the CTA (AMAX_THREADS threads, all of which call it): warp shuffles, then warp
// 0's thread 0 folds the other warps' partials in order. The result is valid in thread 0 only.
__device__ __forceinline__ float cta_nan_max(float m) {
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, o));
  __shared__ float part[AMAX_THREADS / 32];
  if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 1; w < AMAX_THREADS / 32; ++w) m = nan_max(m, part[w]);
  }
  return m;
}

template <typename DType>
__global__ void __launch_bounds__(AMAX_THREADS) kv_amax(const QuantKVParams p) {
  const bool is_v = blockIdx.y != 0;
  const int bh = blockIdx.x;
  const int b = bh / p.heads, h = bh - b * p.heads;
  int len = p.seqlen;
  if (p.seqlens != nullptr) len = min(max(p.seqlens[b], 0), p.seqlen);
  const int chunk = (p.seqlen + p.splits - 1) / p.splits;
  const int n0 = (int)blockIdx.z * chunk;
  const int n1 = min(len, n0 + chunk);  // may be <= n0: nothing to read, amax 0
  const int vpt = p.head_dim / 8;  // 8-element vectors per token
  const DType* src = static_cast<const DType*>(is_v ? p.v_src : p.k_src) +
                     (long long)b * (is_v ? p.v_sb : p.k_sb) + (long long)h * (is_v ? p.v_sh : p.k_sh);
  const long long sn = is_v ? p.v_sn : p.k_sn;
  float m = 0.0f;
  const long long count = n1 > n0 ? (long long)(n1 - n0) * vpt : 0;
  for (long long i = threadIdx.x; i < count; i += AMAX_THREADS) {
    const long long n = n0 + i / vpt;
    const int j = (int)(i % vpt);
    float f[8];
    load8<DType>(src + n * sn + j * 8, f);
#pragma unroll
    for (int e = 0; e < 8; ++e) m = nan_max(m, f32_abs(f[e]));
  }
  m = cta_nan_max(m);
  if (threadIdx.x == 0) p.amax[((is_v ? (long long)p.batch * p.heads : 0) + bh) * p.splits + blockIdx.z] = m;
}

template <int FMT>
__device__ __forceinline__ float descale_of(float amax) {
  // at least 2^-149 (the smallest positive float32): a tiny amax must not give descale 0 (NaN codes);
  // a NaN amax gives a NaN descale, as NumPy's np.maximum (fmaxf would drop it); no .ftz (quant.cuh)
  if ((__float_as_uint(amax) & 0x7fffffffu) == 0u) return 1.0f;
  const float d = f32_div(amax, Fp8Traits<FMT>::MAX), tiny = __int_as_float(1);
  return (d != d || f32_gt(d, tiny)) ? d : tiny;
}

template <int FMT>
__global__ void __launch_bounds__(AMAX_THREADS) kv_descale(const QuantKVParams p) {
  const bool is_v = blockIdx.y != 0;
  const int bh_total = p.batch * p.heads;
  const float* amax = p.amax + (is_v ? (long long)bh_total * p.splits : 0);
  float* out = is_v ? p.v_descale : p.k_descale;
  if (!p.per_tensor) {
    for (int i = threadIdx.x; i < bh_total; i += AMAX_THREADS) {
      float m = 0.0f;
      for (int s = 0; s < p.splits; ++s) m = nan_max(m, amax[(long long)i * p.splits + s]);
      out[i] = descale_of<FMT>(m);
    }
    return;
  }
  float m = 0.0f;
  for (long long i = threadIdx.x; i < (long long)bh_total * p.splits; i += AMAX_THREADS) m = nan_max(m, amax[i]);
  m = cta_nan_max(m);
  if (threadIdx.x == 0) out[0] = descale_of<FMT>(m);
}

template <typename DType, int FMT>
__global__ void __launch_bounds__(QUANT_THREADS) quantize_fp8(const QuantKVParams p) {
  const bool is_v = blockIdx.y != 0;
  const int vpt = p.head_dim / 8;
  long long r;
  int j;
  if (!thread_vec(p.rows, vpt, r, j)) return;
  int b, h;
  long long n;
  row_bhn(r, p.seqlen, p.heads, p.hnd, b, h, n);
  const DType* src = src_vec<DType>(p, is_v, b, h, n, j);
  const float* ds = is_v ? p.v_descale : p.k_descale;
  const float descale = p.per_tensor ? ds[0] : ds[b * p.heads + h];
  float f[8];
  load8<DType>(src, f);
  unsigned char* out = static_cast<unsigned char*>(is_v ? p.v_out : p.k_out);
  reinterpret_cast<uint2*>(out + r * p.head_dim)[j] = fp8_pack8<FMT>(f, descale);
}

template <typename DType, int G>
__global__ void __launch_bounds__(QUANT_THREADS) quantize_int4(const QuantKVParams p) {
  static_assert(G == 32 || G == 64 || G == 128, "group size 32, 64 or 128");
  constexpr int LANES = G / 8;  // threads per group
  const bool is_v = blockIdx.y != 0;
  const int vpt = p.head_dim / 8;  // a multiple of LANES (head_dim % G == 0)
  long long r;
  int j;
  const unsigned int mask = group_mask<LANES>();
  if (!thread_vec(p.rows, vpt, r, j)) return;  // whole groups: rows * vpt is a multiple of LANES
  int b, h;
  long long n;
  row_bhn(r, p.seqlen, p.heads, p.hnd, b, h, n);
  const DType* src = src_vec<DType>(p, is_v, b, h, n, j);
  float f[8];
  load8<DType>(src, f);
  float mx = f[0], mn = f[0];
#pragma unroll
  for (int e = 1; e < 8; ++e) { mx = nan_max(mx, f[e]); mn = nan_min(mn, f[e]); }
  group_max_min<LANES>(mx, mn, mask);
  unsigned short sh, zh;
  int4_params(mx, mn, sh, zh);
  const unsigned int w = int4_pack8(f, h2f(sh), h2f(zh));
  unsigned char* out = static_cast<unsigned char*>(is_v ? p.v_out : p.k_out);
  reinterpret_cast<unsigned int*>(out + r * (p.head_dim / 2))[j] = w;
  if (j % LANES == 0) {
    const long long g = r * (p.head_dim / G) + j / LANES;
    (is_v ? p.v_scale : p.k_scale)[g] = sh;
    (is_v ? p.v_zero : p.k_zero)[g] = zh;
  }
}

template <int FMT>
__global__ void __launch_bounds__(QUANT_THREADS) dequant_fp8(const DequantKVParams p) {
  long long r;
  int j;
  if (!thread_vec(p.rows, p.head_dim / 8, r, j)) return;
  int b, h;
  long long n;
  row_bhn(r, p.seqlen, p.heads, p.hnd, b, h, n);
  const float descale = p.per_tensor ? p.descale[0] : p.descale[b * p.heads + h];
  const uint2 c = reinterpret_cast<const uint2*>(static_cast<const unsigned char*>(p.codes) + r * p.head_dim)[j];
  float f[8];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    f[e] = f32_mul(fp8_to_f32<FMT>((c.x >> (8 * e)) & 0xffu), descale);
    f[e + 4] = f32_mul(fp8_to_f32<FMT>((c.y >> (8 * e)) & 0xffu), descale);
  }
  float4* out = reinterpret_cast<float4*>(p.out + r * p.head_dim + j * 8);
  out[0] = make_float4(f[0], f[1], f[2], f[3]);
  out[1] = make_float4(f[4], f[5], f[6], f[7]);
}

template <int G>
__global__ void __launch_bounds__(QUANT_THREADS) dequant_int4(const DequantKVParams p) {
  long long r;
  int j;
  if (!thread_vec(p.rows, p.head_dim / 8, r, j)) return;
  const long long g = r * (p.head_dim / G) + (j * 8) / G;
  const unsigned short sh = p.scale[g], zh = p.zero[g];
  const unsigned int w = reinterpret_cast<const unsigned int*>(static_cast<const unsigned char*>(p.codes) +
                                                               r * (p.head_dim / 2))[j];
  float f[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = int4_dequant((w >> (4 * e)) & 0xfu, sh, zh);
  float4* out = reinterpret_cast<float4*>(p.out + r * p.head_dim + j * 8);
  out[0] = make_float4(f[0], f[1], f[2], f[3]);
  out[1] = make_float4(f[4], f[5], f[6], f[7]);
}

}  // namespace fdpp
