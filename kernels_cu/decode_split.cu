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
// Kernels: decode_split (CUDA cores, any dtype), decode_split_mma (tensor cores, fp16/bf16, head
// dim 64/128/256), decode_nosplit (baseline, grid batch x q heads).
//
// Measured on an NVIDIA H200, llama3-8b heads (32 q / 8 kv, D=128, fp16, B=1), CUDA-graph replay,
// floor = stream_read of the same bytes (results/probe_h200_split_sweep.log, results/attn_*.csv):
//   decode_split   w8 s3 u4, 16 splits:  74.1 us at N=64k (1.26 x floor): instruction-bound
//                  (~65 warp-instructions per token: fp32 FMAs, conversions, shuffles)
//   decode_split_mma w4 s3 u1, 16 splits: 66.2 us at N=64k (1.09 x floor), 10.1 us at 4k,
//                  240.8 us at 256k (1.02 x); cuDNN SDPA 67.4 / 11.6 / 246.9 us
//   decode_nosplit w4 s2 u2:            1581.6 us at N=64k (one CTA per head: 32 of 132 SMs busy)
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

// Merge the per-warp states red[w][g] = (acc[HEAD_DIM], m, l) (written by every warp, followed by a
// barrier) and write the final output (num_splits == 1) or this split's partial.
template <typename DType, int HEAD_DIM, int G, int NUM_WARPS>
__device__ __forceinline__ void store_merged(const DecodeArgs& a, const float* red, int b, int h0,
                                             int split) {
  using TT = TypeTraits<DType>;
  constexpr int THREADS = NUM_WARPS * 32;
  for (int idx = threadIdx.x; idx < G * HEAD_DIM; idx += THREADS) {
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

  store_merged<DType, HEAD_DIM, G, NUM_WARPS>(a, red, b, h0, split);
}


// ---- Tensor-core variant (fp16 / bf16): decode_split_mma ------------------------------------
// Same contract as attend_chunk. Per warp and 16-token block: S = Q K^T with mma.sync m16n8k16
// (M = query heads of the group, padded to 16; N = tokens; K = head dim), online softmax on the
// accumulator fragment, then O += P V (M = heads, N = head dim, K = the 16 tokens), P reused from
// registers (FlashAttention-2 style). K/V tiles are copied cooperatively with cp.async into
// shared memory (16-byte chunks XOR-swizzled by row against ldmatrix bank conflicts),
// NUM_STAGES deep. A tile is NUM_WARPS * 16 * UNROLL tokens; warp w owns UNROLL 16-token blocks.
template <typename DType, int HEAD_DIM, int GROUP_SIZE, int NUM_WARPS, int NUM_STAGES, int UNROLL>
__device__ __forceinline__ void attend_chunk_mma(const DecodeArgs& a, int b, int h0, int kvh,
                                                 int split, int start, int end, uint4* smem) {
  static_assert(GROUP_SIZE <= 8, "heads of a group live in MMA rows 0..7");
  static_assert(HEAD_DIM % 64 == 0, "mma path: HEAD_DIM in {64, 128, 256}");
  static_assert(NUM_STAGES >= 2, "mma path pipelines at least two stages");
  using TT = TypeTraits<DType>;
  using MM = Mma<DType>;
  constexpr int G = GROUP_SIZE, THREADS = NUM_WARPS * 32;
  constexpr int CPR = HEAD_DIM / 8;                    // 16-byte chunks per row
  constexpr int TILE = NUM_WARPS * 16 * UNROLL;         // tokens per stage
  constexpr int STAGE_CHUNKS = TILE * CPR;              // per K (and per V) tile
  static_assert(STAGE_CHUNKS % THREADS == 0, "loader: chunks must divide among threads");
  constexpr int KSTEPS = HEAD_DIM / 16, NT = HEAD_DIM / 8;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const DType* kbase = static_cast<const DType*>(a.k) + b * a.k_sb + kvh * a.k_sh;
  const DType* vbase = static_cast<const DType*>(a.v) + b * a.v_sb + kvh * a.v_sh;
  const int ntiles = end > start ? (end - start + TILE - 1) / TILE : 0;

  auto swz = [](int row, int chunk) { return row * CPR + (chunk ^ (row & 7)); };
  static_assert(THREADS % CPR == 0, "loader: a thread keeps one chunk column");
  constexpr int ROWSTEP = THREADS / CPR;  // rows covered by one pass of all threads
  const int lrow = tid / CPR, lch = tid % CPR;
  auto load_tile = [&](int t, int stage) {
    uint4* ks = smem + stage * 2 * STAGE_CHUNKS;
    uint4* vs = ks + STAGE_CHUNKS;
    const int tok0 = start + t * TILE + lrow;
    const DType* kp = kbase + (long long)tok0 * a.k_sn + lch * 8;
    const DType* vp = vbase + (long long)tok0 * a.v_sn + lch * 8;
#pragma unroll
    for (int i = 0; i < TILE / ROWSTEP; ++i) {
      const int row = i * ROWSTEP + lrow;
      const bool ok = tok0 + i * ROWSTEP < end;
      cp_async16(ks + swz(row, lch), ok ? kp + (long long)i * ROWSTEP * a.k_sn : kbase, ok ? 16 : 0);
      cp_async16(vs + swz(row, lch), ok ? vp + (long long)i * ROWSTEP * a.v_sn : vbase, ok ? 16 : 0);
    }
  };

#pragma unroll
  for (int s = 0; s < NUM_STAGES - 1; ++s) {
    if (s < ntiles) load_tile(s, s);
    cp_async_commit();
  }

  // Q as the A operand: rows = heads (lane/4 < G valid), 2 packed elements per register.
  const int qrow = lane / 4, qcol = 2 * (lane % 4);
  unsigned qa[KSTEPS][2];
  {
    const DType* qp = static_cast<const DType*>(a.q) + b * a.q_sb + (h0 + (qrow < G ? qrow : 0)) * a.q_sh;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d = ks * 16 + half * 8 + qcol;
        const float x0 = qrow < G ? TT::load(qp + d) : 0.f;
        const float x1 = qrow < G ? TT::load(qp + d + 1) : 0.f;
        qa[ks][half] = MM::pack(x0, x1);  // exact: x0, x1 came from DType
      }
  }

  float o[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m = neg_inf(), l = 0.f;  // for head row qrow (rows 8..15 are padding)

  for (int t = 0; t < ntiles; ++t) {
    cp_async_wait<NUM_STAGES - 2>();
    __syncthreads();  // tile t visible to all warps; all warps are done with tile t-1
    {
      const int tl = t + NUM_STAGES - 1;
      if (tl < ntiles) load_tile(tl, tl % NUM_STAGES);
      cp_async_commit();
    }
    const uint4* ks_ = smem + (t % NUM_STAGES) * 2 * STAGE_CHUNKS;
    const uint4* vs_ = ks_ + STAGE_CHUNKS;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int r0 = (warp * UNROLL + u) * 16;  // first row of this warp's block in the tile
      float sc[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        unsigned r[4];
        const int row = r0 + ((lane >> 4) & 1) * 8 + (lane & 7);
        const int ch = kk * 2 + ((lane >> 3) & 1);
        ldmatrix_x4(r, ks_ + swz(row, ch));
        MM::run(sc[0], qa[kk][0], 0u, qa[kk][1], 0u, r[0], r[1]);
        MM::run(sc[1], qa[kk][0], 0u, qa[kk][1], 0u, r[2], r[3]);
      }
      // scores of head qrow for tokens n*8 + qcol + {0,1}
      const int tok0 = start + t * TILE + r0 + qcol;
      float mx = m;
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float x = sc[n][j] * a.scale_log2;
          sc[n][j] = tok0 + n * 8 + j < end ? x : neg_inf();
          mx = fmaxf(mx, sc[n][j]);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mref = mx == neg_inf() ? 0.f : mx;
      const float alpha = fast_exp2(m - mref);
      m = mx;
      float p[2][2];
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int j = 0; j < 2; ++j) p[n][j] = fast_exp2(sc[n][j] - mref);
      l = l * alpha + (p[0][0] + p[0][1] + p[1][0] + p[1][1]);
#pragma unroll
      for (int n = 0; n < NT; ++n) { o[n][0] *= alpha; o[n][1] *= alpha; }
      const unsigned pa0 = MM::pack(p[0][0], p[0][1]);  // tokens qcol, qcol+1
      const unsigned pa2 = MM::pack(p[1][0], p[1][1]);  // tokens 8+qcol, 8+qcol+1
#pragma unroll
      for (int n = 0; n < NT; n += 2) {
        unsigned r[4];
        const int row = r0 + ((lane >> 3) & 1) * 8 + (lane & 7);
        const int ch = n + (lane >> 4);
        ldmatrix_x4_trans(r, vs_ + swz(row, ch));
        MM::run(o[n], pa0, 0u, pa2, 0u, r[0], r[1]);
        MM::run(o[n + 1], pa0, 0u, pa2, 0u, r[2], r[3]);
      }
    }
  }
  cp_async_wait<0>();
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);

  float* red = reinterpret_cast<float*>(smem);
  __syncthreads();  // every warp is past its last ldmatrix: reuse the stages for the merge
  if (qrow < G) {
    float* w = red + (warp * G + qrow) * (HEAD_DIM + 2);
    if (lane % 4 == 0) { w[HEAD_DIM] = m; w[HEAD_DIM + 1] = l; }
#pragma unroll
    for (int n = 0; n < NT; ++n) { w[n * 8 + qcol] = o[n][0]; w[n * 8 + qcol + 1] = o[n][1]; }
  }
  __syncthreads();
  store_merged<DType, HEAD_DIM, G, NUM_WARPS>(a, red, b, h0, split);
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

