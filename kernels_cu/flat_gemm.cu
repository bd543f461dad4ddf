#line 2 "kernels_cu/flat_gemm.cu"
// Flat GEMM for decode-phase linear layers: y[M, N] = x[M, K] . w[N, K]^T (+ bias[N]), M = 1..64.
// fp16 / bf16 in and out, fp32 accumulation. Bound by reading w once (N*K*2 bytes).
// Fusions of a decode step (GemmArgs; every variant): an RMSNorm prologue (rms_eps >= 0: each row
// of x divided by its RMS, the norm's weight folded into w) and a residual added in the epilogue
// (residual, which may be y itself: y += x . w^T), both before the single rounding of y.
//
// Variants (template parameters; Python: fdpp.gemm.FlatGemmConfig / GemvConfig, names derived there):
//   flat_gemm<DType, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES, M_TILES, L2_PREFETCH>  tensor cores
//       mma.sync m16n8k16 computing y^T = w . x^T: BLOCK_N rows of w on the MMA's M side (16 per
//       group), x's rows on its N side (M_TILES tiles of 8, so M = 1..8 wastes nothing); w and x
//       tiles of BLOCK_K columns streamed through NUM_STAGES cp.async stages in shared memory.
//   flat_tma<DType, NUM_WARPS, KSTEPS, M_TILES, NUM_STAGES, X_RING, GROUPS>  tensor cores, sm_90
//       only; tiles of 16 * GROUPS rows of w (and x's rows when X_RING) streamed by cp.async.bulk into a ring of
//       NUM_STAGES stages completed by mbarrier transaction counts; see the kernel.
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
// Measured (H200): results/gemm_llama3-8b_h200.csv; summary in fdpp/gemm.py's docstring.
#include "common.cuh"

