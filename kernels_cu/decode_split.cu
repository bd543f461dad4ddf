#line 2 "kernels_cu/decode_split.cu"
// Phase 1 of split-KV decode attention, and the no-split baseline.
//
// Variants (template parameters; Python: fdpp.configs.DecodeConfig, names derived there):
//   DTypeQ      fdpp::half_t | fdpp::bfloat16_t | float  (q and out)
//   DTypeKV     the K/V element (the KV-type policy: KvDecode<DTypeKV> in common.cuh turns 16-byte
//               vectors into numbers): DTypeQ, or fdpp::fp8_e4m3_t / fp8_e5m2_t (FP8 codes, the
//               dequantisation scales given at launch; q fp16/bf16), or fdpp::int4_t<G> (INT4 code
//               pairs with fp16 scale / zero per G elements of a row; decode_split_mma only)
//   Cache       fdpp::Contiguous | fdpp::PagedCache<PAGE_SIZE> (the cache-access policy,
//               kernels_cu/kv_cache.cuh), PAGE_SIZE a power of two 1..256
//   HEAD_DIM    64 | 96 | 128 | 256
//   GROUP_SIZE  query heads served by one CTA; they share one KV head (GQA packing: a KV chunk is
//               read from memory once for all of them). Divides Hq/Hkv.
//   NUM_WARPS   warps per CTA
//   NUM_STAGES  cp.async pipeline depth (1 = load then compute, no overlap inside the CTA)
//   UNROLL      KV rows per thread per pipeline stage; tile = UNROLL * (NUM_WARPS*32 / TPR) tokens
//   CLUSTER     decode_split_mma_cluster only: the split count, one thread-block cluster (2..16)
// Every kernel takes one DecodeParams (kv_cache.cuh). The chunk each CTA owns (tokens per split)
// is a launch-time value, so any num_splits works without recompiling.
//
// Thread layout: a KV row (one token, HEAD_DIM elements) is read by TPR threads, each holding NV
// 16-byte vectors; q.k partial dots are summed across those TPR lanes by xor-shuffles. Each group of
// TPR threads ("row") keeps its own online-softmax state (m, l, acc) for every query head of the
// group; rows are merged once at the end (shuffles inside a warp, shared memory across warps).
// Scores are kept in the log2 domain (q is pre-scaled by softmax_scale * log2 e). Row addresses
// of a tile are located (block table read, for a paged cache) one tile ahead of their copies.
//
// Kernels: decode_split (CUDA cores, any dtype), decode_split_mma (tensor cores, fp16/bf16, head
// dim 64/128/256), decode_split_mma_cluster (the same, its CLUSTER splits merged inside a thread-
// block cluster, sm_90), decode_split_mma_umax / decode_split_mma_cluster_umax (the same with
// softmax_mode "unified_max": UMAX in attend_chunk_mma), decode_nosplit (baseline, grid batch x q heads).
//
// Measured on an NVIDIA H200, llama3-8b heads (32 q / 8 kv, D=128, fp16, B=1), CUDA-graph replay,
// floor = stream_read of the same bytes (results/probe_h200_split_sweep.log, results/attn_*.csv),
// contiguous cache, before the cache-policy refactor (results/ has the re-measured figures):
//   decode_split   w8 s3 u4, 16 splits:  74.1 us at N=64k (1.26 x floor): instruction-bound
//                  (~65 warp-instructions per token: fp32 FMAs, conversions, shuffles)
//   decode_split_mma w4 s3 u1, 16 splits: 66.2 us at N=64k (1.09 x floor), 10.1 us at 4k,
//                  240.8 us at 256k (1.02 x); cuDNN SDPA 67.4 / 11.6 / 246.9 us
//   decode_nosplit w4 s2 u2:            1581.6 us at N=64k (one CTA per head: 32 of 132 SMs busy)
// After the cache-policy refactor, shipped tuned table, same card (results/device_runB/):
//   contiguous decode_split_mma: 7.69 / 11.08 / 22.22 / 65.84 us at N = 1k / 4k / 16k / 64k, B=1
//                  (within 1 % of the figures before the refactor at B = 1, 8, 64)
//   PagedCache<16> (pages shuffled), mostly w8 s3 u1: 8.12 / 12.25 / 23.95 / 68.22 us, B=1;
//   PagedCache<1>: 8.11 / 12.66 / 28.87 / 72.81 us (a block-table entry per row); FlashInfer
//                  0.5.3 paged, same pages: 9.16 / 13.68 / 26.11 / 71.44 (page 16)
// The fused merge (later) brought a static __shared__ word that put the dynamic buffer off 128-byte
// alignment and cost every variant 10-15 % until it moved into the dynamic buffer (runs H1-H3).
// Since (results/device_runH5/, re-tuned table): contiguous 7.35 / 9.96 / 21.36 / 65.50 us at
// N = 1k / 4k / 16k / 64k, B=1 (cuDNN SDPA 7.47 / 11.59 / 23.27 / 68.03); B=8, 64k: 472.89 us
// (floor 473.08); PagedCache<16>, shuffled: 8.47 / 12.05 / 23.64 / 69.12 us, B=1.
// With programmatic dependent launch (run J2's table, results/device_runJ6/): contiguous 7.34 / 9.97 /
// 21.63 / 64.26 us plainly launched, 6.15 / 8.92 / 20.96 / 64.67 with PDL for every call (run J3);
// the default gives PDL to calls of at most 64 MiB of K/V: 6.15 / 8.93 / 20.99 / 65.54 (run K5).
// With the cluster merge in the tuner's search (run M1's table, results/device_runM1/): 5.07 / 8.45 /
// 20.68 / 65.44 us (cluster of 8 at 1k and 4k; cuDNN SDPA 7.50 / 11.52 / 23.28 / 67.59).
#include "merge.cuh"

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

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// The 8x8 b16 matrix whose row lane/4, columns 2(lane%4) and +1, each lane holds in x, transposed:
// the lane gets row lane/4 of the transpose (sm_75+).
__device__ __forceinline__ unsigned movmatrix_trans(unsigned x) {
  unsigned y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// Merge the per-warp states red[w][g] = (acc[HEAD_DIM], m, l) (written by every warp, followed by a
// barrier) and write the final output (num_splits == 1) or this split's partial.
// A CTA that met a bad page index or a bad request length (bad) writes NaN.
template <typename DTypeQ, int HEAD_DIM, int G, int NUM_WARPS>
__device__ __forceinline__ void store_merged(const DecodeParams& a, const float* red, int b, int h0,
                                             int split, bool bad, float vds) {
  using TT = TypeTraits<DTypeQ>;
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
    // lsum is NaN when a score or q was NaN/Inf (inf - inf): the partial is poisoned, never empty
    const bool poisoned = bad || !(lsum >= 0.f);
    const float inv = poisoned ? quiet_nan() : (lsum > 0.f ? vds / lsum : 0.f);  // V's descale folded in
    const float lse2 = poisoned ? quiet_nan() : (lsum > 0.f ? mref + __log2f(lsum) : neg_inf());
    const long long bh = (long long)b * a.num_q_heads + h0 + g;
    if (a.num_splits == 1) {
      TT::store(static_cast<DTypeQ*>(a.out) + bh * HEAD_DIM + d, o * inv);
      if (d == 0 && a.lse != nullptr) a.lse[bh] = lse2 * 0.69314718055994531f;
    } else {
      a.o_part[(bh * a.num_splits + split) * HEAD_DIM + d] = o * inv;
      if (d == 0) a.lse_part[bh * a.num_splits + split] = lse2;
    }
  }
}

