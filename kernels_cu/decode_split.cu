#line 2 "kernels_cu/decode_split.cu"
// Phase 1 of split-KV decode attention, and the no-split baseline.
//
// Variants (template parameters; Python: fdpp.configs.DecodeConfig, names derived there):
//   DType       fdpp::half_t | fdpp::bfloat16_t | float  (q, K, V and out share it)
//   HEAD_DIM    64 | 96 | 128 | 256
//   GROUP_SIZE  query heads served by one CTA; they share one KV head (GQA packing: a KV chunk is
//               read from memory once for all of them). Divides Hq/Hkv.
//   NUM_WARPS   warps per CTA
//   NUM_STAGES  cp.async pipeline depth (1 = load then compute, no overlap inside the CTA)
//   UNROLL      KV rows per thread per pipeline stage; tile = UNROLL * (NUM_WARPS*32 / TPR) tokens
// The chunk each CTA owns (tokens per split) is a launch-time value, so any num_splits works
// without recompiling.
//
// Thread layout: a KV row (one token, HEAD_DIM elements) is read by TPR threads, each holding NV
// 16-byte vectors; q.k partial dots are summed across those TPR lanes by xor-shuffles. Each group of
// TPR threads ("row") keeps its own online-softmax state (m, l, acc) for every query head of the
// group; rows are merged once at the end (shuffles inside a warp, shared memory across warps).
// Scores are kept in the log2 domain (q is pre-scaled by softmax_scale * log2 e).
//
// Measured (H200, see results/): filled in from fdpp.bench runs.
#include "common.cuh"

namespace fdpp {

template <typename DType, int HEAD_DIM, int NUM_WARPS>
struct RowLayout {
  static constexpr int VEC = TypeTraits<DType>::VEC;
  static_assert(HEAD_DIM % VEC == 0, "HEAD_DIM must be a multiple of the 16-byte vector width");
  static constexpr int VECS_PER_ROW = HEAD_DIM / VEC;
  static constexpr int NV = (VECS_PER_ROW + 31) / 32;                      // vectors per thread
  static constexpr int TPR = ceil_pow2((VECS_PER_ROW + NV - 1) / NV);      // threads per row
  static constexpr int E = NV * VEC;                                       // elements per thread
  static constexpr int THREADS = NUM_WARPS * 32;
  static constexpr int ROWS = THREADS / TPR;                               // rows per CTA step
  static_assert(TPR <= 32 && 32 % TPR == 0, "a row must fit in one warp");
};

struct DecodeArgs {
  const void* q; const void* k; const void* v; const int* seqlens;
  void* out; float* lse; float* o_part; float* lse_part;
  long long q_sb, q_sh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh;
  int n_max, num_q_heads, ratio, chunk, num_splits;
  float scale_log2;
};

// Computes attention of GROUP_SIZE query heads (h0 .. h0+G-1) of request b over KV head kvh,
// tokens [start, end); writes either the final output (num_splits == 1) or a partial.
template <typename DType, int HEAD_DIM, int GROUP_SIZE, int NUM_WARPS, int NUM_STAGES, int UNROLL>
__device__ __forceinline__ void attend_chunk(const DecodeArgs& a, int b, int h0, int kvh, int split,
                                             int start, int end, uint4* smem) {
  using L = RowLayout<DType, HEAD_DIM, NUM_WARPS>;
  using TT = TypeTraits<DType>;
  constexpr int G = GROUP_SIZE, E = L::E, NV = L::NV, TPR = L::TPR, VEC = L::VEC;
  constexpr int THREADS = L::THREADS, ROWS = L::ROWS, TILE = ROWS * UNROLL;
  static_assert(NUM_STAGES >= 1 && UNROLL >= 1, "bad pipeline shape");

  const int tid = threadIdx.x;
  const int lane_r = tid % TPR;
  const int row = tid / TPR;

  // q for the group, in registers, pre-scaled into the log2 domain.
  float q[G][E];
  const DType* qp = static_cast<const DType*>(a.q) + b * a.q_sb;
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const int d = (j * TPR + lane_r) * VEC + i;
        q[g][j * VEC + i] = d < HEAD_DIM ? TT::load(qp + (h0 + g) * a.q_sh + d) * a.scale_log2 : 0.f;
      }

