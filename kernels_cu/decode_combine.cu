#line 2 "kernels_cu/decode_combine.cu"
// Phase 2 of split-KV decode attention: merge the per-split partial outputs of each (b, q head).
//
//   lse_i  : per-split log-sum-exp, log2 domain (-inf for an empty split)
//   o_i    : per-split output, already normalised by its own sum
//   out    = sum_i exp2(lse_i - lse) * o_i,  lse = log2 sum_i exp2(lse_i)   (exact to rounding)
//
// Variants: DType (output type), HEAD_DIM, NUM_WARPS. grid (batch * num_q_heads), block NUM_WARPS*32.
// Takes the family's DecodeParams (kv_cache.cuh): o_part, lse_part, out, lse, num_splits.
// Warp w merges splits w, w + NUM_WARPS, ... online; each lane owns 4-float slices of the head dim.
// A row with every split empty (request length 0) yields zeros and lse = -inf; a row with a NaN
// partial lse (phase 1 met a bad page index or length) yields NaN output and lse.
#include "kv_cache.cuh"

namespace fdpp {

template <typename DType, int HEAD_DIM, int NUM_WARPS>
__global__ void __launch_bounds__(NUM_WARPS * 32)
decode_combine(const DecodeParams p) {
  static_assert(HEAD_DIM % 4 == 0, "HEAD_DIM must be a multiple of 4");
  constexpr int F4 = HEAD_DIM / 4;               // float4 slices per row
  constexpr int PER_LANE = (F4 + 31) / 32;
  __shared__ float red[NUM_WARPS][HEAD_DIM];
  __shared__ float stat[NUM_WARPS][2];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const long long bh = blockIdx.x;
  const int num_splits = p.num_splits;
  const float* lp = p.lse_part + bh * num_splits;
  const float4* o4 = reinterpret_cast<const float4*>(p.o_part) + bh * num_splits * F4;

  // One pass: warp w merges splits w, w + NUM_WARPS, ... with a running max (online softmax), so
  // the lse and partial-output loads of a split are issued together (one memory latency, not three).
  float m = neg_inf(), wsum = 0.f;
  bool bad = false;
  float4 acc[PER_LANE];
#pragma unroll
  for (int p = 0; p < PER_LANE; ++p) acc[p] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int s = warp; s < num_splits; s += NUM_WARPS) {
    const float ls = lp[s];
    float4 x[PER_LANE];
#pragma unroll
    for (int p = 0; p < PER_LANE; ++p)
      x[p] = (p * 32 + lane < F4) ? o4[s * F4 + p * 32 + lane] : make_float4(0.f, 0.f, 0.f, 0.f);
    bad |= ls != ls;                // NaN: a poisoned partial
    if (ls == neg_inf()) continue;  // empty split
    const float mn = fmaxf(m, ls);
    const float sc = fast_exp2(m - mn), w = fast_exp2(ls - mn);  // m = -inf first: sc = 0
    m = mn;
    wsum = wsum * sc + w;
#pragma unroll
    for (int p = 0; p < PER_LANE; ++p) {
      acc[p].x = fmaf(w, x[p].x, acc[p].x * sc); acc[p].y = fmaf(w, x[p].y, acc[p].y * sc);
      acc[p].z = fmaf(w, x[p].z, acc[p].z * sc); acc[p].w = fmaf(w, x[p].w, acc[p].w * sc);
    }
  }
  if (lane == 0) { stat[warp][0] = m; stat[warp][1] = wsum; }
#pragma unroll
  for (int p = 0; p < PER_LANE; ++p) {
    const int f = p * 32 + lane;
    if (f < F4) {
      red[warp][4 * f + 0] = acc[p].x; red[warp][4 * f + 1] = acc[p].y;
      red[warp][4 * f + 2] = acc[p].z; red[warp][4 * f + 3] = acc[p].w;
    }
  }
  bad = __syncthreads_or(bad);
  float mx = neg_inf();
#pragma unroll
  for (int w = 0; w < NUM_WARPS; ++w) mx = fmaxf(mx, stat[w][0]);
  DType* op = static_cast<DType*>(p.out) + bh * HEAD_DIM;
  float* lse = p.lse;
  if (bad) {
    const float nan = __int_as_float(0x7fc00000);
    for (int d = tid; d < HEAD_DIM; d += NUM_WARPS * 32) TypeTraits<DType>::store(op + d, nan);
    if (tid == 0 && lse != nullptr) lse[bh] = nan;
    return;
  }
  if (mx == neg_inf()) {  // every split empty: request of length 0
    for (int d = tid; d < HEAD_DIM; d += NUM_WARPS * 32) TypeTraits<DType>::store(op + d, 0.f);
    if (tid == 0 && lse != nullptr) lse[bh] = neg_inf();
    return;
  }
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < NUM_WARPS; ++w) total += stat[w][1] * fast_exp2(stat[w][0] - mx);
  const float inv = 1.f / total;
  for (int d = tid; d < HEAD_DIM; d += NUM_WARPS * 32) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) o += red[w][d] * fast_exp2(stat[w][0] - mx);
    TypeTraits<DType>::store(op + d, o * inv);
  }
  if (tid == 0 && lse != nullptr) lse[bh] = (mx + __log2f(total)) * 0.69314718055994531f;
}

}  // namespace fdpp
