#line 2 "kernels_cu/decode_combine.cu"
// Phase 2 of split-KV decode attention: merge the per-split partial outputs of each (b, q head).
//
//   lse_i  : per-split log-sum-exp, log2 domain (-inf for an empty split)
//   o_i    : per-split output, already normalised by its own sum
//   out    = sum_i exp2(lse_i - lse) * o_i,  lse = log2 sum_i exp2(lse_i)   (exact to rounding)
//
// Variants: DType (output type), HEAD_DIM, NUM_WARPS. grid (batch * num_q_heads), block NUM_WARPS*32.
// Warp w accumulates splits w, w + NUM_WARPS, ...; each lane owns 4-float slices of the head dim.
// A row with every split empty (request length 0) yields zeros and lse = -inf.
#include "common.cuh"

namespace fdpp {

template <typename DType, int HEAD_DIM, int NUM_WARPS>
__global__ void __launch_bounds__(NUM_WARPS * 32)
decode_combine(const float* __restrict__ o_part, const float* __restrict__ lse_part, void* out,
               float* lse, int num_splits) {
  static_assert(HEAD_DIM % 4 == 0, "HEAD_DIM must be a multiple of 4");
  constexpr int F4 = HEAD_DIM / 4;               // float4 slices per row
  constexpr int PER_LANE = (F4 + 31) / 32;
  __shared__ float red[NUM_WARPS][HEAD_DIM];
  __shared__ float stat[NUM_WARPS];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const long long bh = blockIdx.x;
  const float* lp = lse_part + bh * num_splits;

  // max over splits
  float mx = neg_inf();
  for (int s = tid; s < num_splits; s += NUM_WARPS * 32) mx = fmaxf(mx, lp[s]);
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) stat[warp] = mx;
  __syncthreads();
  mx = stat[0];
#pragma unroll
  for (int w = 1; w < NUM_WARPS; ++w) mx = fmaxf(mx, stat[w]);
  __syncthreads();

  DType* op = static_cast<DType*>(out) + bh * HEAD_DIM;
  if (mx == neg_inf()) {  // empty request
    for (int d = tid; d < HEAD_DIM; d += NUM_WARPS * 32) TypeTraits<DType>::store(op + d, 0.f);
    if (tid == 0 && lse != nullptr) lse[bh] = neg_inf();
    return;
  }
  float sum = 0.f;
  for (int s = tid; s < num_splits; s += NUM_WARPS * 32) sum += fast_exp2(lp[s] - mx);
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) stat[warp] = sum;
  __syncthreads();
  sum = 0.f;
#pragma unroll
  for (int w = 0; w < NUM_WARPS; ++w) sum += stat[w];
  const float lse2 = mx + __log2f(sum);

  float4 acc[PER_LANE];
#pragma unroll
  for (int p = 0; p < PER_LANE; ++p) acc[p] = make_float4(0.f, 0.f, 0.f, 0.f);
  const float4* o4 = reinterpret_cast<const float4*>(o_part) + bh * num_splits * F4;
#pragma unroll 4
  for (int s = warp; s < num_splits; s += NUM_WARPS) {
    const float wgt = fast_exp2(lp[s] - lse2);
#pragma unroll
    for (int p = 0; p < PER_LANE; ++p) {
      const int f = p * 32 + lane;
      if (f < F4) {
        const float4 x = o4[s * F4 + f];
        acc[p].x = fmaf(wgt, x.x, acc[p].x); acc[p].y = fmaf(wgt, x.y, acc[p].y);
        acc[p].z = fmaf(wgt, x.z, acc[p].z); acc[p].w = fmaf(wgt, x.w, acc[p].w);
      }
    }
  }
#pragma unroll
  for (int p = 0; p < PER_LANE; ++p) {
    const int f = p * 32 + lane;
    if (f < F4) {
      red[warp][4 * f + 0] = acc[p].x; red[warp][4 * f + 1] = acc[p].y;
      red[warp][4 * f + 2] = acc[p].z; red[warp][4 * f + 3] = acc[p].w;
    }
  }
  __syncthreads();
  for (int d = tid; d < HEAD_DIM; d += NUM_WARPS * 32) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) o += red[w][d];
    TypeTraits<DType>::store(op + d, o);
  }
  if (tid == 0 && lse != nullptr) lse[bh] = lse2 * 0.69314718055994531f;
}

}  // namespace fdpp