  float m[G], l[G], acc[G][E];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = neg_inf(); l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
  }

  const DType* kbase = static_cast<const DType*>(a.k) + b * a.k_sb + kvh * a.k_sh;
  const DType* vbase = static_cast<const DType*>(a.v) + b * a.v_sb + kvh * a.v_sh;
  const int ntiles = end > start ? (end - start + TILE - 1) / TILE : 0;

  // smem slot of (stage, u, k-or-v, j) for this thread: thread-private, consecutive threads in
  // consecutive 16-byte words (no bank conflicts, no barrier needed in the main loop).
  auto slot = [&](int stage, int u, int kv, int j) -> uint4* {
    return smem + (((stage * UNROLL + u) * 2 + kv) * NV + j) * THREADS + tid;
  };
  auto load_tile = [&](int t, int stage) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int tok = start + t * TILE + u * ROWS + row;
      const bool ok_tok = tok < end;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int d = (j * TPR + lane_r) * VEC;
        const bool ok = ok_tok && d < HEAD_DIM;
        const DType* ks = ok ? kbase + (long long)tok * a.k_sn + d : kbase;
        const DType* vs = ok ? vbase + (long long)tok * a.v_sn + d : vbase;
        cp_async16(slot(stage, u, 0, j), ks, ok ? 16 : 0);
        cp_async16(slot(stage, u, 1, j), vs, ok ? 16 : 0);
      }
    }
  };

#pragma unroll
  for (int s = 0; s < NUM_STAGES - 1; ++s) {
    if (s < ntiles) load_tile(s, s);
    cp_async_commit();
  }

  for (int t = 0; t < ntiles; ++t) {
    {
      const int tl = t + NUM_STAGES - 1;
      if (tl < ntiles) load_tile(tl, tl % NUM_STAGES);
      cp_async_commit();
    }
    cp_async_wait<NUM_STAGES - 1>();
    const int stage = t % NUM_STAGES;

    float s[UNROLL][G];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float kf[E];
#pragma unroll
      for (int j = 0; j < NV; ++j) TT::unpack(*slot(stage, u, 0, j), kf + j * VEC);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float d0 = 0.f, d1 = 0.f;
#pragma unroll
        for (int e = 0; e < E; e += 2) { d0 = fmaf(q[g][e], kf[e], d0); d1 = fmaf(q[g][e + 1], kf[e + 1], d1); }
        s[u][g] = d0 + d1;
      }
    }
#pragma unroll
    for (int off = TPR / 2; off >= 1; off /= 2)
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int g = 0; g < G; ++g) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], off);

#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const bool ok = start + t * TILE + u * ROWS + row < end;
#pragma unroll
      for (int g = 0; g < G; ++g) s[u][g] = ok ? s[u][g] : neg_inf();
    }

#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mt = m[g];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) mt = fmaxf(mt, s[u][g]);
      const float mref = mt == neg_inf() ? 0.f : mt;  // all masked so far: keep state at zero
      const float alpha = fast_exp2(m[g] - mref);
      m[g] = mt;
      float psum = 0.f;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) { s[u][g] = fast_exp2(s[u][g] - mref); psum += s[u][g]; }
      l[g] = l[g] * alpha + psum;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] *= alpha;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float vf[E];
#pragma unroll
      for (int j = 0; j < NV; ++j) TT::unpack(*slot(stage, u, 1, j), vf + j * VEC);
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = fmaf(s[u][g], vf[e], acc[g][e]);
    }
  }
  cp_async_wait<0>();

  // Merge the rows of each warp (lanes with equal lane_r), by xor-shuffles over the row bits.
#pragma unroll
  for (int off = TPR; off < 32; off *= 2) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float lo = __shfl_xor_sync(0xffffffffu, l[g], off);
      const float mn = fmaxf(m[g], mo);
      const float mref = mn == neg_inf() ? 0.f : mn;
      const float sa = fast_exp2(m[g] - mref), sb = fast_exp2(mo - mref);
      m[g] = mn;
      l[g] = l[g] * sa + lo * sb;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float ao = __shfl_xor_sync(0xffffffffu, acc[g][e], off);
        acc[g][e] = acc[g][e] * sa + ao * sb;
      }
    }
  }

  // Across warps through shared memory: per warp, G * (HEAD_DIM + 2) floats.
  float* red = reinterpret_cast<float*>(smem);
  const int warp = tid / 32;
  __syncthreads();  // pipeline buffers are free (every thread passed cp_async_wait<0>)
  if (tid % 32 < TPR) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float* w = red + (warp * G + g) * (HEAD_DIM + 2);
      if (lane_r == 0) { w[HEAD_DIM] = m[g]; w[HEAD_DIM + 1] = l[g]; }
