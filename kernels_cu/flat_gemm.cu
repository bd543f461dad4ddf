#line 2 "kernels_cu/flat_gemm.cu"
// Flat GEMM for decode-phase linear layers: y[M, N] = x[M, K] . w[N, K]^T (+ bias[N]), M = 1..64.
// fp16 / bf16 in and out, fp32 accumulation. Bound by reading w once (N*K*2 bytes).
//
// Variants (template parameters; Python: fdpp.gemm.FlatGemmConfig / GemvConfig, names derived there):
//   flat_gemm<DType, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES, M_TILES, L2_PREFETCH>  tensor cores
//       mma.sync m16n8k16 computing y^T = w . x^T: BLOCK_N rows of w on the MMA's M side (16 per
//       group), x's rows on its N side (M_TILES tiles of 8, so M = 1..8 wastes nothing); w and x
//       tiles of BLOCK_K columns streamed through NUM_STAGES cp.async stages in shared memory.
//   gemv<DType, NUM_WARPS, ROWS, UNROLL, M_MAX, L2_PREFETCH>  CUDA cores, M <= M_MAX (1, 2, 4)
//       each warp streams ROWS rows of w straight into registers (UNROLL 16-byte loads per row and
//       lane, next tile prefetched), x read through L1, fp32 FMAs, warp-shuffle reduction.
//   L2_PREFETCH (both): 0, or 256 to add the .L2::256B prefetch-size hint to the loads of w (every
//       256-byte block a warp touches is read whole, so the hint fetches nothing unused).
//
// Both kernels share one work split ("stream-K"): the iterations (tile of BLOCK_N rows) x (block of
// BLOCK_K columns) are cut into `grid` equal contiguous ranges, one per CTA; a launch-time grid of
// (SMs x resident CTAs) fills the GPU exactly once whatever N and K are. A tile covered by one CTA
// is written directly; a tile shared by several CTAs is fixed up by the last one to finish (fp32
// partials in a workspace, an atomic counter per tile): it sums the partials in CTA order, so the
// result does not depend on timing (deterministic), and it resets the counter for the next launch.
// With grid = number of tiles this is the plain one-CTA-per-tile kernel; with grid = tiles x S and
// S dividing the column blocks, classic split-K.
//
// mma fragments without ldmatrix: any permutation of k that A and B share leaves the dot product
// unchanged, so lane (g = lane / 4, c = lane % 4) takes the 16-byte vector c of every 32-column step
// from w rows g and g + 8 and from x row g: its four 32-bit words are exactly the A and B registers
// of two m16n8k16 MMAs. Shared memory rows are swizzled (vector ^ 4 on odd rows) so the 8 lanes of
// a quarter-warp (two rows, four vectors each) hit distinct banks, as do the cp.async writes.
//
// Requirements (checked in Python): K % 8 == 0, 16-byte aligned rows; tails of N and K are zero-
// filled in shared memory / registers and masked on store.
//
// Measured (H200, results/gemm_llama3-8b_h200.csv): see fdpp/bench_gemm.py output.
#include "common.cuh"