// Computes attention of GROUP_SIZE query heads (h0 .. h0+G-1) of request b over KV head kvh,
// tokens [start, end); writes either the final output (num_splits == 1) or a partial (NaN when
// bad is set on entry or a page index is out of the pool).
template <typename DTypeQ, typename DTypeKV, typename Cache, int HEAD_DIM, int GROUP_SIZE,
          int NUM_WARPS, int NUM_STAGES, int UNROLL>
__device__ __forceinline__ void attend_chunk(const DecodeParams& a, int b, int h0, int kvh, int split,
                                             int start, int end, int cap, bool bad, uint4* smem) {
  using L = RowLayout<DTypeKV, HEAD_DIM, NUM_WARPS>;
  using TQ = TypeTraits<DTypeQ>;
  constexpr int G = GROUP_SIZE, E = L::E, NV = L::NV, TPR = L::TPR, VEC = L::VEC;
  constexpr int THREADS = L::THREADS, ROWS = L::ROWS, TILE = ROWS * UNROLL;
  static_assert(NUM_STAGES >= 1 && UNROLL >= 1, "bad pipeline shape");

  const int tid = threadIdx.x;
  const int lane_r = tid % TPR;
  const int row = tid / TPR;

  // q for the group, in registers, pre-scaled into the log2 domain (and by K's descale).
  using dec = KvDecode<DTypeKV>;
  const float2 ds = kv_descales<DTypeKV>(a, b, kvh);
  const float qscale = a.scale_log2 * ds.x;
  float q[G][E];
  const DTypeQ* qp = static_cast<const DTypeQ*>(a.q) + b * a.q_sb;
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const int d = (j * TPR + lane_r) * VEC + i;
        q[g][j * VEC + i] = d < HEAD_DIM ? TQ::load(qp + (h0 + g) * a.q_sh + d) * qscale : 0.f;
      }

  float m[G], l[G], acc[G][E];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = neg_inf(); l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
  }

  const CacheOf<Cache, DTypeKV> kv(a, b, kvh);
  const DTypeKV* safe = static_cast<const DTypeKV*>(a.k);  // a valid address for zero-fill copies
  const int ntiles = end > start ? (end - start + TILE - 1) / TILE : 0;

  // smem slot of (stage, u, k-or-v, j) for this thread: thread-private, consecutive threads in
  // consecutive 16-byte words (no bank conflicts, no barrier needed in the main loop).
  auto slot = [&](int stage, int u, int kv, int j) -> uint4* {
    return smem + (((stage * UNROLL + u) * 2 + kv) * NV + j) * THREADS + tid;
  };
  int loc[UNROLL];  // block-table entries of the next tile's rows (unvalidated until used)
  auto locate_tile = [&](int t) {  // rows past the chunk read the last row's entry: no branch
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) loc[u] = kv.fetch(min(start + t * TILE + u * ROWS + row, cap - 1));
  };
  auto load_tile = [&](int t, int stage) {  // uses loc[] of tile t
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int tok = start + t * TILE + u * ROWS + row;
      const bool ok_tok = tok < end;
      const int pg = ok_tok ? kv.page(loc[u], bad) : 0;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int d = (j * TPR + lane_r) * VEC;
        const bool ok = ok_tok && d < HEAD_DIM;
        cp_async16(slot(stage, u, 0, j), ok ? kv.k_row(pg, tok) + d : safe, ok ? 16 : 0);
        cp_async16(slot(stage, u, 1, j), ok ? kv.v_row(pg, tok) + d : safe, ok ? 16 : 0);
      }
    }
  };

  // Tile 0's block-table entries are read before the request's length is known (cap needs only
  // n_max), so the two reads overlap instead of queueing behind each other.
  if (start < cap) locate_tile(0);
#pragma unroll
  for (int s = 0; s < NUM_STAGES - 1; ++s) {
    if (s < ntiles) { if (s > 0) locate_tile(s); load_tile(s, s); }
    cp_async_commit();
  }
  if (NUM_STAGES - 1 < ntiles) locate_tile(NUM_STAGES - 1);

  for (int t = 0; t < ntiles; ++t) {
    {
      const int tl = t + NUM_STAGES - 1;
      if (tl < ntiles) load_tile(tl, tl % NUM_STAGES);
      cp_async_commit();
      if (tl + 1 < ntiles) locate_tile(tl + 1);  // block-table reads overlap this tile's math
    }
    cp_async_wait<NUM_STAGES - 1>();
    const int stage = t % NUM_STAGES;

    float s[UNROLL][G];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float kf[E];
#pragma unroll
      for (int j = 0; j < NV; ++j) dec::unpack(*slot(stage, u, 0, j), kf + j * VEC);
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
      for (int j = 0; j < NV; ++j) dec::unpack(*slot(stage, u, 1, j), vf + j * VEC);
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
  bad = __syncthreads_or(bad);  // pipeline buffers are free (every thread passed cp_async_wait<0>)
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

  store_merged<DTypeQ, HEAD_DIM, G, NUM_WARPS>(a, red, b, h0, split, bad, ds.y);
  if (a.counters != nullptr && a.num_splits > 1) fused_merge<DTypeQ, HEAD_DIM, G, THREADS>(a, b, h0, split, red);
}


// ---- Tensor-core variant (fp16 / bf16 q): decode_split_mma -----------------------------------
// Same contract as attend_chunk. Per warp and 16-token block: S = Q K^T with mma.sync m16n8k16
// (M = query heads of the group, padded to 16; N = tokens; K = head dim), online softmax on the
// accumulator fragment, then O += P V (M = heads, N = head dim, K = the 16 tokens), P reused from
// registers (FlashAttention-2 style). K/V tiles are copied cooperatively with cp.async into
// shared memory (16-byte chunks XOR-swizzled by row against bank conflicts), NUM_STAGES deep. A
// tile is NUM_WARPS * 16 * UNROLL tokens; warp w owns UNROLL 16-token blocks.
//
// K/V operands, by KV element size (the KV-type policy):
// - 16-bit K/V (q's type): fragments by ldmatrix (V transposed by ldmatrix.trans).
// - 8-bit codes (FP8): the MMAs run in fp16 (q converted to fp16: |q| above 65504 overflows to
//   inf, and that row's output is NaN), codes become exact fp16 values two at a time
//   (KvDecode<DTypeKV>::pairs, common.cuh), and fragments are read from shared memory with
//   plain loads, no ldmatrix: the head-dim order inside each 16-wide k-step is permuted so that a
//   lane's 16-byte load of a K row holds the B fragments of four k-steps (q is loaded in the same
//   order, so the dot products are unchanged). Both products run transposed, with the heads in
//   the MMAs' N dimension (padded to 8) instead of M (padded to 16): S^T = K Q^T (M = the 16
//   tokens; q's A fragment is Q^T's B fragment as it is) and O^T += V^T P^T (M = 16 head-dim
//   columns, K = the tokens; P^T's B fragment is the transpose of the scores' C fragment, two
//   movmatrix per block): half the MMAs and output registers of the 16-bit layout (118 instead of
//   160 registers at w4; run Q6). A lane's V^T A fragment for 4 consecutive head-dim columns comes
//   from one 4-byte load of each of 4 token rows (byte_perm pairs tokens); the columns a lane
//   accumulates are written back in order.
// - INT4 code pairs (int4_t<G>): the FP8 layout (transposed products, permuted head-dim order),
//   each code pair made an fp16 pair fp16(code * scale + zero) with a mask, a subtraction and an
//   fma (KvDecode<int4_t<G>>::codes: 5 integer operations per 8 codes, masks held in registers
//   by kept_const; a row pair's scales or zeros are one byte_perm); V's A fragments pair the
//   bytes of two token rows with byte_perm. Until run Z11 INT4 ran the 16-bit layout (heads in M,
//   padded to 16: twice the MMAs). Run Z13 cut the INT4 loop's instructions by 17-24 % (SASS
//   counts, scripts/sass_count.py): shift-free nibble extraction, no re-materialised masks, and
//   contiguous scale / zero rows located by one add per row as K / V rows.
template <typename DTypeQ, typename DTypeKV, typename Cache, int HEAD_DIM, int GROUP_SIZE,
          int NUM_WARPS, int NUM_STAGES, int UNROLL, int CLUSTER = 1, bool UMAX = false>
