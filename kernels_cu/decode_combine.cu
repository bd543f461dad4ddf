#line 2 "kernels_cu/decode_combine.cu"
// Phase 2 of the two-launch split-KV decode attention: merge the per-split partials of each
// (request, query head) row (kernels_cu/merge.cuh has the merge, shared with the fused path).
//
//   lse_i  : per-split log-sum-exp, log2 domain (-inf for an empty split)
//   o_i    : per-split output, already normalised by its own sum
//   out    = sum_i exp2(lse_i - lse) * o_i,  lse = log2 sum_i exp2(lse_i)   (exact to rounding)
//
// Variants: DType (output type), HEAD_DIM, NUM_WARPS, SLICES. grid (batch * num_q_heads, SLICES),
// block NUM_WARPS*32: CTA (row, y) merges the float4 columns [y, y+1) * HEAD_DIM / (4 * SLICES) of
// one row, its threads spread over those columns and over the splits. With few rows (few KV
// heads, batch 1) SLICES > 1 puts more CTAs on the merge instead of one per query head.
// A row with every split empty (request length 0) yields zeros and lse = -inf; a row with a NaN
// partial lse (phase 1 met a bad page index or length, or NaN/Inf in q or K) yields NaN.
#include "merge.cuh"

namespace fdpp {

template <typename DType, int HEAD_DIM, int NUM_WARPS, int SLICES>
__global__ void __launch_bounds__(NUM_WARPS * 32)
decode_combine(const DecodeParams p) {
  static_assert(HEAD_DIM % (4 * SLICES) == 0, "HEAD_DIM must split into SLICES float4 column ranges");
  constexpr int THREADS = NUM_WARPS * 32, COLS = HEAD_DIM / (4 * SLICES);
  __shared__ float smem[THREADS * 6];
  pdl_wait();  // phase 1's partials are complete and visible (a no-op unless launched with PDL)
  pdl_trigger();
  merge_partials<HEAD_DIM, 1, COLS, THREADS>(p, blockIdx.x, blockIdx.y * COLS, 0, p.num_splits, 1, smem,
                                             FinalSink<DType, HEAD_DIM>{p.out, p.lse});
}

}  // namespace fdpp