namespace fdpp {

// ---- shared pieces ---------------------------------------------------------------------------
struct GemmArgs {
  const void* x; const void* w; const void* bias; void* y;
  float* ws;       // stream-K partials: [grid][2][M_CAP][BLOCK_N] fp32
  int* counters;   // [num_tiles], zero between launches (each fix-up resets its own)
  long long ldx, ldw, ldy;  // row strides in elements
  int M, N, K;
  int kb_per_tile;  // ceil(K / BLOCK_K)
  int total_iters;  // ceil(N / BLOCK_N) * kb_per_tile
  int grid;         // CTAs launched, 1 <= grid <= total_iters
};

// First iteration of CTA c: floor(T c / G). Every CTA owns at least one iteration (G <= T).
__device__ __forceinline__ int iter_begin(int c, int T, int G) {
  return (int)(((long long)T * c) / G);
}
// The CTA that owns iteration i: the largest c with iter_begin(c) <= i.
__device__ __forceinline__ int iter_owner(int i, int T, int G) {
  return (int)(((long long)(i + 1) * G - 1) / T);
}

__device__ __forceinline__ float ld_cg_f32(const float* p) {  // L2 only: partials of other SMs
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

template <typename T> struct MmaOp;
template <> struct MmaOp<half_t> {
  __device__ __forceinline__ static void run(float* d, unsigned a0, unsigned a1, unsigned a2,
                                             unsigned a3, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};
template <> struct MmaOp<bfloat16_t> {
  __device__ __forceinline__ static void run(float* d, unsigned a0, unsigned a1, unsigned a2,
                                             unsigned a3, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

// Bias of this thread's column of tile t (0 without bias), as raw bits: the load stays in flight
// until the tile's end, where it is converted and put in shared memory.
template <typename DType, int BLOCK_N>
__device__ __forceinline__ unsigned short bias_bits(const GemmArgs& a, int t) {
  const int n = t * BLOCK_N + (int)threadIdx.x;
  if (a.bias == nullptr || threadIdx.x >= BLOCK_N || n >= a.N) return 0;
  return static_cast<const unsigned short*>(a.bias)[n];
}
template <typename DType>
__device__ __forceinline__ float bits_to_float(unsigned short b) {
  DType v;
  v.bits = b;
  return TypeTraits<DType>::load(&v);
}

// Contributors of tile t: CTAs first..last (first == last: the tile is one CTA's alone).
__device__ __forceinline__ void tile_owners(const GemmArgs& a, int t, int& first, int& last) {
  first = iter_owner(t * a.kb_per_tile, a.total_iters, a.grid);
  last = iter_owner(t * a.kb_per_tile + a.kb_per_tile - 1, a.total_iters, a.grid);
}
// Workspace slot of CTA c's share of tile t: 0 if t is where c's range begins, else 1 (its last).
__device__ __forceinline__ int ws_slot(const GemmArgs& a, int c, int t) {
  return iter_begin(c, a.total_iters, a.grid) / a.kb_per_tile == t ? 0 : 1;
}

// Tiles this CTA shares with others (at most its first and its last); finished after the main loop.
struct SharedTiles {
  int n = 0, t0 = 0, t1 = 0;
  __device__ __forceinline__ void add(int t) {
    if (n == 0) t0 = t; else t1 = t;
    ++n;
  }
};

// End of CTA c's share of tile t. Its sums are in shared memory, red[s][m][j] (s < NSLICES partial
// sums, m < M_CAP, j < BLOCK_N, row pitch RED_LD), and s_bias[j] holds the tile's bias. Sole owner:
// write y. Shared tile: store the fp32 partial (fire and forget) and remember t; the fix-up waits
// for the end of the CTA, so no memory round trip stalls the stream here.
template <typename DType, int BLOCK_N, int M_CAP, int RED_LD, int NSLICES, int THREADS>
__device__ __forceinline__ void segment_end(const GemmArgs& a, const float* red, const float* s_bias,
                                            int t, int c, SharedTiles& shared) {
  using TT = TypeTraits<DType>;
  const int tid = threadIdx.x;
  int first, last;
  tile_owners(a, t, first, last);
  const int n0 = t * BLOCK_N;
  const int count = a.M * BLOCK_N;
  if (first == last) {
    DType* y = static_cast<DType*>(a.y);
    for (int e = tid; e < count; e += THREADS) {
      const int m = e / BLOCK_N, j = e % BLOCK_N, n = n0 + j;
      if (n < a.N) {
        float v = 0.f;
#pragma unroll
        for (int s = 0; s < NSLICES; ++s) v += red[(s * M_CAP + m) * RED_LD + j];
        TT::store(y + m * a.ldy + n, v + s_bias[j]);
      }
    }
    return;
  }
  float* mine = a.ws + ((long long)c * 2 + ws_slot(a, c, t)) * (M_CAP * BLOCK_N);
  for (int e = tid; e < count; e += THREADS) {
    const int m = e / BLOCK_N, j = e % BLOCK_N;
    float v = 0.f;
#pragma unroll
    for (int s = 0; s < NSLICES; ++s) v += red[(s * M_CAP + m) * RED_LD + j];
    mine[e] = v;
  }
  shared.add(t);
}

// Sum the partials of tile t in CTA order (deterministic) and write y. Loads go out in batches of
// 2 elements x 4 contributors, so a fix-up costs a memory round trip per batch, not per load.
template <typename DType, int BLOCK_N, int M_CAP, int THREADS>
__device__ __forceinline__ void fix_up(const GemmArgs& a, int t) {
  using TT = TypeTraits<DType>;
  constexpr int SLOT = M_CAP * BLOCK_N;
  constexpr int FQ = 2;  // elements per thread per batch (x 4 contributors = 8 loads in flight)
  const int tid = threadIdx.x;
  int first, last;
  tile_owners(a, t, first, last);
  const int n0 = t * BLOCK_N;
  const int count = a.M * BLOCK_N;
  const DType* bias = static_cast<const DType*>(a.bias);
  DType* y = static_cast<DType*>(a.y);
  for (int e0 = tid; e0 < count; e0 += FQ * THREADS) {
    float v[FQ];
    unsigned short b[FQ];  // raw bits: converted after the partials' loads are in flight
#pragma unroll
    for (int q = 0; q < FQ; ++q) {
      const int e = e0 + q * THREADS, n = n0 + e % BLOCK_N;
      v[q] = 0.f;
      b[q] = (bias != nullptr && e < count && n < a.N) ? reinterpret_cast<const unsigned short*>(bias)[n] : 0;
    }
    for (int cc0 = first; cc0 <= last; cc0 += 4) {
      float p[FQ][4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int cc = cc0 + r;
        const float* src = a.ws + ((long long)cc * 2 + (cc <= last ? ws_slot(a, cc, t) : 0)) * SLOT;
#pragma unroll
        for (int q = 0; q < FQ; ++q) {
          const int e = e0 + q * THREADS;
          p[q][r] = (cc <= last && e < count) ? ld_cg_f32(src + e) : 0.f;
        }
      }
#pragma unroll
      for (int q = 0; q < FQ; ++q)
#pragma unroll
        for (int r = 0; r < 4; ++r) v[q] += p[q][r];  // contributor order: deterministic
    }
#pragma unroll
    for (int q = 0; q < FQ; ++q) {
      const int e = e0 + q * THREADS, m = e / BLOCK_N, n = n0 + e % BLOCK_N;
      if (e < count && n < a.N) TT::store(y + m * a.ldy + n, v[q] + bits_to_float<DType>(b[q]));
    }
  }
}

// After the main loop: count this CTA in at each shared tile; the last CTA to arrive at a tile
// (all others have stored and fenced their partials) sums it and resets its counter to zero.
template <typename DType, int BLOCK_N, int M_CAP, int THREADS>
__device__ __forceinline__ void finish_shared(const GemmArgs& a, const SharedTiles& shared, int* s_last) {
  if (shared.n == 0) return;  // uniform across the CTA
  __syncthreads();            // every thread's partial stores are issued
  if (threadIdx.x == 0) {
    __threadfence();          // ... and visible GPU-wide before we count ourselves in
    int f0, l0, f1 = 0, l1 = 0;
    tile_owners(a, shared.t0, f0, l0);
    const int p0 = atomicAdd(a.counters + shared.t0, 1);
    int p1 = -1;
    if (shared.n > 1) {
      tile_owners(a, shared.t1, f1, l1);
      p1 = atomicAdd(a.counters + shared.t1, 1);
    }
    s_last[0] = p0 == l0 - f0;
    s_last[1] = shared.n > 1 && p1 == l1 - f1;
    if (s_last[0]) a.counters[shared.t0] = 0;  // everyone has arrived: ready for the next launch
    if (s_last[1]) a.counters[shared.t1] = 0;
    __threadfence();
  }
  __syncthreads();
  if (s_last[0]) fix_up<DType, BLOCK_N, M_CAP, THREADS>(a, shared.t0);
  if (s_last[1]) fix_up<DType, BLOCK_N, M_CAP, THREADS>(a, shared.t1);
}

// ---- flat GEMM on tensor cores ------------------------------------------------------------------
template <int BLOCK_N, int BLOCK_K, int NUM_WARPS, int NUM_STAGES, int M_TILES>
struct FlatLayout {
  static constexpr int THREADS = NUM_WARPS * 32;
  static constexpr int GROUPS = BLOCK_N / 16;                               // 16-row MMA groups
  static constexpr int WARPS_K = GROUPS >= NUM_WARPS ? 1 : NUM_WARPS / GROUPS;  // warps per group
  static constexpr int GPW = GROUPS >= NUM_WARPS ? GROUPS / NUM_WARPS : 1;  // groups per warp
  static constexpr int KW = BLOCK_K / WARPS_K;                              // columns per warp/stage
  static constexpr int STEPS = KW / 32;
  static constexpr int VPR = BLOCK_K / 8;                                   // 16-B vectors per row
  static constexpr int M_CAP = M_TILES * 8;
  static constexpr int W_VECS = BLOCK_N * VPR;
  static constexpr int X_VECS = M_CAP * VPR;
  static constexpr int STAGE_VECS = W_VECS + X_VECS;
  static constexpr int RED_LD = BLOCK_N + 4;  // +4 floats: the accumulator dump is conflict-free
  static constexpr int RED_FLOATS = WARPS_K * M_CAP * RED_LD;
  static constexpr int SMEM_BYTES = NUM_STAGES * STAGE_VECS * 16 + RED_FLOATS * 4;
  static_assert(BLOCK_N % 16 == 0, "BLOCK_N must be a multiple of 16");
  static_assert(GROUPS % NUM_WARPS == 0 || NUM_WARPS % GROUPS == 0, "warps must tile the row groups");
  static_assert(KW % 32 == 0 && KW * WARPS_K == BLOCK_K, "BLOCK_K / warps-per-group must be a multiple of 32");
  static_assert(VPR % 8 == 0, "BLOCK_K must be a multiple of 64 (swizzle works on 128-byte rows)");
  static_assert(NUM_STAGES >= 2, "cp.async pipeline needs at least 2 stages");
  static_assert(M_TILES >= 1 && M_TILES <= 8, "M_TILES in 1..8");
  static_assert(BLOCK_N <= THREADS, "one thread per tile row prefetches the bias");
};

// 16-byte global->shared copy (zero-filled when src_bytes = 0), optionally with the L2 prefetch hint.
template <int L2_PREFETCH>
__device__ __forceinline__ void cp_async16_hint(void* smem_dst, const void* gmem_src, int src_bytes) {
  const unsigned int dst = (unsigned int)__cvta_generic_to_shared(smem_dst);
  if constexpr (L2_PREFETCH == 256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
                 "r"(src_bytes) : "memory");
  } else {
    static_assert(L2_PREFETCH == 0, "L2_PREFETCH must be 0 or 256");
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes)
                 : "memory");
  }
}

__device__ __forceinline__ int swz(int r, int v, int vpr) { return r * vpr + (v ^ ((r & 1) << 2)); }

// One thread block; grid = args.grid CTAs (1-D); dynamic shared memory FlatLayout::SMEM_BYTES.
template <typename DType, int BLOCK_N, int BLOCK_K, int NUM_WARPS, int NUM_STAGES, int M_TILES,
          int L2_PREFETCH>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
flat_gemm(const void* x, const void* w, const void* bias, void* y, float* ws, int* counters,
          long long ldx, long long ldw, long long ldy, int M, int N, int K, int kb_per_tile,
          int total_iters, int grid) {
  using L = FlatLayout<BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES, M_TILES>;
  constexpr int THREADS = L::THREADS, VPR = L::VPR, M_CAP = L::M_CAP, GPW = L::GPW;
  const GemmArgs a{x, w, bias, y, ws, counters, ldx, ldw, ldy, M, N, K, kb_per_tile, total_iters, grid};
  extern __shared__ uint4 gemm_smem[];
  __shared__ int s_last[2];
  __shared__ float s_bias[BLOCK_N];
  float* red = reinterpret_cast<float*>(gemm_smem + NUM_STAGES * L::STAGE_VECS);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane >> 2, c4 = lane & 3;
  const int ks = warp % L::WARPS_K, wg = warp / L::WARPS_K;
  const int cta = blockIdx.x;
  const int T = total_iters, KB = kb_per_tile;
  const int begin = iter_begin(cta, T, grid), end = iter_begin(cta + 1, T, grid);
  const DType* xp = static_cast<const DType*>(x);
  const DType* wp = static_cast<const DType*>(w);

  // x rows M..M_CAP-1 are never loaded: keep them zero in every stage (their MMA columns are
  // discarded anyway; zero keeps them finite).
  for (int e = M * VPR + tid; e < M_CAP * VPR; e += THREADS) {
#pragma unroll
    for (int s = 0; s < NUM_STAGES; ++s) gemm_smem[s * L::STAGE_VECS + L::W_VECS + e] = make_uint4(0, 0, 0, 0);
  }

  auto load_stage = [&](int stage, int it) {
    const int t = it / KB, kb = it - t * KB;
    const int n0 = t * BLOCK_N, k0 = kb * BLOCK_K;
    uint4* sw = gemm_smem + stage * L::STAGE_VECS;
    uint4* sx = sw + L::W_VECS;
#pragma unroll
    for (int j = 0; j < (L::W_VECS + THREADS - 1) / THREADS; ++j) {
      const int e = tid + j * THREADS;
      if (L::W_VECS % THREADS == 0 || e < L::W_VECS) {
        const int r = e / VPR, v = e % VPR;
        const int n = n0 + r, k = k0 + v * 8;
        const bool ok = n < N && k < K;
        const DType* src = ok ? wp + (long long)n * ldw + k : wp;
        cp_async16_hint<L2_PREFETCH>(sw + swz(r, v, VPR), src, ok ? 16 : 0);
      }
    }
    for (int e = tid; e < M * VPR; e += THREADS) {
      const int r = e / VPR, v = e % VPR;
      const int k = k0 + v * 8;
      const bool ok = k < K;
      const DType* src = ok ? xp + (long long)r * ldx + k : xp;
      cp_async16_hint<0>(sx + swz(r, v, VPR), src, ok ? 16 : 0);
    }
  };

  // prologue: NUM_STAGES - 1 tiles in flight
#pragma unroll
  for (int s = 0; s < NUM_STAGES - 1; ++s) {
    if (begin + s < end) load_stage(s, begin + s);
    cp_async_commit();
  }

  float acc[GPW][M_TILES][4];
#pragma unroll
  for (int gi = 0; gi < GPW; ++gi)
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[gi][mt][q] = 0.f;

  SharedTiles shared;
  unsigned short bias_pre = 0;
  int stage = 0;
  for (int i = begin; i < end; ++i) {
    cp_async_wait<NUM_STAGES - 2>();
    __syncthreads();
    if (i == begin || i % KB == 0) bias_pre = bias_bits<DType, BLOCK_N>(a, i / KB);
    {
      const int li = i + NUM_STAGES - 1;
      int ls = stage + NUM_STAGES - 1;
      if (ls >= NUM_STAGES) ls -= NUM_STAGES;
      if (li < end) load_stage(ls, li);
      cp_async_commit();
    }
    const uint4* sw = gemm_smem + stage * L::STAGE_VECS;
    const uint4* sx = sw + L::W_VECS;
#pragma unroll
    for (int st = 0; st < L::STEPS; ++st) {
      const int v = ks * (L::KW / 8) + st * 4 + c4;
      uint4 alo[GPW], ahi[GPW];
#pragma unroll
      for (int gi = 0; gi < GPW; ++gi) {
        const int r = (wg * GPW + gi) * 16 + g;
        alo[gi] = sw[swz(r, v, VPR)];
        ahi[gi] = sw[swz(r + 8, v, VPR)];
      }
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        const uint4 b = sx[swz(mt * 8 + g, v, VPR)];
#pragma unroll
        for (int gi = 0; gi < GPW; ++gi) {
          MmaOp<DType>::run(acc[gi][mt], alo[gi].x, ahi[gi].x, alo[gi].y, ahi[gi].y, b.x, b.y);
          MmaOp<DType>::run(acc[gi][mt], alo[gi].z, ahi[gi].z, alo[gi].w, ahi[gi].w, b.z, b.w);
        }
      }
    }
    if (++stage == NUM_STAGES) stage = 0;

    if (i + 1 == end || (i + 1) % KB == 0) {  // end of this CTA's share of tile i / KB
      __syncthreads();  // everyone is done with the previous tile's red and s_bias
      if (tid < BLOCK_N) s_bias[tid] = bits_to_float<DType>(bias_pre);
#pragma unroll
      for (int gi = 0; gi < GPW; ++gi) {
        const int j = (wg * GPW + gi) * 16 + g;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          float* rr = red + (ks * M_CAP + mt * 8 + 2 * c4) * L::RED_LD + j;
          rr[0] = acc[gi][mt][0];
          rr[L::RED_LD] = acc[gi][mt][1];
          rr[8] = acc[gi][mt][2];
          rr[L::RED_LD + 8] = acc[gi][mt][3];
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[gi][mt][q] = 0.f;
        }
      }
      __syncthreads();
      segment_end<DType, BLOCK_N, M_CAP, L::RED_LD, L::WARPS_K, THREADS>(a, red, s_bias, i / KB, cta, shared);
    }
  }
  cp_async_wait<0>();
  finish_shared<DType, BLOCK_N, M_CAP, THREADS>(a, shared, s_last);
}