__device__ __forceinline__ void attend_chunk_mma(const DecodeParams& a, int b, int h0, int kvh,
                                                 int split, int start, int end, int cap, bool bad,
                                                 uint4* smem) {
  constexpr bool KV8 = sizeof(DTypeKV) == 1;  // one-byte elements: FP8 codes or INT4 code pairs
  constexpr int QG = Int4Group<DTypeKV>::value;  // INT4 quantisation group (0: not INT4)
  constexpr bool I4 = QG > 0;
  static_assert(sizeof(DTypeQ) == 2 && (KV8 || sizeof(DTypeKV) == 2), "mma path: 16-bit q, 16- or 8-bit K/V");
  static_assert(!I4 || (HEAD_DIM <= 128 && QG <= HEAD_DIM), "INT4: HEAD_DIM 64 or 128, groups within a row");
  static_assert(GROUP_SIZE <= 8, "heads of a group live in MMA rows 0..7");
  static_assert(HEAD_DIM % 64 == 0, "mma path: HEAD_DIM in {64, 128, 256}");
  static_assert(NUM_STAGES >= 2, "mma path pipelines at least two stages");
  using TQ = TypeTraits<DTypeQ>;
  using MM = Mma<typename Select<KV8, half_t, DTypeQ>::type>;
  constexpr int G = GROUP_SIZE, THREADS = NUM_WARPS * 32;
  constexpr int CPR = HEAD_DIM * (int)sizeof(DTypeKV) / (I4 ? 32 : 16);  // 16-byte chunks per row
  constexpr int TILE = NUM_WARPS * 16 * UNROLL;         // tokens per stage
  constexpr int STAGE_CHUNKS = TILE * CPR;              // per K (and per V) tile
  static_assert(STAGE_CHUNKS % THREADS == 0, "loader: chunks must divide among threads");
  // 8-bit V rows are padded by one chunk (VPR chunks apart): a lane's four rows 2c, 2c+1, 2c+8,
  // 2c+9 (c = lane % 4) then fall in distinct bank groups without a swizzle, so its V addresses
  // are one register plus compile-time offsets.
  constexpr int VPR = KV8 ? CPR + 1 : CPR;
  constexpr int STAGE_V = TILE * VPR;
  // INT4: each row's fp16 scales and zeros of K and V (arrays 0..3: K scale, K zero, V scale,
  // V zero), SLOTS 4-byte words each (NGRP / 2; a lone group takes two words, int4_param2).
  constexpr int NGRP = I4 ? HEAD_DIM / QG : 0;
  constexpr int SLOTS = NGRP == 1 ? 2 : NGRP / 2;
  constexpr int STAGE_SC = TILE * SLOTS;  // chunks: 4 arrays x SLOTS words per row
  constexpr int STAGE = STAGE_CHUNKS + STAGE_V + STAGE_SC;
  constexpr int KSTEPS = HEAD_DIM / 16, NT = HEAD_DIM / 8;
  // 8-bit (VT): S^T = K Q^T and O^T += V^T P^T, the heads in N (padded to 8) instead of M (padded
  // to 16): half the MMAs and output accumulators.
  constexpr bool VT = KV8;
  constexpr int NO = VT ? HEAD_DIM / 16 : NT;  // output accumulator fragments

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const CacheOf<Cache, DTypeKV> kv(a, b, kvh);
  const DTypeKV* safe = static_cast<const DTypeKV*>(a.k);  // a valid address for zero-fill copies
  const int ntiles = end > start ? (end - start + TILE - 1) / TILE : 0;
  using dec = KvDecode<DTypeKV>;
  const unsigned mlo = I4 ? kept_const(0x000f000fu) : 0u, mhi = I4 ? kept_const(0x00f000f0u) : 0u;  // INT4 nibble masks (dec::codes)
  const float2 ds = kv_descales<DTypeKV>(a, b, kvh);
  const float sscale = a.scale_log2 * ds.x;  // scores: log2 domain, K's descale folded in

  // Swizzles (chunk of a row -> slot). 16-bit: chunk ^ (row & 7) against ldmatrix conflicts.
  // 8-bit: K is read as one 16-byte chunk per lane, rows 2p and 2p+1 together (odd rows move by 4
  // chunks); V as 4-byte words of rows 2c (+1, +8, +9), c = lane % 4, in padded rows (VPR).
  auto kswz = [](int row, int chunk) {
    if constexpr (KV8) return row * CPR + (CPR >= 8 ? chunk ^ ((row & 1) << 2) : chunk);
    else return row * CPR + (chunk ^ (row & 7));
  };
  auto vswz = [](int row, int chunk) {
    if constexpr (KV8) return row * VPR + chunk;
    else return row * CPR + (chunk ^ (row & 7));
  };
  static_assert(THREADS % CPR == 0, "loader: a thread keeps one chunk column");
  constexpr int ROWSTEP = THREADS / CPR;  // rows covered by one pass of all threads
  const int lrow = tid / CPR, lch = tid % CPR;
  constexpr int LROWS = TILE / ROWSTEP;  // rows one thread copies per tile
  constexpr int EPC = 16 / (int)sizeof(DTypeKV);  // elements per chunk
  // Paged: a thread copies LROWS consecutive rows, RUN of them per page (chunks start on page
  // boundaries), so it reads NLOC block-table entries per tile instead of one per row.
  // Contiguous: rows ROWSTEP apart, as before pages existed.
  constexpr int PAGE = CacheOf<Cache, DTypeKV>::PAGE;
  constexpr bool BLOCKED = PAGE >= 2;
  constexpr int RUN = BLOCKED ? (PAGE < LROWS ? PAGE : LROWS) : 1;
  constexpr int NLOC = LROWS / RUN;
  static_assert(LROWS % RUN == 0, "a thread's rows split into whole page runs");
  const bool aligned = !BLOCKED || start % (PAGE > 0 ? PAGE : 1) == 0;  // the plan always aligns chunks to pages
  if (!aligned) bad = true;
  auto row_of = [&](int i) { return BLOCKED ? lrow * LROWS + i : i * ROWSTEP + lrow; };
  int loc[NLOC];  // block-table entries of the next tile's rows (unvalidated until used)
  auto locate_tile = [&](int t) {  // rows past the chunk read the last row's entry: no branch
#pragma unroll
    for (int j = 0; j < NLOC; ++j) loc[j] = kv.fetch(min(start + t * TILE + row_of(j * RUN), cap - 1));
  };
  // Contiguous: the thread's first-row pointers of the next tile to load (tiles load in order,
  // once each), moved TILE rows per tile: a row's address is one add, not a 64-bit multiply.
  const DTypeKV* krow = PAGE == 0 ? kv.k_row(0, start + lrow) + lch * EPC : safe;
  const DTypeKV* vrow = PAGE == 0 ? kv.v_row(0, start + lrow) + lch * EPC : safe;
  // INT4: the loader threads of a row (CPR of them) copy its 4 scale / zero rows, APT each.
  constexpr int APT = I4 ? 4 / CPR : 1;
  static_assert(!I4 || 4 % CPR == 0, "INT4 loader: the row's threads share its 4 parameter rows");
  const unsigned short* pbase[APT];
  long long psp[APT], psn[APT];
#pragma unroll
  for (int x = 0; x < (I4 ? APT : 0); ++x) {
    const int r = lch * APT + x;
    const void* ptr = r == 0 ? (const void*)a.k_descale : r == 1 ? a.k_zero : r == 2 ? (const void*)a.v_descale : a.v_zero;
    const long long sb = r == 0 ? a.kd_sb : r == 1 ? a.kz_sb : r == 2 ? a.vd_sb : a.vz_sb;
    const long long sh = r == 0 ? a.kd_sh : r == 1 ? a.kz_sh : r == 2 ? a.vd_sh : a.vz_sh;
    psn[x] = r == 0 ? a.kd_sn : r == 1 ? a.kz_sn : r == 2 ? a.vd_sn : a.vz_sn;
    psp[x] = sb;
    pbase[x] = CacheOf<Cache, DTypeKV>::template base<unsigned short>(ptr, sb, sh, b, kvh);
  }
  // INT4, contiguous: the thread's first-row scale / zero pointers of the next tile (as krow / vrow)
  const unsigned short* prow[APT];
#pragma unroll
  for (int x = 0; x < (I4 && PAGE == 0 ? APT : 0); ++x)
    prow[x] = CacheOf<Cache, DTypeKV>::template row<unsigned short>(pbase[x], psp[x], psn[x], 0, start + lrow);
  auto copy_params = [&](unsigned* sc, int row, const unsigned short* const* srcs, bool ok) {  // INT4: one row's scales / zeros
#pragma unroll
    for (int x = 0; x < APT; ++x) {
      const unsigned short* src = srcs[x];
      unsigned* dst = sc + row * 4 * SLOTS + (lch * APT + x) * SLOTS;
      if constexpr (NGRP == 1) {  // the aligned word holding the value; the other slot zero
        const unsigned long long ad = reinterpret_cast<unsigned long long>(src);
        const void* a4 = ok ? reinterpret_cast<const void*>(ad & ~3ull) : (const void*)safe;
        const bool odd = (ad & 2) != 0;
        cp_async4(dst, a4, ok && !odd ? 2 : 0);  // low half: [value, 0]
        cp_async4(dst + 1, a4, ok && odd ? 4 : 0);  // high half: [neighbour, value]
      } else {
#pragma unroll
        for (int j = 0; j < SLOTS; ++j) cp_async4(dst + j, ok ? (const void*)(src + 2 * j) : (const void*)safe, ok ? 4 : 0);
      }
    }
  };
  auto load_tile = [&](int t, int stage) {  // uses loc[] of tile t
    uint4* ks = smem + stage * STAGE;
    uint4* vs = ks + STAGE_CHUNKS;
    unsigned* sc = reinterpret_cast<unsigned*>(vs + STAGE_V);
    if constexpr (PAGE == 0) {
      const int left = end - start - t * TILE - lrow;  // row i (token i*ROWSTEP + lrow of the tile) is in if i*ROWSTEP < left
      const DTypeKV* kp = krow;
      const DTypeKV* vp = vrow;
      const unsigned short* pp[APT];
#pragma unroll
      for (int x = 0; x < (I4 ? APT : 0); ++x) pp[x] = prow[x];
#pragma unroll
      for (int i = 0; i < LROWS; ++i) {  // one add per row: no offsets held across the unrolled rows
        const bool ok = i * ROWSTEP < left;
        const int row = i * ROWSTEP + lrow;
        cp_async16(ks + kswz(row, lch), ok ? kp : safe, ok ? 16 : 0);
        cp_async16(vs + vswz(row, lch), ok ? vp : safe, ok ? 16 : 0);
        if constexpr (I4) {
          copy_params(sc, row, pp, ok);
#pragma unroll
          for (int x = 0; x < APT; ++x) pp[x] += ROWSTEP * psn[x];
        }
        kp += ROWSTEP * kv.k_sn;
        vp += ROWSTEP * kv.v_sn;
      }
      krow += TILE * kv.k_sn;
      vrow += TILE * kv.v_sn;
#pragma unroll
      for (int x = 0; x < (I4 ? APT : 0); ++x) prow[x] += TILE * psn[x];
      return;
    }
    // Per page run: one block-table entry, one address; the run's rows are one add apart (as the
    // contiguous loader's). A chunk off a page boundary (never planned) copies nothing: its rows
    // could cross into the next page, and the CTA writes NaN (bad) anyway.
#pragma unroll
    for (int j = 0; j < NLOC; ++j) {
      const int tok0 = start + t * TILE + row_of(j * RUN);  // first row of the run
      const int left = aligned ? end - tok0 : 0;            // row r of the run is copied if r < left
      const int pg = left > 0 ? kv.page(loc[j], bad) : 0;
      const DTypeKV* kp = kv.k_row(pg, tok0) + lch * EPC;
      const DTypeKV* vp = kv.v_row(pg, tok0) + lch * EPC;
#pragma unroll
      for (int r = 0; r < RUN; ++r) {
        const int row = row_of(j * RUN + r);
        const bool ok = r < left;
        cp_async16(ks + kswz(row, lch), ok ? kp : safe, ok ? 16 : 0);
        cp_async16(vs + vswz(row, lch), ok ? vp : safe, ok ? 16 : 0);
        if constexpr (I4) {
          const unsigned short* pp[APT];
#pragma unroll
          for (int x = 0; x < APT; ++x)
            pp[x] = CacheOf<Cache, DTypeKV>::template row<unsigned short>(pbase[x], psp[x], psn[x], pg, tok0 + r);
          copy_params(sc, row, pp, ok);
        }
        kp += kv.k_sn;
        vp += kv.v_sn;
      }
    }
  };

  // Tile 0's block-table entries are read before the request's length is known (cap needs only
  // n_max), so the two reads overlap instead of queueing behind each other.
  if (start < cap) locate_tile(0);
#pragma unroll
  for (int s = 0; s < NUM_STAGES - 1; ++s) {
    if (s < ntiles) { if (s > 0) locate_tile(s); load_tile(s, s); }
    cp_async_commit();
  }
  if (NUM_STAGES - 1 < ntiles) locate_tile(NUM_STAGES - 1);

  // Q as the A operand: rows = heads (lane/4 < G valid), 2 packed elements per register. Head-dim
  // index of A column pair `half` of k-step ks: 16-bit K/V ks*16 + half*8 + qcol; 8-bit K/V the
  // permuted order of a lane's K chunk (k-step ks = 4h + w is word w of chunk c + 4h, c = lane % 4,
  // whose bytes are the B fragment's k indices 2c, 2c+1, 2c+8, 2c+9).
  const int qrow = lane / 4, qcol = 2 * (lane % 4);
  unsigned qa[KSTEPS][2];
  {
    const DTypeQ* qp = static_cast<const DTypeQ*>(a.q) + b * a.q_sb + (h0 + (qrow < G ? qrow : 0)) * a.q_sh;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // INT4: k-steps 2w, 2w+1 are word w of the lane's quarter of a row (elements 8w .. 8w+7
        // of it), b0 / b1 = nibbles (0, 4), (1, 5) and (2, 6), (3, 7): d, d + 4 pairs
        const int d = I4 ? (lane % 4) * (HEAD_DIM / 4) + 8 * (ks / 2) + 2 * (ks % 2) + half
                    : KV8 ? 16 * (lane % 4 + 4 * (ks / 4)) + 4 * (ks % 4) + 2 * half : ks * 16 + half * 8 + qcol;
        const float x0 = qrow < G ? TQ::load(qp + d) : 0.f;
        const float x1 = qrow < G ? TQ::load(qp + d + (I4 ? 4 : 1)) : 0.f;
        qa[ks][half] = MM::pack(x0, x1);  // exact for 16-bit K/V (x0, x1 came from DTypeQ)
      }
  }

  float o[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  // UMAX (softmax_mode "unified_max", the *_umax kernels): the softmax reference m starts at
  // phi - 7 (phi = DecodeParams.umax2, the unified max in log2 units) instead of -inf, and the lazy
  // rule below moves m only for a score above m + LAZY = m + 15, so m stays put while scores lie
  // within phi +- 8. The warp's first block restarts from its own max (state empty) when a head's
  // 16 scores there all lie below m - 1 = phi - 8. So a head that keeps m0 has a score >= m0 - 1 in
  // its first block: its largest probability is >= 2^-1 and every one <= 2^15 (< fp16's 65504),
  // fp16 P keeps exact mode's range (exact mode: largest in [1, 2^8]). A reference far above the
  // scores would not: fp16 P loses bits below 2^-14 and is 0 below 2^-24 while l (float32) is not.
  // A warp that saw no token hands on m = -inf, as exact mode does, so phi never enters a merge.
  constexpr float LAZY = UMAX ? 15.f : 8.f;  // rescale when a score passes m + LAZY (p <= 2^LAZY)
  constexpr float UMAX_BELOW = 7.f;          // UMAX: m0 = phi - 7; the first-block window's low end is m0 - 1
  static_assert(!UMAX || HEAD_DIM <= 128, "unified max: head dim 64 or 128 (256 sits at 255 registers)");
  const float m0 = UMAX ? a.umax2 - UMAX_BELOW : neg_inf();
  float m = m0, l = 0.f;  // for head row qrow (rows 8..15 are padding)
  float m2[2] = {m0, m0}, l2[2] = {0.f, 0.f};  // 8-bit (VT): heads 2c, 2c+1, c = lane % 4

  for (int t = 0; t < ntiles; ++t) {
    cp_async_wait<NUM_STAGES - 2>();
    __syncthreads();  // tile t visible to all warps; all warps are done with tile t-1
    {
      const int tl = t + NUM_STAGES - 1;
      if (tl < ntiles) load_tile(tl, tl % NUM_STAGES);
      cp_async_commit();
      if (tl + 1 < ntiles) locate_tile(tl + 1);  // block-table reads overlap this tile's math
    }
    const uint4* ks_ = smem + (t % NUM_STAGES) * STAGE;
    const uint4* vs_ = ks_ + STAGE_CHUNKS;
    const unsigned* sc_ = reinterpret_cast<const unsigned*>(vs_ + STAGE_V);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int r0 = (warp * UNROLL + u) * 16;  // first row of this warp's block in the tile
      const bool first = UMAX && t == 0 && u == 0;  // UMAX: the warp's first block (state empty, m = phi)
      float sc[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
      if constexpr (I4) {
        // S^T = K Q^T into sc[0], as FP8's (below): A rows are this lane's K rows r0 + lane/4 (n = 0)
        // and + 8 (n = 1). Lane c = lane % 4 holds elements [c * D/4, (c+1) * D/4) of each row: KW
        // words, one group. Word j's nibble pairs (i, i+4), i = 0..3, are A columns (2c, 2c+1) and
        // (2c+8, 2c+9) of k-step 2j (i = 0, 1) and of k-step 2j + 1 (i = 2, 3); q is loaded in that order.
        constexpr int KW = HEAD_DIM / 32;
        const int grp = (lane % 4) * (HEAD_DIM / 4) / QG;
        unsigned w[2][KW], s2[2], z2[2];
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const int row = r0 + n * 8 + lane / 4;
          const unsigned* kw = reinterpret_cast<const unsigned*>(ks_) + row * 4 * CPR + (lane % 4) * KW;
          if constexpr (KW == 4) {
            const uint4 c4 = *reinterpret_cast<const uint4*>(kw);
            w[n][0] = c4.x; w[n][1] = c4.y; w[n][2] = c4.z; w[n][3] = c4.w;
          } else {
            const uint2 c2 = *reinterpret_cast<const uint2*>(kw);
            w[n][0] = c2.x; w[n][1] = c2.y;
          }
          const unsigned* pr = sc_ + row * 4 * SLOTS;
          s2[n] = int4_param2<NGRP>(pr, pr, grp);
          z2[n] = int4_param2<NGRP>(pr + SLOTS, pr + SLOTS, grp);
        }
#pragma unroll
        for (int j = 0; j < KW; ++j) {
          unsigned r[2][4];
#pragma unroll
          for (int n = 0; n < 2; ++n) {
            dec::codes(w[n][j], mlo, mhi, r[n]);
#pragma unroll
            for (int i = 0; i < 4; ++i) r[n][i] = dec::dequant(r[n][i], s2[n], z2[n]);
          }
          MM::run(sc[0], r[0][0], r[1][0], r[0][1], r[1][1], qa[2 * j][0], qa[2 * j][1]);
          MM::run(sc[0], r[0][2], r[1][2], r[0][3], r[1][3], qa[2 * j + 1][0], qa[2 * j + 1][1]);
        }
      } else if constexpr (KV8) {
        // S^T = K Q^T into sc[0] (M = the 16 tokens, N = heads): A rows are this lane's K rows
        // r0 + lane/4 and + 8, B = Q^T is qa as it is (a B fragment's column = an A fragment's row).
#pragma unroll
        for (int h = 0; h < CPR / 4; ++h) {
          const uint4 c0 = ks_[kswz(r0 + lane / 4, lane % 4 + 4 * h)], c1 = ks_[kswz(r0 + 8 + lane / 4, lane % 4 + 4 * h)];
          const unsigned w0[4] = {c0.x, c0.y, c0.z, c0.w}, w1[4] = {c1.x, c1.y, c1.z, c1.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {  // bytes 0, 1: k indices 2c, 2c+1; bytes 2, 3: 2c+8, 2c+9
            unsigned k00, k01, k10, k11;
            dec::pairs(w0[j], k00, k01);
            dec::pairs(w1[j], k10, k11);
            MM::run(sc[0], k00, k10, k01, k11, qa[4 * h + j][0], qa[4 * h + j][1]);
          }
        }
      } else {
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
          unsigned r[4];
          const int row = r0 + ((lane >> 4) & 1) * 8 + (lane & 7);
          const int ch = kk * 2 + ((lane >> 3) & 1);
          ldmatrix_x4(r, ks_ + kswz(row, ch));
          MM::run(sc[0], qa[kk][0], 0u, qa[kk][1], 0u, r[0], r[1]);
          MM::run(sc[1], qa[kk][0], 0u, qa[kk][1], 0u, r[2], r[3]);
        }
      }
      unsigned pa0, pa2;  // P (8-bit: P^T's B fragment): tokens 2c, 2c+1 and 2c+8, 2c+9 of head row lane / 4
      const bool full = start + (t + 1) * TILE <= end;  // warp-uniform: no token of the tile masked
      if constexpr (VT) {
        // sc[0][i]: token lane/4 + 8 (i/2) of the block, head 2c + i%2. Lazy rescaling by the other
        // paths' rule (m moves to the block max when a score of the warp passes m + LAZY), voted on each
        // lane's own scores: the block max (3 shuffles per head) only when the vote fires.
        const int tokr = start + t * TILE + r0 + lane / 4;
        float x[4];
        bool grow = false;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float v = sc[0][i] * sscale;
          x[i] = full || tokr + 8 * (i / 2) < end ? v : neg_inf();
          grow |= x[i] > m2[i % 2] + LAZY;
        }
        if constexpr (UMAX) {
          if (first) {  // a head (lanes c, c + 4, ..) all below m0 - 1 = phi - 8: back to exact mode's start
            bool low = false;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              unsigned bl = __ballot_sync(0xffffffffu, x[h] < m2[h] - 1.f && x[2 + h] < m2[h] - 1.f && 2 * (lane % 4) + h < G);
              bl &= bl >> 16; bl &= bl >> 8; bl &= bl >> 4;
              low |= (bl & 0xfu) != 0;
            }
            if (low) {
              m2[0] = m2[1] = neg_inf();
              grow = x[0] > neg_inf() || x[1] > neg_inf() || x[2] > neg_inf() || x[3] > neg_inf();
            }
          }
        }
        if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float mx = fmaxf(m2[h], fmaxf(x[h], x[2 + h]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
            const float alpha = fast_exp2(m2[h] - (mx == neg_inf() ? 0.f : mx));
            m2[h] = mx;
            l2[h] *= alpha;
#pragma unroll
            for (int n = 0; n < NO; ++n) { o[n][h] *= alpha; o[n][2 + h] *= alpha; }
          }
        }
        float p[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) p[i] = fast_exp2(x[i] - (m2[i % 2] == neg_inf() ? 0.f : m2[i % 2]));
        l2[0] += p[0] + p[2];
        l2[1] += p[1] + p[3];
        pa0 = movmatrix_trans(MM::pack(p[0], p[1]));  // rows: tokens 0..7 of the block -> heads
        pa2 = movmatrix_trans(MM::pack(p[2], p[3]));  // tokens 8..15
      } else {
        // scores of head qrow for tokens n*8 + qcol + {0,1}
        const int tok0 = start + t * TILE + r0 + qcol;
        float mx = first ? neg_inf() : m;  // UMAX's first block: the block's own max (state empty)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float x = sc[n][j] * sscale;
            sc[n][j] = full || tok0 + n * 8 + j < end ? x : neg_inf();
            mx = fmaxf(mx, sc[n][j]);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // Lazy rescaling: the reference m (and with it l and o) moves only when a head row of the
        // warp would otherwise see a probability above 2^LAZY; exact either way (p <= 2^LAZY <= 2^15
        // fits fp16, and l, o stay far from float32's range), and most blocks skip the 2 * NT multiplies.
        // UMAX's first block: also when a head row lies all below m0 - 1; m then moves from -inf.
        if (__any_sync(0xffffffffu, mx > m + LAZY || (first && mx < m - 1.f && qrow < G))) {
          const float alpha = fast_exp2((first ? neg_inf() : m) - (mx == neg_inf() ? 0.f : mx));
          m = mx;
          l *= alpha;
#pragma unroll
          for (int n = 0; n < NT; ++n) { o[n][0] *= alpha; o[n][1] *= alpha; }
        }
        const float mref = m == neg_inf() ? 0.f : m;
        float p[2][2];
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int j = 0; j < 2; ++j) p[n][j] = fast_exp2(sc[n][j] - mref);
        l += p[0][0] + p[0][1] + p[1][0] + p[1][1];
        pa0 = MM::pack(p[0][0], p[0][1]);  // tokens qcol, qcol+1
        pa2 = MM::pack(p[1][0], p[1][1]);  // tokens 8+qcol, 8+qcol+1
      }
      if constexpr (I4) {
        // O^T += V^T P^T, as FP8's (below): o[4g + e] has M rows r, r + 8 (r = lane / 4) = head-dim
        // columns 64g + 8r + e and + 4 (one group), C columns 2c, 2c+1 = heads. A rows of this lane:
        // word r + 8g (columns 64g + 8r .. + 7) of rows r0 + qcol + {0, 1, 8, 9}; byte_perm puts
        // bytes of two tokens side by side, so a nibble pair (bits 0-3, 16-19) is one column of
        // tokens (t, t+1): an A register. B = (pa0, pa2), P^T.
        const unsigned* vw = reinterpret_cast<const unsigned*>(vs_ + vswz(r0 + qcol, 0)) + lane / 4;
        constexpr int RW = 4 * VPR;  // 4-byte words per padded row
        const unsigned* pr = sc_ + (r0 + qcol) * 4 * SLOTS;  // parameter rows r0 + qcol (+1, +8, +9)
        constexpr int PR = 4 * SLOTS;
#pragma unroll
        for (int g = 0; g < HEAD_DIM / 64; ++g) {
          const int grp = (64 * g + 8 * (lane / 4)) / QG;
          const unsigned w0 = vw[8 * g], w1 = vw[RW + 8 * g], w8 = vw[8 * RW + 8 * g], w9 = vw[9 * RW + 8 * g];
          const unsigned s01 = int4_param2<NGRP>(pr + 2 * SLOTS, pr + PR + 2 * SLOTS, grp);
          const unsigned z01 = int4_param2<NGRP>(pr + 3 * SLOTS, pr + PR + 3 * SLOTS, grp);
          const unsigned s89 = int4_param2<NGRP>(pr + 8 * PR + 2 * SLOTS, pr + 9 * PR + 2 * SLOTS, grp);
          const unsigned z89 = int4_param2<NGRP>(pr + 8 * PR + 3 * SLOTS, pr + 9 * PR + 3 * SLOTS, grp);
          // bytes 0, 1 (columns + 0..3) and 2, 3 (+ 4..7) of rows (t, t+1)
          const unsigned y01[2] = {__byte_perm(w0, w1, 0x5410), __byte_perm(w0, w1, 0x7632)};
          const unsigned y89[2] = {__byte_perm(w8, w9, 0x5410), __byte_perm(w8, w9, 0x7632)};
          unsigned c[4][4];  // codes of y01[0], y01[1], y89[0], y89[1]
          dec::codes(y01[0], mlo, mhi, c[0]);
          dec::codes(y01[1], mlo, mhi, c[1]);
          dec::codes(y89[0], mlo, mhi, c[2]);
          dec::codes(y89[1], mlo, mhi, c[3]);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const unsigned a0 = dec::dequant(c[0][e], s01, z01), a1 = dec::dequant(c[1][e], s01, z01);
            const unsigned a2 = dec::dequant(c[2][e], s89, z89), a3 = dec::dequant(c[3][e], s89, z89);
            MM::run(o[4 * g + e], a0, a1, a2, a3, pa0, pa2);
          }
        }
      } else if constexpr (VT) {
        // O^T: o[2g + j] has M rows r, r + 8 (r = lane / 4) = head-dim columns 32g + 4r + 2j, +1, and
        // C columns 2c, 2c+1 = heads. A rows of this lane: tokens r0 + qcol + {0, 1} (k 2c, 2c+1) and
        // + {8, 9}, word r + 8g (columns 32g + 4r .. +3) of each; B = (pa0, pa2), P^T.
        const unsigned* vw = reinterpret_cast<const unsigned*>(vs_ + vswz(r0 + qcol, 0)) + lane / 4;
        constexpr int RW = 4 * VPR;  // 4-byte words per padded row
#pragma unroll
        for (int g = 0; g < HEAD_DIM / 32; ++g) {
          const unsigned w0 = vw[8 * g], w1 = vw[RW + 8 * g], w8 = vw[8 * RW + 8 * g], w9 = vw[9 * RW + 8 * g];
#pragma unroll
          for (int j = 0; j < 2; ++j) {  // bytes 2j, 2j+1 of each row: columns 32g + 4r + 2j (row r), +1 (row r+8)
            const int i = 2 * j;
            const unsigned sel = i | ((4 + i) << 4) | ((i + 1) << 8) | ((5 + i) << 12);
            unsigned a0, a1, a2, a3;
            dec::pairs(__byte_perm(w0, w1, sel), a0, a1);
            dec::pairs(__byte_perm(w8, w9, sel), a2, a3);
            MM::run(o[2 * g + j], a0, a1, a2, a3, pa0, pa2);
          }
        }
      } else {
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
          unsigned r[4];
          const int row = r0 + ((lane >> 3) & 1) * 8 + (lane & 7);
          const int ch = n + (lane >> 4);
          ldmatrix_x4_trans(r, vs_ + vswz(row, ch));
          MM::run(o[n], pa0, 0u, pa2, 0u, r[0], r[1]);
          MM::run(o[n + 1], pa0, 0u, pa2, 0u, r[2], r[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if constexpr (VT) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int x = 4; x < 32; x *= 2) l2[h] += __shfl_xor_sync(0xffffffffu, l2[h], x);
  }

  float* red = reinterpret_cast<float*>(smem);
  bad = __syncthreads_or(bad);  // every warp is past its last shared-memory read: reuse the stages
  if constexpr (VT) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // C column h: head 2c + h
      const int head = 2 * (lane % 4) + h;
      if (head < G) {
        if (lane < 4) {
          red[(warp * G + head) * (HEAD_DIM + 2) + HEAD_DIM] = UMAX && l2[h] == 0.f ? neg_inf() : m2[h];
          red[(warp * G + head) * (HEAD_DIM + 2) + HEAD_DIM + 1] = l2[h];
        }
        float* w = red + (warp * G + head) * (HEAD_DIM + 2) + (I4 ? 8 : 4) * qrow;
#pragma unroll
        for (int n = 0; n < NO; ++n) {  // M rows r, r + 8 of o[n]: columns c0, c0 + dc (r = qrow, added above)
          const int c0 = I4 ? 64 * (n / 4) + n % 4 : 32 * (n / 2) + 2 * (n % 2), dc = I4 ? 4 : 1;
          w[c0] = o[n][h]; w[c0 + dc] = o[n][2 + h];
        }
      }
    }
  } else if (qrow < G) {
    float* w = red + (warp * G + qrow) * (HEAD_DIM + 2);
    if (lane % 4 == 0) { w[HEAD_DIM] = UMAX && l == 0.f ? neg_inf() : m; w[HEAD_DIM + 1] = l; }
#pragma unroll
    for (int n = 0; n < NT; ++n) { w[n * 8 + qcol] = o[n][0]; w[n * 8 + qcol + 1] = o[n][1]; }  // 16-bit K/V
  }
  __syncthreads();
  if constexpr (CLUSTER > 1) {
    cluster_merge<DTypeQ, HEAD_DIM, G, NUM_WARPS, CLUSTER>(a, red, b, h0, bad, ds.y);
  } else {
    store_merged<DTypeQ, HEAD_DIM, G, NUM_WARPS>(a, red, b, h0, split, bad, ds.y);
    if (a.counters != nullptr && a.num_splits > 1) fused_merge<DTypeQ, HEAD_DIM, G, THREADS>(a, b, h0, split, red);
  }
}