namespace fdpp {

// ---- shared pieces ---------------------------------------------------------------------------
struct GemmArgs {
  const void* x; const void* w; const void* bias; void* y;
  float* ws;       // stream-K partials: [grid][2][M_CAP][BLOCK_N] fp32
  int* counters;   // [num_tiles], zero between launches (each fix-up resets its own)
  const float* w_scale;  // FP8 weights (flat_tma W8): float32 [N] per-output-row scale; else unused
  const void* residual;  // [M, N] in y's layout, added before the output is rounded (may be y itself); or null
  long long ldx, ldw, ldy;  // row strides in elements
  int M, N, K;
  int kb_per_tile;  // ceil(K / BLOCK_K)
  int total_iters;  // ceil(N / BLOCK_N) * kb_per_tile
  int grid;         // CTAs launched, 1 <= grid <= total_iters
  int prefetch;     // iterations of w a CTA asks the L2 for before pdl_wait() (0: none)
  float rms_eps;    // >= 0: RMSNorm prologue, each row of x divided by sqrt(mean(x^2) + rms_eps); < 0: off
};

// First iteration of CTA c: floor(T c / G). Every CTA owns at least one iteration (G <= T).
__device__ __forceinline__ int iter_begin(int c, int T, int G) {
  return (int)(((long long)T * c) / G);
}
// The CTA that owns iteration i: the largest c with iter_begin(c) <= i.
__device__ __forceinline__ int iter_owner(int i, int T, int G) {
  return (int)(((long long)(i + 1) * G - 1) / T);
}

// Column block of iteration `it` (tile it / KB): tile t visits its blocks starting at block t % KB
// and wrapping around, so CTAs on neighbouring tiles read different column offsets at the same time
// rather than all reading the same offset of rows a fixed stride apart.
__device__ __forceinline__ int col_block(int it, int KB) {
  const int t = it / KB;
  const int kb = it - t * KB + t % KB;
  return kb >= KB ? kb - KB : kb;
}

// Before pdl_wait(): the w rows of this CTA's first a.prefetch iterations are asked of the L2
// (common.cuh, l2_prefetch), one bulk prefetch per (row, iteration), so device memory streams them
// while the kernel before is finishing (w is read only; a hint either way: no value comes from it).
template <typename DType, int BLOCK_N, int BLOCK_K, int W_BYTES = 2>
__device__ __forceinline__ void prefetch_w_l2(const GemmArgs& a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (a.prefetch <= 0) return;
  const int c = blockIdx.x;
  const int begin = iter_begin(c, a.total_iters, a.grid);
  const int n_it = min(iter_begin(c + 1, a.total_iters, a.grid), begin + a.prefetch) - begin;
  for (int e = threadIdx.x; e < n_it * BLOCK_N; e += blockDim.x) {
    const int it = begin + e / BLOCK_N, row = (it / a.kb_per_tile) * BLOCK_N + e % BLOCK_N;
    const int k0 = col_block(it, a.kb_per_tile) * BLOCK_K;
    if (row < a.N)  // K % 8 == 0 and 16-byte aligned rows (checked in Python): whole 16-byte vectors
      l2_prefetch(static_cast<const unsigned char*>(a.w) + ((long long)row * a.ldw + k0) * W_BYTES,
                  min(BLOCK_K, a.K - k0) * W_BYTES);
  }
#endif
}

__device__ __forceinline__ float ld_cg_f32(const float* p) {  // L2 only: partials of other SMs
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

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

// The RMSNorm prologue (a.rms_eps >= 0), called by every thread after pdl_wait(): each warp sums
// the squares of its slice of every row of x (16-byte vectors warp * 32 + lane, + THREADS at a step:
// the CTA reads each row once, coalesced; four rows' loads in flight together) and writes the
// slice's sum to s_rmsp[m * NUM_WARPS + warp]. Nothing waits for it: the epilogue, after the main
// loop's barriers, adds a row's NUM_WARPS slices in a fixed order (rms_factor), so every CTA derives
// the same factor and the weight tiles already stream in while x's rows come from the L2.
template <typename DType, int NUM_WARPS>
__device__ __forceinline__ void row_rms(const GemmArgs& a, float* s_rmsp) {
  if (!(a.rms_eps >= 0.f)) return;
  constexpr int THREADS = NUM_WARPS * 32, ROWS = 4;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const DType* xp = static_cast<const DType*>(a.x);
  const uint4 z = make_uint4(0, 0, 0, 0);
  for (int m0 = 0; m0 < a.M; m0 += ROWS) {
    float s[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) s[r] = 0.f;
#pragma unroll 2
    for (int k = threadIdx.x * 8; k < a.K; k += THREADS * 8) {  // K % 8 == 0 (checked in Python)
      uint4 v[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) v[r] = m0 + r < a.M ? ldg_keep(xp + (long long)(m0 + r) * a.ldx + k) : z;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float f[8];
        TypeTraits<DType>::unpack(v[r], f);
#pragma unroll
        for (int q = 0; q < 8; ++q) s[r] = fmaf(f[q], f[q], s[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) s[r] += __shfl_xor_sync(0xffffffffu, s[r], off);
      if (lane == 0 && m0 + r < a.M) s_rmsp[(m0 + r) * NUM_WARPS + warp] = s[r];
    }
  }
}

// Row m's RMSNorm factor 1 / sqrt(mean(x[m]^2) + rms_eps) from its NUM_WARPS slice sums (row_rms).
template <int NUM_WARPS>
__device__ __forceinline__ float rms_factor(const GemmArgs& a, const float* s_rmsp, int m) {
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < NUM_WARPS; ++w) s += s_rmsp[m * NUM_WARPS + w];
  return rsqrtf(s / (float)a.K + a.rms_eps);
}

// The epilogue of one output element: v (the row's fp32 sum) times the FP8 row scale (when
// scaled), times the row's RMSNorm factor (the prologue's; NUM_WARPS: the kernel's warps), plus the
// bias, plus the residual element (raw bits, loaded by the caller); the caller rounds once to DType.
template <typename DType, int NUM_WARPS>
__device__ __forceinline__ float epilogue(const GemmArgs& a, float v, float scale, const float* s_rmsp, int m,
                                          float bias, unsigned short res) {
  v *= scale;
  if (a.rms_eps >= 0.f) v *= rms_factor<NUM_WARPS>(a, s_rmsp, m);
  v += bias;
  if (a.residual != nullptr) v += bits_to_float<DType>(res);
  return v;
}
__device__ __forceinline__ unsigned short residual_bits(const GemmArgs& a, int m, int n) {
  return a.residual != nullptr ? static_cast<const unsigned short*>(a.residual)[(long long)m * a.ldy + n] : 0;
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
// sums, m < M_CAP, j < BLOCK_N, row pitch RED_LD), and s_bias[j] holds the tile's bias (SCALED: and
// s_scale[j] the FP8 weights' row scale, applied to the sum before the bias); s_rms the rows' RMSNorm
// factors (row_rms). Sole owner: write y through the epilogue.
// Shared tile: store the fp32 partial, unscaled (fire and forget) and remember t; the fix-up waits
// for the end of the CTA, so no memory round trip stalls the stream here.
template <typename DType, int BLOCK_N, int M_CAP, int RED_LD, int NSLICES, int THREADS, bool SCALED = false>
__device__ __forceinline__ void segment_end(const GemmArgs& a, const float* red, const float* s_bias,
                                            const float* s_rms, int t, int c, SharedTiles& shared,
                                            const float* s_scale = nullptr) {
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
        const unsigned short res = residual_bits(a, m, n);
        float v = 0.f;
#pragma unroll
        for (int s = 0; s < NSLICES; ++s) v += red[(s * M_CAP + m) * RED_LD + j];
        TT::store(y + m * a.ldy + n, epilogue<DType, THREADS / 32>(a, v, SCALED ? s_scale[j] : 1.f, s_rms, m, s_bias[j], res));
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

// Sum the partials of tile t in CTA order (deterministic) and write y through the epilogue (SCALED:
// the FP8 weights' row scale; the RMSNorm factor, the bias, the residual). Loads go out in batches of
// 2 elements x 4 contributors, so a fix-up costs a memory round trip per batch, not per load.
template <typename DType, int BLOCK_N, int M_CAP, int THREADS, bool SCALED = false>
__device__ __forceinline__ void fix_up(const GemmArgs& a, int t, const float* s_rms) {
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
    float v[FQ], sc[FQ];
    unsigned short b[FQ], res[FQ];  // raw bits: converted after the partials' loads are in flight
#pragma unroll
    for (int q = 0; q < FQ; ++q) {
      const int e = e0 + q * THREADS, n = n0 + e % BLOCK_N;
      v[q] = 0.f;
      b[q] = (bias != nullptr && e < count && n < a.N) ? reinterpret_cast<const unsigned short*>(bias)[n] : 0;
      res[q] = e < count && n < a.N ? residual_bits(a, e / BLOCK_N, n) : 0;
      sc[q] = SCALED && e < count && n < a.N ? __ldg(a.w_scale + n) : 1.f;
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
      if (e < count && n < a.N)
        TT::store(y + m * a.ldy + n, epilogue<DType, THREADS / 32>(a, v[q], SCALED ? sc[q] : 1.f, s_rms, m, bits_to_float<DType>(b[q]),
                                                     res[q]));
    }
  }
}

// After the main loop: count this CTA in at each shared tile; the last CTA to arrive at a tile
// (all others have stored and fenced their partials) sums it and resets its counter to zero.
template <typename DType, int BLOCK_N, int M_CAP, int THREADS, bool SCALED = false>
__device__ __forceinline__ void finish_shared(const GemmArgs& a, const SharedTiles& shared, int* s_last,
                                              const float* s_rms) {
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
  if (s_last[0]) fix_up<DType, BLOCK_N, M_CAP, THREADS, SCALED>(a, shared.t0, s_rms);
  if (s_last[1]) fix_up<DType, BLOCK_N, M_CAP, THREADS, SCALED>(a, shared.t1, s_rms);
}

// Dump a warp's MMA accumulators (GPW row groups x M_TILES tiles of y^T) for K slice `ks` into
// red[ks][m][j]: D fragment (c0, c1) = (row g, x rows 2 c4 and 2 c4 + 1), (c2, c3) = row g + 8.
// `row0` is the warp's first tile row; the accumulators are zeroed for the next segment.
template <int GPW, int M_TILES, int M_CAP, int RED_LD>
__device__ __forceinline__ void dump_acc(float* red, float (&acc)[GPW][M_TILES][4], int ks, int row0) {
  const int lane = threadIdx.x % 32, g = lane >> 2, c4 = lane & 3;
#pragma unroll
  for (int gi = 0; gi < GPW; ++gi) {
    const int j = row0 + gi * 16 + g;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      float* rr = red + (ks * M_CAP + mt * 8 + 2 * c4) * RED_LD + j;
      rr[0] = acc[gi][mt][0];
      rr[RED_LD] = acc[gi][mt][1];
      rr[8] = acc[gi][mt][2];
      rr[RED_LD + 8] = acc[gi][mt][3];
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[gi][mt][q] = 0.f;
    }
  }
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
          const float* w_scale, const void* residual, long long ldx, long long ldw, long long ldy, int M, int N, int K,
          int kb_per_tile, int total_iters, int grid, int prefetch, float rms_eps) {
  using L = FlatLayout<BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES, M_TILES>;
  constexpr int THREADS = L::THREADS, VPR = L::VPR, M_CAP = L::M_CAP, GPW = L::GPW;
  const GemmArgs a{x, w, bias, y, ws, counters, w_scale, residual, ldx, ldw, ldy, M, N, K, kb_per_tile,
                     total_iters, grid, prefetch, rms_eps};
  prefetch_w_l2<DType, BLOCK_N, BLOCK_K>(a);  // w only: the L2 streams it while the kernel before ends
  pdl_wait();  // x (and y, ws, counters) may belong to the kernel before (common.cuh)
  pdl_trigger();
  extern __shared__ uint4 gemm_smem[];
  __shared__ int s_last[2];
  __shared__ float s_bias[BLOCK_N];
  __shared__ float s_rms[M_CAP * NUM_WARPS];  // row_rms's slice sums
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
    const int t = it / KB, kb = col_block(it, KB);
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
  row_rms<DType, NUM_WARPS>(a, s_rms);  // read after the loop's first barrier

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
      dump_acc<GPW, M_TILES, M_CAP, L::RED_LD>(red, acc, ks, wg * GPW * 16);
      __syncthreads();
      segment_end<DType, BLOCK_N, M_CAP, L::RED_LD, L::WARPS_K, THREADS>(a, red, s_bias, s_rms, i / KB, cta, shared);
    }
  }
  cp_async_wait<0>();
  finish_shared<DType, BLOCK_N, M_CAP, THREADS>(a, shared, s_last, s_rms);
}