#pragma unroll
      for (int j = 0; j < NV; ++j)
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const int d = (j * TPR + lane_r) * VEC + i;
          if (d < HEAD_DIM) w[d] = acc[g][j * VEC + i];
        }
    }
  }
  __syncthreads();

  for (int idx = tid; idx < G * HEAD_DIM; idx += THREADS) {
    const int g = idx / HEAD_DIM, d = idx % HEAD_DIM;
    float mx = neg_inf();
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) mx = fmaxf(mx, red[(w * G + g) * (HEAD_DIM + 2) + HEAD_DIM]);
    const float mref = mx == neg_inf() ? 0.f : mx;
    float lsum = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float* r = red + (w * G + g) * (HEAD_DIM + 2);
      const float sc = fast_exp2(r[HEAD_DIM] - mref);
      lsum += r[HEAD_DIM + 1] * sc;
      o += r[d] * sc;
    }
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    const float lse2 = lsum > 0.f ? mref + __log2f(lsum) : neg_inf();
    const long long bh = (long long)b * a.num_q_heads + h0 + g;
    if (a.num_splits == 1) {
      TT::store(static_cast<DType*>(a.out) + bh * HEAD_DIM + d, o * inv);
      if (d == 0 && a.lse != nullptr) a.lse[bh] = lse2 * 0.69314718055994531f;
    } else {
      a.o_part[(bh * a.num_splits + split) * HEAD_DIM + d] = o * inv;
      if (d == 0) a.lse_part[bh * a.num_splits + split] = lse2;
    }
  }
}

__device__ __forceinline__ int request_length(const DecodeArgs& a, int b) {
  if (a.seqlens == nullptr) return a.n_max;
  const int n = a.seqlens[b];
  return n < 0 ? 0 : (n > a.n_max ? a.n_max : n);  // never read outside the cache
}

// grid (num_splits, num_q_heads / GROUP_SIZE, batch); block NUM_WARPS * 32.
template <typename DType, int HEAD_DIM, int GROUP_SIZE, int NUM_WARPS, int NUM_STAGES, int UNROLL>
__global__ void __launch_bounds__(NUM_WARPS * 32)
decode_split(const void* q, const void* k, const void* v, const int* seqlens, void* out, float* lse,
 float* o_part, float* lse_part, long long q_sb, long long q_sh, long long k_sb, long long k_sn,
 long long k_sh, long long v_sb, long long v_sn, long long v_sh, int n_max, int num_q_heads,
 int ratio, int chunk, int num_splits, float scale_log2) {
  // Flat parameters (plain scalars and pointers, so any launcher can pass them); gathered here.
  const DecodeArgs a{q, k, v, seqlens, out, lse, o_part, lse_part, q_sb, q_sh, k_sb, k_sn, k_sh,
                     v_sb, v_sn, v_sh, n_max, num_q_heads, ratio, chunk, num_splits, scale_log2};
  extern __shared__ uint4 smem[];
  const int split = blockIdx.x, b = blockIdx.z;
  const int h0 = blockIdx.y * GROUP_SIZE;
  const int kvh = h0 / a.ratio;
  const int len = request_length(a, b);
  const int start = split * a.chunk;
  const int end = min(start + a.chunk, len);
  attend_chunk<DType, HEAD_DIM, GROUP_SIZE, NUM_WARPS, NUM_STAGES, UNROLL>(a, b, h0, kvh, split, start,
                                                                           end, smem);
}

// The no-split baseline (FlashAttention-2-style decode): grid (1, num_q_heads, batch), one query
// head per CTA, the whole sequence in one pass. Leaves SMs idle when batch * heads is small.
template <typename DType, int HEAD_DIM, int NUM_WARPS, int NUM_STAGES, int UNROLL>
__global__ void __launch_bounds__(NUM_WARPS * 32)
decode_nosplit(const void* q, const void* k, const void* v, const int* seqlens, void* out, float* lse,
 float* o_part, float* lse_part, long long q_sb, long long q_sh, long long k_sb, long long k_sn,
 long long k_sh, long long v_sb, long long v_sn, long long v_sh, int n_max, int num_q_heads,
 int ratio, int chunk, int num_splits, float scale_log2) {
  // Flat parameters (plain scalars and pointers, so any launcher can pass them); gathered here.
  const DecodeArgs a{q, k, v, seqlens, out, lse, o_part, lse_part, q_sb, q_sh, k_sb, k_sn, k_sh,
                     v_sb, v_sn, v_sh, n_max, num_q_heads, ratio, chunk, num_splits, scale_log2};
  extern __shared__ uint4 smem[];
  const int h = blockIdx.y, b = blockIdx.z;
  attend_chunk<DType, HEAD_DIM, 1, NUM_WARPS, NUM_STAGES, UNROLL>(a, b, h, h / a.ratio, 0, 0,
                                                                  request_length(a, b), smem);
}

}  // namespace fdpp