// The tokens [start, end) CTA `split` of request b owns; bad when the request's length is
// invalid. cap = min(start + chunk, n_max) bounds end and is known before the length is read.
struct ChunkOf {
  int start, end, cap;
  bool bad;
  __device__ __forceinline__ ChunkOf(const DecodeParams& p, int b, int split) {
    start = split * p.chunk;
    cap = min(start + p.chunk, p.n_max);
    const int len = request_length(p, b);
    bad = len < 0;
    end = min(cap, bad ? 0 : len);
  }
};

// grid (num_splits, num_q_heads / GROUP_SIZE, batch); block NUM_WARPS * 32.
template <typename DTypeQ, typename DTypeKV, typename Cache, int HEAD_DIM, int GROUP_SIZE,
          int NUM_WARPS, int NUM_STAGES, int UNROLL>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) decode_split(const DecodeParams p) {
  extern __shared__ __align__(128) uint4 smem[];  // no static shared memory (merge.cuh, FusedRole)
  const int split = blockIdx.x, b = blockIdx.z, h0 = blockIdx.y * GROUP_SIZE;
  prefetch_chunk_l2<DTypeKV, Cache, HEAD_DIM>(p, b, h0 / p.ratio, split);  // kv_cache.cuh
  pdl_wait();     // before any read of the inputs or write of the workspace (common.cuh)
  pdl_trigger();  // the merge (or the next call) may launch now; it waits for this grid to finish
  const ChunkOf c(p, b, split);
  attend_chunk<DTypeQ, DTypeKV, Cache, HEAD_DIM, GROUP_SIZE, NUM_WARPS, NUM_STAGES, UNROLL>(
      p, b, h0, h0 / p.ratio, split, c.start, c.end, c.cap, c.bad, smem);
}