// ---- flat GEMM on tensor cores, fed by bulk (TMA) copies: sm_90 -------------------------------
template <int NUM_WARPS, int KSTEPS, int M_TILES, int NUM_STAGES, int X_RING, int GROUPS, int W8 = 0>
struct TmaLayout {
  static constexpr int THREADS = NUM_WARPS * 32;
  static constexpr int BLOCK_N = 16 * GROUPS;               // GROUPS MMA row groups per tile
  static constexpr int BLOCK_K = 32 * KSTEPS * NUM_WARPS;   // every warp takes 32 * KSTEPS columns
  static constexpr int M_CAP = M_TILES * 8;
  static constexpr int PITCH = BLOCK_K * 2 + 64;            // x rows (and 16-bit w rows): = 64 mod 128,
                                                            // rows g, g + 1 in other banks
  // w rows: 16-bit as x's; FP8 (W8) BLOCK_K bytes + 32 (= 32 mod 128: a half-warp's 8-byte reads of
  // rows g..g+3, 32 bytes each, fall in distinct banks)
  static constexpr int W_PITCH = W8 ? BLOCK_K + 32 : PITCH;
  static constexpr int X_ROWS = X_RING ? M_CAP : 0;         // x rows copied into each stage
  static constexpr int X_OFF = BLOCK_N * W_PITCH;           // x rows' offset in a stage
  static constexpr int STAGE_BYTES = X_OFF + X_ROWS * PITCH;
  static constexpr int RED_LD = BLOCK_N + 4;
  static constexpr int RED_FLOATS = NUM_WARPS * M_CAP * RED_LD;
  static constexpr int SMEM_BYTES = NUM_STAGES * STAGE_BYTES + RED_FLOATS * 4;
  static_assert(KSTEPS >= 1 && KSTEPS <= 16 && NUM_STAGES >= 2, "bad TMA tile");
  static_assert(M_TILES >= 1 && M_TILES <= 8, "M_TILES in 1..8");
  static_assert(X_RING == 0 || X_RING == 1, "X_RING is 0 or 1");
  static_assert(GROUPS >= 1 && GROUPS <= 3, "GROUPS is 1, 2 or 3");
  static_assert(W8 == 0 || W8 == 1, "W8 is 0 or 1");
  static_assert(BLOCK_N <= THREADS, "one thread per tile row prefetches the bias");
};

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }


// 8 E4M3 codes (byte i = element i) -> 8 fp16 (pair j = elements 2j, 2j+1 in word j), exact.
__device__ __forceinline__ uint4 e4m3x8_to_f16(uint2 c) {
  uint4 r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n .reg .b16 a, b, c, d;\n mov.b32 {a, b}, %4;\n mov.b32 {c, d}, %5;\n"
      " cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n"
      " cvt.rn.f16x2.e4m3x2 %2, c;\n cvt.rn.f16x2.e4m3x2 %3, d;\n}"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(c.x), "r"(c.y));
#else
  r = make_uint4(0, 0, 0, 0);  // FP8 weights run on flat_tma only (sm_90)
#endif
  return r;
}

// Tile = 16 * GROUPS rows of w (GROUPS MMA row groups) by BLOCK_K columns; warp q multiplies
// columns [q * 32 * KSTEPS, (q + 1) * 32 * KSTEPS) of every group (GROUPS = 2 halves the x
// fragments read per byte of w, which matters once M reaches 8-16; GROUPS = 3 makes qkv's 6144 rows
// 128 tiles, one per SM), and the CTA's NUM_WARPS partial sums meet in
// shared memory at the end of each tile (segment_end). Warp 0 streams the stages with
// cp.async.bulk, lane r copying row r (BLOCK_K * 2 contiguous bytes), all completing on the
// stage's mbarrier: up to NUM_STAGES stages in flight without registers or load-store-unit slots.
// Copy size matters: on the H200, 1 KB copies streamed slower than 2 KB ones (o, M = 1: 14.3 vs
// 12.2 us; results/gemm_sweep_h200.csv), hence mostly tiles of 1024 columns in the search space.
// x: X_RING = 1 copies its M rows into each stage too (lanes 16.. issue them; rows M..M_CAP-1 are
// zeroed once), X_RING = 0 reads
// its fragments with L1-cached loads issued before the stage's barrier wait (smaller stages, more
// CTAs per SM, but x's bytes are re-read from L2 when it does not fit L1: the tuner decides).
// w fragments are read as in flat_gemm (rows padded instead of swizzled). Columns past K are
// zeroed in registers; rows past N are never copied and never stored.
// W8 = 1 (FP8 weights, W8A16; DType fp16): w holds OCP E4M3 codes, one byte per element (rows of
// BLOCK_K bytes copied), and w_scale a float32 scale per row of w. A lane reads 8 codes (8 bytes)
// where the 16-bit path reads 8 elements (16 bytes) and turns them into the same four fp16 pairs
// with cvt.rn.f16x2.e4m3x2 (exact: every E4M3 value is an fp16 value), so the MMAs and their
// operand order are the 16-bit path's; the row's scale multiplies the fp32 sum at the tile's end
// (segment_end / fix_up), before the bias: y = (sum_k x fp16(code)) * scale + bias, one rounding.
// grid = args.grid CTAs (1-D); dynamic shared memory TmaLayout::SMEM_BYTES.
template <typename DType, int NUM_WARPS, int KSTEPS, int M_TILES, int NUM_STAGES, int X_RING, int GROUPS, int W8>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
flat_tma(const void* x, const void* w, const void* bias, void* y, float* ws, int* counters,
         const float* w_scale, const void* residual, long long ldx, long long ldw, long long ldy, int M, int N, int K,
         int kb_per_tile, int total_iters, int grid, int prefetch, float rms_eps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(!W8 || sizeof(DType) == 2, "FP8 weights: 16-bit x");
  using L = TmaLayout<NUM_WARPS, KSTEPS, M_TILES, NUM_STAGES, X_RING, GROUPS, W8>;
  constexpr int THREADS = L::THREADS, BLOCK_N = L::BLOCK_N, BLOCK_K = L::BLOCK_K, M_CAP = L::M_CAP;
  constexpr int PITCH = L::PITCH, W_PITCH = L::W_PITCH, X_OFF = L::X_OFF;
  constexpr int WB = W8 ? 1 : 2;  // bytes per element of w
  const GemmArgs a{x, w, bias, y, ws, counters, w_scale, residual, ldx, ldw, ldy, M, N, K, kb_per_tile,
                     total_iters, grid, prefetch, rms_eps};
  prefetch_w_l2<DType, BLOCK_N, BLOCK_K, WB>(a);  // w only: the L2 streams it while the kernel before ends
  pdl_wait();  // x (and y, ws, counters) may belong to the kernel before (common.cuh)
  pdl_trigger();
  extern __shared__ uint4 gemm_smem[];
  __shared__ __align__(8) unsigned long long full[NUM_STAGES];
  __shared__ int s_last[2];
  __shared__ float s_bias[BLOCK_N];
  __shared__ float s_scale[W8 ? BLOCK_N : 1];
  __shared__ float s_rms[M_CAP * NUM_WARPS];  // row_rms's slice sums
  unsigned char* ring = reinterpret_cast<unsigned char*>(gemm_smem);
  float* red = reinterpret_cast<float*>(ring + NUM_STAGES * L::STAGE_BYTES);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane >> 2, c4 = lane & 3;
  const int cta = blockIdx.x;
  const int T = total_iters, KB = kb_per_tile;
  const int begin = iter_begin(cta, T, grid), end = iter_begin(cta + 1, T, grid);
  const DType* xp = static_cast<const DType*>(x);
  const unsigned char* wp = static_cast<const unsigned char*>(w);

  if (X_RING) {  // x rows M..M_CAP-1 are never copied: zero them in every stage once
    for (int e = tid; e < (M_CAP - M) * (PITCH / 16); e += THREADS) {
      const int r = M + e / (PITCH / 16), v = e % (PITCH / 16);
#pragma unroll
      for (int s = 0; s < NUM_STAGES; ++s)
        *reinterpret_cast<uint4*>(ring + s * L::STAGE_BYTES + X_OFF + r * PITCH + v * 16) = make_uint4(0, 0, 0, 0);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // before any bulk copy lands
  }
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < NUM_STAGES; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&full[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  auto issue = [&](int stage, int it) {  // warp 0
    const int t = it / KB, k0 = col_block(it, KB) * BLOCK_K;
    const int kcols = min(BLOCK_K, K - k0);  // FP8 weights: K % 16 == 0 (16-byte copies; checked in Python)
    const int rows = min(BLOCK_N, N - t * BLOCK_N);
    const unsigned bar = smem_u32(&full[stage]);
    const int xrows = X_RING ? M : 0;
    if (lane == 0)
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                   "r"(rows * kcols * WB + xrows * kcols * 2) : "memory");
    __syncwarp();
    for (int r = lane; r < BLOCK_N + xrows; r += 32) {
      if (r >= rows && r < BLOCK_N) continue;  // rows past N: not copied, never stored
      const bool wr = r < BLOCK_N;
      const void* src = wr ? (const void*)(wp + ((long long)(t * BLOCK_N + r) * ldw + k0) * WB)
                           : (const void*)(xp + (long long)(r - BLOCK_N) * ldx + k0);
      const unsigned dst = smem_u32(ring + stage * L::STAGE_BYTES + (wr ? r * W_PITCH : X_OFF + (r - BLOCK_N) * PITCH));
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(dst), "l"(src), "r"(kcols * (wr ? WB : 2)), "r"(bar)
                   : "memory");
    }
  };
  auto wait_full = [&](int stage, unsigned parity) {
    const unsigned bar = smem_u32(&full[stage]);
    unsigned done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  };

  if (warp == 0) {
#pragma unroll
    for (int s = 0; s < NUM_STAGES; ++s)
      if (begin + s < end) issue(s, begin + s);
  }
  row_rms<DType, NUM_WARPS>(a, s_rms);  // while the first stages stream in; read after the loop's barriers

  float acc[GROUPS][M_TILES][4], acc2[GROUPS][M_TILES][W8 ? 4 : 1];  // acc2: W8's odd steps
#pragma unroll
  for (int gi = 0; gi < GROUPS; ++gi)
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[gi][mt][q] = 0.f;
#pragma unroll
      for (int q = 0; q < (W8 ? 4 : 1); ++q) acc2[gi][mt][q] = 0.f;
    }

  SharedTiles shared;
  unsigned short bias_pre = 0;
  float scale_pre = 1.f;  // W8: this thread's row scale of the current tile (tid < BLOCK_N)
  int stage = 0;
  unsigned parity = 0;
  const int kw = warp * (32 * KSTEPS) + c4 * 8;  // this lane's first column within a block
  const uint4 z = make_uint4(0, 0, 0, 0);
  for (int i = begin; i < end; ++i) {
    if (i == begin || i % KB == 0) {
      bias_pre = bias_bits<DType, BLOCK_N>(a, i / KB);
      if constexpr (W8) {
        const int n = i / KB * BLOCK_N + tid;
        if (tid < BLOCK_N && n < N) scale_pre = __ldg(w_scale + n);
      }
    }
    const int k0 = col_block(i, KB) * BLOCK_K;
    uint4 xf[X_RING ? 1 : KSTEPS][M_TILES];  // issued before the wait: their latency hides behind it
    if (!X_RING) {
#pragma unroll
      for (int st = 0; st < (X_RING ? 1 : KSTEPS); ++st)
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          const int k = k0 + kw + st * 32, m = mt * 8 + g;
          xf[st][mt] = (k < K && m < M) ? ldg_keep(xp + (long long)m * ldx + k) : z;
        }
    }
    wait_full(stage, parity);
    const unsigned char* sw = ring + stage * L::STAGE_BYTES;
    // FP8 weights (W8) have twice the elements of a 16-bit stage per byte, so the per-step
    // overhead counts double: a whole column block (uniform) runs without the K-tail predicates
    // (TAIL false), and odd steps accumulate apart from even ones (two MMA chains, summed at the
    // tile's end). 16-bit weights: every step predicated, one chain, as before.
    auto steps = [&](const bool tail) {  // called with a constant: inlined, the predicate folds away
#pragma unroll
      for (int st = 0; st < KSTEPS; ++st) {
        const int kc = kw + st * 32;
        const bool ok = !tail || k0 + kc < K;
        uint4 lo[GROUPS], hi[GROUPS];
#pragma unroll
        for (int gi = 0; gi < GROUPS; ++gi) {
          if constexpr (W8) {
            lo[gi] = ok ? e4m3x8_to_f16(*reinterpret_cast<const uint2*>(sw + (gi * 16 + g) * W_PITCH + kc)) : z;
            hi[gi] = ok ? e4m3x8_to_f16(*reinterpret_cast<const uint2*>(sw + (gi * 16 + g + 8) * W_PITCH + kc)) : z;
          } else {
            lo[gi] = ok ? *reinterpret_cast<const uint4*>(sw + (gi * 16 + g) * PITCH + kc * 2) : z;
            hi[gi] = ok ? *reinterpret_cast<const uint4*>(sw + (gi * 16 + g + 8) * PITCH + kc * 2) : z;
          }
        }
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          const uint4 b = X_RING ? (ok ? *reinterpret_cast<const uint4*>(sw + X_OFF + (mt * 8 + g) * PITCH + kc * 2) : z)
                                 : xf[X_RING ? 0 : st][mt];
#pragma unroll
          for (int gi = 0; gi < GROUPS; ++gi) {
            float* d = W8 && st % 2 ? acc2[gi][mt] : acc[gi][mt];
            MmaOp<DType>::run(d, lo[gi].x, hi[gi].x, lo[gi].y, hi[gi].y, b.x, b.y);
            MmaOp<DType>::run(d, lo[gi].z, hi[gi].z, lo[gi].w, hi[gi].w, b.z, b.w);
          }
        }
      }
    };
    if (W8 && k0 + BLOCK_K <= K) steps(false);
    else steps(true);
    __syncthreads();  // every warp has read this slot: refill it with iteration i + NUM_STAGES
    if (warp == 0 && i + NUM_STAGES < end) issue(stage, i + NUM_STAGES);
    if (++stage == NUM_STAGES) { stage = 0; parity ^= 1u; }

    if (i + 1 == end || (i + 1) % KB == 0) {  // end of this CTA's share of tile i / KB
      if (tid < BLOCK_N) {
        s_bias[tid] = bits_to_float<DType>(bias_pre);
        if constexpr (W8) s_scale[tid] = scale_pre;
      }
      if constexpr (W8) {  // the two MMA chains into one (fp32 adds, a fixed order)
#pragma unroll
        for (int gi = 0; gi < GROUPS; ++gi)
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int q = 0; q < 4; ++q) { acc[gi][mt][q] += acc2[gi][mt][q]; acc2[gi][mt][q] = 0.f; }
      }
      dump_acc<GROUPS, M_TILES, M_CAP, L::RED_LD>(red, acc, warp, 0);
      __syncthreads();
      segment_end<DType, BLOCK_N, M_CAP, L::RED_LD, NUM_WARPS, THREADS, W8 != 0>(a, red, s_bias, s_rms, i / KB, cta,
                                                                                  shared, s_scale);
    }  // red, s_bias and s_scale are rewritten only after the next iteration's barrier
  }
  finish_shared<DType, BLOCK_N, M_CAP, THREADS, W8 != 0>(a, shared, s_last, s_rms);