// ---- GEMV on CUDA cores (smallest M) -----------------------------------------------------------
template <int NUM_WARPS, int ROWS, int UNROLL, int M_MAX>
struct GemvLayout {
  static constexpr int THREADS = NUM_WARPS * 32;
  static constexpr int BLOCK_N = NUM_WARPS * ROWS;
  static constexpr int BLOCK_K = 32 * 8 * UNROLL;
  static constexpr int RED_LD = BLOCK_N + 4;
  static constexpr int SMEM_BYTES = M_MAX * RED_LD * 4;
  static_assert(ROWS >= 1 && UNROLL >= 1 && M_MAX >= 1 && M_MAX <= 8, "bad GEMV shape");
  static_assert(BLOCK_N <= THREADS, "one thread per tile row prefetches the bias");
};

template <int L2_PREFETCH>
__device__ __forceinline__ uint4 ldg_stream(const void* p) {  // read once: skip L1
  uint4 r;
  if constexpr (L2_PREFETCH == 256) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  } else {
    static_assert(L2_PREFETCH == 0, "L2_PREFETCH must be 0 or 256");
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  }
  return r;
}
__device__ __forceinline__ uint4 ldg_keep(const void* p) {  // x: shared by every warp, keep in L1
  uint4 r;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// grid = args.grid CTAs (1-D); dynamic shared memory GemvLayout::SMEM_BYTES. Requires M <= M_MAX.
template <typename DType, int NUM_WARPS, int ROWS, int UNROLL, int M_MAX, int L2_PREFETCH>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
gemv(const void* x, const void* w, const void* bias, void* y, float* ws, int* counters,
     long long ldx, long long ldw, long long ldy, int M, int N, int K, int kb_per_tile,
     int total_iters, int grid) {
  using L = GemvLayout<NUM_WARPS, ROWS, UNROLL, M_MAX>;
  using TT = TypeTraits<DType>;
  constexpr int THREADS = L::THREADS, BLOCK_N = L::BLOCK_N, BLOCK_K = L::BLOCK_K;
  const GemmArgs a{x, w, bias, y, ws, counters, ldx, ldw, ldy, M, N, K, kb_per_tile, total_iters, grid};
  extern __shared__ uint4 gemm_smem[];
  __shared__ int s_last[2];
  __shared__ float s_bias[BLOCK_N];
  float* red = reinterpret_cast<float*>(gemm_smem);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int cta = blockIdx.x;
  const int T = total_iters, KB = kb_per_tile;
  const int begin = iter_begin(cta, T, grid), end = iter_begin(cta + 1, T, grid);
  const DType* xp = static_cast<const DType*>(x);
  const DType* wp = static_cast<const DType*>(w);

  uint4 nxt[ROWS][UNROLL];
  auto load = [&](int it) {
    const int t = it / KB, kb = it - t * KB;
    const int n0 = t * BLOCK_N + warp * ROWS, k0 = kb * BLOCK_K;
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int n = n0 + r, k = k0 + (u * 32 + lane) * 8;
        nxt[r][u] = (n < N && k < K) ? ldg_stream<L2_PREFETCH>(wp + (long long)n * ldw + k) : make_uint4(0, 0, 0, 0);
      }
  };

  float acc[ROWS][M_MAX];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int m = 0; m < M_MAX; ++m) acc[r][m] = 0.f;

  SharedTiles shared;
  unsigned short bias_pre = 0;
  load(begin);
  for (int i = begin; i < end; ++i) {
    if (i == begin || i % KB == 0) bias_pre = bias_bits<DType, BLOCK_N>(a, i / KB);
    uint4 cur[ROWS][UNROLL];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) cur[r][u] = nxt[r][u];
    if (i + 1 < end) load(i + 1);  // next tile in flight while this one is summed

    const int k0 = (i % KB) * BLOCK_K;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int k = k0 + (u * 32 + lane) * 8;
      if (k < K) {
        float wf[ROWS][8];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) TT::unpack(cur[r][u], wf[r]);
#pragma unroll
        for (int m = 0; m < M_MAX; ++m) {
          if (m < M) {
            float xf[8];
            TT::unpack(ldg_keep(xp + (long long)m * ldx + k), xf);
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
#pragma unroll
              for (int q = 0; q < 8; ++q) acc[r][m] = fmaf(wf[r][q], xf[q], acc[r][m]);
          }
        }
      }
    }

    if (i + 1 == end || (i + 1) % KB == 0) {  // end of this CTA's share of tile i / KB
      __syncthreads();  // everyone is done with the previous tile's red and s_bias
      if (tid < BLOCK_N) s_bias[tid] = bits_to_float<DType>(bias_pre);
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int m = 0; m < M_MAX; ++m) {
          float v = acc[r][m];
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
          if (lane == 0) red[m * L::RED_LD + warp * ROWS + r] = v;
          acc[r][m] = 0.f;
        }
      __syncthreads();
      segment_end<DType, BLOCK_N, M_MAX, L::RED_LD, 1, THREADS>(a, red, s_bias, i / KB, cta, shared);
    }
  }
  finish_shared<DType, BLOCK_N, M_MAX, THREADS>(a, shared, s_last);
}

}  // namespace fdpp