// Tensor-core phase 1 (fp16/bf16): grid and arguments as decode_split.
template <typename DTypeQ, typename DTypeKV, typename Cache, int HEAD_DIM, int GROUP_SIZE,
          int NUM_WARPS, int NUM_STAGES, int UNROLL>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) decode_split_mma(const DecodeParams p) {
  extern __shared__ __align__(128) uint4 smem[];  // no static shared memory (merge.cuh, FusedRole)
  const int split = blockIdx.x, b = blockIdx.z, h0 = blockIdx.y * GROUP_SIZE;
  prefetch_chunk_l2<DTypeKV, Cache, HEAD_DIM>(p, b, h0 / p.ratio, split);  // kv_cache.cuh
  pdl_wait();     // before any read of the inputs or write of the workspace (common.cuh)
  pdl_trigger();  // the merge (or the next call) may launch now; it waits for this grid to finish
  const ChunkOf c(p, b, split);
  attend_chunk_mma<DTypeQ, DTypeKV, Cache, HEAD_DIM, GROUP_SIZE, NUM_WARPS, NUM_STAGES, UNROLL>(
      p, b, h0, h0 / p.ratio, split, c.start, c.end, c.cap, c.bad, smem);
}

// decode_split_mma with softmax_mode "unified_max" (UMAX in attend_chunk_mma; head dim 64 / 128).
template <typename DTypeQ, typename DTypeKV, typename Cache, int HEAD_DIM, int GROUP_SIZE,
          int NUM_WARPS, int NUM_STAGES, int UNROLL>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) decode_split_mma_umax(const DecodeParams p) {
  extern __shared__ __align__(128) uint4 smem[];  // no static shared memory (merge.cuh, FusedRole)
  const int split = blockIdx.x, b = blockIdx.z, h0 = blockIdx.y * GROUP_SIZE;
  prefetch_chunk_l2<DTypeKV, Cache, HEAD_DIM>(p, b, h0 / p.ratio, split);  // kv_cache.cuh
  pdl_wait();     // before any read of the inputs or write of the workspace (common.cuh)
  pdl_trigger();  // the merge (or the next call) may launch now; it waits for this grid to finish
  const ChunkOf c(p, b, split);
  attend_chunk_mma<DTypeQ, DTypeKV, Cache, HEAD_DIM, GROUP_SIZE, NUM_WARPS, NUM_STAGES, UNROLL, 1, true>(
      p, b, h0, h0 / p.ratio, split, c.start, c.end, c.cap, c.bad, smem);
}