// Tensor-core phase 1 (fp16/bf16): grid and arguments as decode_split.
template <typename DType, int HEAD_DIM, int GROUP_SIZE, int NUM_WARPS, int NUM_STAGES, int UNROLL>
__global__ void __launch_bounds__(NUM_WARPS * 32)
decode_split_mma(const void* q, const void* k, const void* v, const int* seqlens, void* out, float* lse,
 float* o_part, float* lse_part, long long q_sb, long long q_sh, long long k_sb, long long k_sn,
 long long k_sh, long long v_sb, long long v_sn, long long v_sh, int n_max, int num_q_heads,
 int ratio, int chunk, int num_splits, float scale_log2) {
  const DecodeArgs a{q, k, v, seqlens, out, lse, o_part, lse_part, q_sb, q_sh, k_sb, k_sn, k_sh,
                     v_sb, v_sn, v_sh, n_max, num_q_heads, ratio, chunk, num_splits, scale_log2};
  extern __shared__ uint4 smem[];
  const int split = blockIdx.x, b = blockIdx.z;
  const int h0 = blockIdx.y * GROUP_SIZE;
  const int len = request_length(a, b);
  const int start = split * a.chunk;
  const int end = min(start + a.chunk, len);
  attend_chunk_mma<DType, HEAD_DIM, GROUP_SIZE, NUM_WARPS, NUM_STAGES, UNROLL>(a, b, h0, h0 / a.ratio,
                                                                               split, start, end, smem);
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