#else
  __trap();  // bulk copies and mbarrier transaction counts need sm_90 (fdpp.gemm's rules say so)
#endif
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

// grid = args.grid CTAs (1-D); dynamic shared memory GemvLayout::SMEM_BYTES. Requires M <= M_MAX.
template <typename DType, int NUM_WARPS, int ROWS, int UNROLL, int M_MAX, int L2_PREFETCH>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
gemv(const void* x, const void* w, const void* bias, void* y, float* ws, int* counters,
     const float* w_scale, const void* residual, long long ldx, long long ldw, long long ldy, int M, int N, int K,
     int kb_per_tile, int total_iters, int grid, int prefetch, float rms_eps) {
  using L = GemvLayout<NUM_WARPS, ROWS, UNROLL, M_MAX>;
  using TT = TypeTraits<DType>;
  constexpr int THREADS = L::THREADS, BLOCK_N = L::BLOCK_N, BLOCK_K = L::BLOCK_K;
  const GemmArgs a{x, w, bias, y, ws, counters, w_scale, residual, ldx, ldw, ldy, M, N, K, kb_per_tile,
                     total_iters, grid, prefetch, rms_eps};
  prefetch_w_l2<DType, BLOCK_N, BLOCK_K>(a);  // w only: the L2 streams it while the kernel before ends
  pdl_wait();  // x (and y, ws, counters) may belong to the kernel before (common.cuh)
  pdl_trigger();
  extern __shared__ uint4 gemm_smem[];
  __shared__ int s_last[2];
  __shared__ float s_bias[BLOCK_N];
  __shared__ float s_rms[M_MAX * NUM_WARPS];  // row_rms's slice sums
  float* red = reinterpret_cast<float*>(gemm_smem);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int cta = blockIdx.x;
  const int T = total_iters, KB = kb_per_tile;
  const int begin = iter_begin(cta, T, grid), end = iter_begin(cta + 1, T, grid);
  const DType* xp = static_cast<const DType*>(x);
  const DType* wp = static_cast<const DType*>(w);

  uint4 nxt[ROWS][UNROLL];
  auto load = [&](int it) {
    const int t = it / KB, kb = col_block(it, KB);
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
  row_rms<DType, NUM_WARPS>(a, s_rms);  // read after the barrier that ends the first tile
  for (int i = begin; i < end; ++i) {
    if (i == begin || i % KB == 0) bias_pre = bias_bits<DType, BLOCK_N>(a, i / KB);
    uint4 cur[ROWS][UNROLL];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) cur[r][u] = nxt[r][u];
    if (i + 1 < end) load(i + 1);  // next tile in flight while this one is summed

    const int k0 = col_block(i, KB) * BLOCK_K;
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
      segment_end<DType, BLOCK_N, M_MAX, L::RED_LD, 1, THREADS>(a, red, s_bias, s_rms, i / KB, cta, shared);
    }
  }
  finish_shared<DType, BLOCK_N, M_MAX, THREADS>(a, shared, s_last, s_rms);
}

}  // namespace fdpp