// Tensor-core phase 1 with the merge inside a thread-block cluster (sm_90; merge.cuh, cluster_merge):
// grid (CLUSTER, num_q_heads / GROUP_SIZE, batch), one cluster of CLUSTER split CTAs per (request,
// KV-head group); the CTAs write out / lse themselves (no partials, no second launch). Defined for
// sm_90 and newer only (NVRTC refuses __cluster_dims__ below).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
template <typename DTypeQ, typename DTypeKV, typename Cache, int HEAD_DIM, int GROUP_SIZE,
          int NUM_WARPS, int NUM_STAGES, int UNROLL, int CLUSTER>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) __cluster_dims__(CLUSTER, 1, 1)
    decode_split_mma_cluster(const DecodeParams p) {
  extern __shared__ __align__(128) uint4 smem[];  // no static shared memory (merge.cuh, FusedRole)
  const int split = blockIdx.x, b = blockIdx.z, h0 = blockIdx.y * GROUP_SIZE;
  prefetch_chunk_l2<DTypeKV, Cache, HEAD_DIM>(p, b, h0 / p.ratio, split);  // kv_cache.cuh
  pdl_wait();     // before any read of the inputs or write of the outputs (common.cuh)
  pdl_trigger();  // the next call may launch now; it waits for this grid to finish
  const ChunkOf c(p, b, split);
  attend_chunk_mma<DTypeQ, DTypeKV, Cache, HEAD_DIM, GROUP_SIZE, NUM_WARPS, NUM_STAGES, UNROLL, CLUSTER>(
      p, b, h0, h0 / p.ratio, split, c.start, c.end, c.cap, c.bad, smem);
}

