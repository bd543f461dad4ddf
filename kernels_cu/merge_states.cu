#line 2 "kernels_cu/merge_states.cu"
// Merge partial attention states (cascade / shared-prefix attention, context-parallel merge).
//
//   part s of row (b, h): out_s [D] (normalised by its own softmax sum), lse_s (natural log)
//   out = sum_s exp(lse_s - lse) * out_s,  lse = log sum_s exp(lse_s)       (fp32 accumulation)
//
// Semantics per row: lse_s = -inf is an empty part (weight 0; its out_s is not read); every part
// empty gives zeros and lse = -inf (decode_attention on a length-0 request); any lse_s that is
// NaN or +inf gives a NaN row (out and lse) and leaves every other row alone.
//
// Variants (template parameters; Python: fdpp.merge.MergeConfig, names derived there):
//   DType      fdpp::half_t | fdpp::bfloat16_t | float   (out_s and out element; lse is float)
//   HEAD_DIM   a multiple of 16 bytes' worth of elements (8 for fp16/bf16, 4 for fp32)
//   ROWS       (b, h) rows per CTA
// Launch: block ROWS * HEAD_DIM / VEC threads (VEC = 16 / sizeof(DType)), grid ceil(B*H / ROWS).
// Thread t owns 16-byte vector t % TPR of row blockIdx.x * ROWS + t / TPR. Pass 1 reads every
// part's lse (the running max, the bad flag); pass 2 reads the outputs of the non-empty parts,
// so a row reads its D-vector of each part exactly once. In place (out = out_0, lse = lse_0) is
// safe: a thread reads its own vector before writing it and lse is written after a barrier.
//
// Parts: a stacked input ([S, B, H, D] / [S, B, H]) is part pointer [0] plus s * stride_s; a
// list of up to MERGE_MAX_LIST arrays has one pointer and its own B/H strides per part. Bit 0 of
// `stacked` is for outs, bit 1 for lses.
//
// Measured: not yet (written on a machine with no GPU; checked offline for sm_80 / sm_90: zero
// spills, no stack frame, tests/test_compile.py).
#include "common.cuh"

namespace fdpp {

constexpr int MERGE_MAX_LIST = 16;

// The kernel's one argument (Python mirror: fdpp.merge.MERGE_PARAMS; tests/test_compile.py
// checks the offsets). Strides in elements.
struct MergeParams {
  const void* out_part[MERGE_MAX_LIST];   // [B, H, D] parts (list) or the [S, B, H, D] base at [0]
  const float* lse_part[MERGE_MAX_LIST];  // [B, H] parts or the [S, B, H] base at [0]
  long long o_sb[MERGE_MAX_LIST], o_sh[MERGE_MAX_LIST];
  long long l_sb[MERGE_MAX_LIST], l_sh[MERGE_MAX_LIST];
  long long o_ss, l_ss;                   // stacked inputs: stride between parts
  void* out;                              // [B, H, D], last dim contiguous
  float* lse;                             // [B, H], may be nullptr
  long long out_sb, out_sh, lse_sb, lse_sh;
  int num_parts;
  int num_heads;
  int rows;                               // B * H
  int stacked;                            // bit 0: outs stacked, bit 1: lses stacked
};

template <typename DType>
__device__ __forceinline__ uint4 pack16(const float* f) {
  constexpr int VEC = TypeTraits<DType>::VEC;
  union { uint4 u; DType e[VEC]; } r;
#pragma unroll
  for (int i = 0; i < VEC; ++i) TypeTraits<DType>::store(&r.e[i], f[i]);
  return r.u;
}

template <>
__device__ __forceinline__ uint4 pack16<float>(const float* f) {
  return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
}

__device__ __forceinline__ float part_lse(const MergeParams& p, int s, int b, int h) {
  const bool st = p.stacked & 2;
  const int k = st ? 0 : s;
  return p.lse_part[k][(st ? s * p.l_ss : 0LL) + b * p.l_sb[k] + h * p.l_sh[k]];
}

template <typename DType>
__device__ __forceinline__ const uint4* part_out(const MergeParams& p, int s, int b, int h) {
  const bool st = p.stacked & 1;
  const int k = st ? 0 : s;
  const DType* base = static_cast<const DType*>(p.out_part[k]);
  return reinterpret_cast<const uint4*>(base + (st ? s * p.o_ss : 0LL) + b * p.o_sb[k] + h * p.o_sh[k]);
}

template <typename DType, int HEAD_DIM, int ROWS>
__global__ void __launch_bounds__(ROWS * HEAD_DIM / TypeTraits<DType>::VEC)
merge_states(const MergeParams p) {
  constexpr int VEC = TypeTraits<DType>::VEC;
  static_assert(HEAD_DIM % VEC == 0, "HEAD_DIM must be a whole number of 16-byte vectors");
  constexpr int TPR = HEAD_DIM / VEC;  // threads per row
  static_assert(ROWS >= 1 && ROWS * TPR <= 1024, "at most 1024 threads per CTA");
  constexpr float LOG2E = 1.4426950408889634f;
  const int lane = threadIdx.x % TPR;
  const int row = blockIdx.x * ROWS + threadIdx.x / TPR;
  const bool live = row < p.rows;
  const int b = live ? row / p.num_heads : 0, h = live ? row % p.num_heads : 0;
  const int n = live ? p.num_parts : 0;

  // Pass 1: every part's lse (the max, and whether any is NaN or +inf).
  float m = neg_inf();
  bool bad = false;
#pragma unroll 4
  for (int s = 0; s < n; ++s) {
    const float l = part_lse(p, s, b, h);
    bad |= !(l <= 3.402823466e38f) && l != neg_inf();  // NaN or +inf
    m = fmaxf(m, l);
  }
  // Pass 2: the outputs of the non-empty parts, weighted by exp(lse_s - m).
  float acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
  float total = 0.f;
  if (!bad && m != neg_inf()) {
#pragma unroll 4
    for (int s = 0; s < n; ++s) {
      const float l = part_lse(p, s, b, h);
      if (l == neg_inf()) continue;  // empty part: not read
      const uint4 u = part_out<DType>(p, s, b, h)[lane];
      float x[VEC];
      TypeTraits<DType>::unpack(u, x);
      const float w = fast_exp2((l - m) * LOG2E);
      total += w;
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] = fmaf(w, x[i], acc[i]);
    }
  }
  float res;  // the row's lse
  if (bad) {
    res = __int_as_float(0x7fc00000);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = res;
  } else if (m == neg_inf()) {  // every part empty (acc is zero)
    res = neg_inf();
  } else {
    const float inv = 1.f / total;  // total >= 1: the max part has weight 1
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] *= inv;
    res = m + logf(total);
  }
  if (live) {
    DType* op = static_cast<DType*>(p.out) + b * p.out_sb + h * p.out_sh;
    reinterpret_cast<uint4*>(op)[lane] = pack16<DType>(acc);
  }
  __syncthreads();  // in place: every thread of the row has read lse_0 before it is overwritten
  if (live && lane == 0 && p.lse != nullptr) p.lse[b * p.lse_sb + h * p.lse_sh] = res;
}

}  // namespace fdpp
