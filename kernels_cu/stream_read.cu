#line 2 "kernels_cu/stream_read.cu"
// Streaming read: the memory floor. Reads n_vec 16-byte vectors once and nothing else, so its time
// for a given number of bytes is the least any kernel that must read those bytes can take.
// fdpp.timing uses it for the floor of every benchmark row and for the card's peak read bandwidth.
//
// Variants (template parameters; Python: fdpp.timing.StreamReadConfig, names derived there):
//   UNROLL       independent 16-byte loads in flight per thread per iteration (grid-stride: load u
//                of thread t reads vector i + u * stride, so each warp-wide load is coalesced)
//   NUM_WARPS    warps per CTA
//   CTAS_PER_SM  CTAs per SM the grid is sized for; also __launch_bounds__' minimum, so ptxas keeps
//                all UNROLL loads in flight instead of trading them for occupancy the grid never uses
//                (with the minimum left out, ptxas held u8/w8 to 32 registers and ~4 loads in flight)
//   L2_PREFETCH  0: ld.global.nc.L1::no_allocate.v4;  64/128/256: also the .L2::<n>B prefetch-size
//                hint (sm_80+)
// Every loaded word is XOR-folded into one value per thread, written only if it equals a magic
// constant: the loads cannot be dropped and the store costs nothing.
//
// Measured (H200): ANCHORS.md gives 4.49 TB/s for a 16-byte __ldg grid-stride read at 4 GiB;
// fdpp.bench records the best variant's figure in each run's .meta.json (peak_read_gbps).

namespace fdpp {

template <int L2_PREFETCH>
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  if constexpr (L2_PREFETCH == 256) {
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else if constexpr (L2_PREFETCH == 128) {
    asm("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else if constexpr (L2_PREFETCH == 64) {
    asm("ld.global.nc.L1::no_allocate.L2::64B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else {
    static_assert(L2_PREFETCH == 0, "L2_PREFETCH must be 0, 64, 128 or 256");
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  }
  return v;
}

__device__ __forceinline__ unsigned int fold(const uint4& v) { return v.x ^ v.y ^ v.z ^ v.w; }

template <int UNROLL, int NUM_WARPS, int CTAS_PER_SM, int L2_PREFETCH>
__global__ void __launch_bounds__(NUM_WARPS * 32, CTAS_PER_SM)
stream_read(const uint4* __restrict__ src, unsigned long long n_vec, unsigned int* __restrict__ sink) {
  static_assert(UNROLL >= 1 && UNROLL <= 32, "UNROLL must be in 1..32");
  static_assert(NUM_WARPS >= 1 && NUM_WARPS <= 32, "NUM_WARPS must be in 1..32");
  static_assert(CTAS_PER_SM >= 1 && NUM_WARPS * CTAS_PER_SM <= 64, "CTAS_PER_SM x NUM_WARPS <= 64 warps");
  constexpr unsigned long long THREADS = NUM_WARPS * 32;
  const unsigned long long stride = (unsigned long long)gridDim.x * THREADS;
  unsigned long long i = (unsigned long long)blockIdx.x * THREADS + threadIdx.x;
  unsigned int acc = 0;
  // Main loop: UNROLL loads issued back to back, then folded.
  for (; i + (UNROLL - 1) * stride < n_vec; i += UNROLL * stride) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) v[u] = ld_stream<L2_PREFETCH>(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= fold(v[u]);
  }
  // Tail: fewer than UNROLL strides left.
  for (; i < n_vec; i += stride) acc ^= fold(ld_stream<L2_PREFETCH>(src + i));
  if (acc == 0x2545F491u) sink[0] = acc;
}

}  // namespace fdpp