// decode_split_mma_cluster with softmax_mode "unified_max".
template <typename DTypeQ, typename DTypeKV, typename Cache, int HEAD_DIM, int GROUP_SIZE,
          int NUM_WARPS, int NUM_STAGES, int UNROLL, int CLUSTER>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) __cluster_dims__(CLUSTER, 1, 1)
    decode_split_mma_cluster_umax(const DecodeParams p) {
  extern __shared__ __align__(128) uint4 smem[];  // no static shared memory (merge.cuh, FusedRole)
  const int split = blockIdx.x, b = blockIdx.z, h0 = blockIdx.y * GROUP_SIZE;
  prefetch_chunk_l2<DTypeKV, Cache, HEAD_DIM>(p, b, h0 / p.ratio, split);  // kv_cache.cuh
  pdl_wait();     // before any read of the inputs or write of the outputs (common.cuh)
  pdl_trigger();  // the next call may launch now; it waits for this grid to finish
  const ChunkOf c(p, b, split);
  attend_chunk_mma<DTypeQ, DTypeKV, Cache, HEAD_DIM, GROUP_SIZE, NUM_WARPS, NUM_STAGES, UNROLL, CLUSTER, true>(
      p, b, h0, h0 / p.ratio, split, c.start, c.end, c.cap, c.bad, smem);
}
#endif

// The no-split baseline (FlashAttention-2-style decode): grid (1, num_q_heads, batch), one query
// head per CTA, the whole sequence in one pass (p.chunk = n_max). Leaves SMs idle when
// batch * heads is small.
template <typename DTypeQ, typename DTypeKV, typename Cache, int HEAD_DIM, int NUM_WARPS,
          int NUM_STAGES, int UNROLL>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) decode_nosplit(const DecodeParams p) {
  extern __shared__ __align__(128) uint4 smem[];  // no static shared memory (merge.cuh, FusedRole)
  const int h = blockIdx.y, b = blockIdx.z;
  prefetch_chunk_l2<DTypeKV, Cache, HEAD_DIM>(p, b, h / p.ratio, 0);  // kv_cache.cuh
  pdl_wait();     // before any read of the inputs or write of the workspace (common.cuh)
  pdl_trigger();  // the merge (or the next call) may launch now; it waits for this grid to finish
  const ChunkOf c(p, b, 0);
  attend_chunk<DTypeQ, DTypeKV, Cache, HEAD_DIM, 1, NUM_WARPS, NUM_STAGES, UNROLL>(
      p, b, h, h / p.ratio, 0, c.start, c.end, c.cap, c.bad, smem);
}

}  // namespace fdpp
