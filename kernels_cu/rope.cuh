#pragma once
// Rotate-half RoPE (GPT-NeoX / Llama form) shared by model_ops.cu (rope_qkv, rope_qkv_append) and
// paged_append.cu (paged_rope_append), so the fused and unfused writes give the same bits: for
// i < D / 2, out[i] = x[i] c - x[i + D/2] s and out[i + D/2] = x[i + D/2] c + x[i] s, with c, s the
// float32 tables' entries (pos, i). Every product and sum is rounded on its own (no FMA
// contraction): the float32 arithmetic of the NumPy front end (fdpp/models/_backends.py), bit for bit.
#include "common.cuh"

namespace fdpp {

__device__ __forceinline__ float rope_lo(float x1, float x2, float c, float s) {
  return __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
}
__device__ __forceinline__ float rope_hi(float x1, float x2, float c, float s) {
  return __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

template <typename T>
__device__ __forceinline__ float round_to(float v) {  // v rounded to T (to nearest even), as float
  T t;
  TypeTraits<T>::store(&t, v);
  return TypeTraits<T>::load(&t);
}

}  // namespace fdpp
