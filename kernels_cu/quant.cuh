#line 2 "kernels_cu/quant.cuh"
// Quantized KV-cache element formats (fdpp.quant): float32 -> FP8 (E4M3FN, E5M2) with
// round-to-nearest-even and saturation in integer bit operations (no cvt.*.e4m3 instruction, so
// sm_80 and sm_90 give the same bits), the INT4 group quantizer of one 8-element vector, and the
// matching dequantizers.
//
// Every function here is a line-by-line transcription of its NumPy mirror in fdpp/quant.py
// (fp8_encode_bits, _int4_codes, dequant_fp8, dequant_int4); tests/test_quant_cpu.py checks
// the mirrors against ml_dtypes bit for bit (all float16 values, a large float32 sample).
#pragma once
#include "common.cuh"

namespace fdpp {

// ---- host-testable part: plain C++ on unsigned / float, nothing but __float_as_uint,
// __uint_as_float, rintf and the f32_* operations below (tests/test_quant_cpu.py compiles it with
// g++ and runs it against the NumPy mirrors).

// IEEE float32 operations that keep subnormals. CuPy compiles every kernel with -ftz=true (it
// appends the option to the NVRTC options it is given), and under it float32 arithmetic and
// comparisons written in C, __fdiv_rn and fabsf included, flush subnormal inputs and results to
// zero: a float32 K of 1e-44 had amax 0, descale 1 and code 0 where NumPy gives descale 2^-149 and
// code 78 (run Z16). The quantizers promise NumPy's bits for every input, so their float32
// operations are PTX instructions without .ftz (on the host, plain C++).
#ifdef __CUDA_ARCH__
#define FDPP_F32_OP(name, op)                                             \
  __device__ __forceinline__ float name(float a, float b) {               \
    float r;                                                              \
    asm(op ".rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));             \
    return r;                                                             \
  }
FDPP_F32_OP(f32_div, "div")
FDPP_F32_OP(f32_sub, "sub")
FDPP_F32_OP(f32_add, "add")
FDPP_F32_OP(f32_mul, "mul")
#undef FDPP_F32_OP
__device__ __forceinline__ bool f32_gt(float a, float b) {  // false if either is NaN
  unsigned int r;
  asm("{\n .reg .pred p;\n setp.gt.f32 p, %1, %2;\n selp.u32 %0, 1, 0, p;\n}" : "=r"(r) : "f"(a), "f"(b));
  return r != 0u;
}
#else
__device__ __forceinline__ float f32_div(float a, float b) { return a / b; }
__device__ __forceinline__ float f32_sub(float a, float b) { return a - b; }
__device__ __forceinline__ float f32_add(float a, float b) { return a + b; }
__device__ __forceinline__ float f32_mul(float a, float b) { return a * b; }
__device__ __forceinline__ bool f32_gt(float a, float b) { return a > b; }
#endif
// |x| by its bits (fabsf flushes a subnormal under -ftz=true)
__device__ __forceinline__ float f32_abs(float x) { return __uint_as_float(__float_as_uint(x) & 0x7fffffffu); }

// Format ids (template parameters; Python: fdpp.quant.FORMAT_IDS).
constexpr int KV_FP8_E4M3 = 1;
constexpr int KV_FP8_E5M2 = 2;
constexpr int KV_INT4 = 3;

template <int FMT> struct Fp8Traits;
template <> struct Fp8Traits<KV_FP8_E4M3> {   // OCP E4M3FN: bias 7, no inf, NaN = S.1111.111
  static constexpr int MANT = 3;
  static constexpr int BIAS = 7;
  static constexpr unsigned MAX_BITS = 0x43e00000u;  // float32 bits of 448
  static constexpr unsigned MAX_CODE = 0x7eu;        // 448
  static constexpr unsigned NAN_CODE = 0x7fu;
  static constexpr float MAX = 448.0f;
};
template <> struct Fp8Traits<KV_FP8_E5M2> {   // E5M2 (IEEE-like): bias 15, inf 0x7c, NaN 0x7e
  static constexpr int MANT = 2;
  static constexpr int BIAS = 15;
  static constexpr unsigned MAX_BITS = 0x47600000u;  // float32 bits of 57344
  static constexpr unsigned MAX_CODE = 0x7bu;        // 57344
  static constexpr unsigned NAN_CODE = 0x7eu;
  static constexpr float MAX = 57344.0f;
};

// float32 -> fp8 code, round to nearest even, |x| >= MAX saturates to +-MAX (equal to
// ml_dtypes' astype of clip(x, -MAX, MAX)); NaN -> sign | NAN_CODE; the sign of zero is kept.
// Mirror: fdpp.quant.fp8_encode_bits.
template <int FMT>
__device__ __forceinline__ unsigned int f32_to_fp8(float x) {
  using T = Fp8Traits<FMT>;
  const unsigned int u = __float_as_uint(x);
  const unsigned int sign = (u >> 24) & 0x80u;
  const unsigned int a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | T::NAN_CODE;             // NaN
  if (a >= T::MAX_BITS) return sign | T::MAX_CODE;            // saturate (inf included)
  const int e32 = (int)(a >> 23);
  if (e32 >= 127 + 1 - T::BIAS) {                             // a normal fp8 number (or rounds up to one)
    const unsigned int lsb = (a >> (23 - T::MANT)) & 1u;
    const unsigned int r = (a + ((1u << (22 - T::MANT)) - 1u) + lsb) >> (23 - T::MANT);
    return sign | (r - ((unsigned int)(127 - T::BIAS) << T::MANT));
  }
  const int shift = 151 - T::BIAS - T::MANT - e32;            // code = m / 2^shift (subnormal)
  if (shift > 24) return sign;                                 // below half the smallest subnormal
  const unsigned int m = (a & 0x7fffffu) | 0x800000u;
  unsigned int q = m >> shift;
  const unsigned int rem = m & ((1u << shift) - 1u);
  const unsigned int half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) q += 1u;
  return sign | q;
}

// fp8 code -> float32 (exact: every fp8 value is a float32). Mirror: fdpp.quant.fp8_decode_bits
// (equal to ml_dtypes' astype(float32) for all 256 codes).
template <int FMT>
__device__ __forceinline__ float fp8_to_f32(unsigned int c) {
  using T = Fp8Traits<FMT>;
  const unsigned int sign = (c & 0x80u) << 24;
  const unsigned int e = (c >> T::MANT) & ((0x80u >> T::MANT) - 1u);
  const unsigned int m = c & ((1u << T::MANT) - 1u);
  constexpr unsigned int EMAX = (0x80u >> T::MANT) - 1u;
  if (FMT == KV_FP8_E4M3 && e == EMAX && m == ((1u << T::MANT) - 1u)) return __uint_as_float(sign | 0x7fc00000u);
  if (FMT == KV_FP8_E5M2 && e == EMAX) return __uint_as_float(sign | (m ? 0x7fc00000u : 0x7f800000u));
  if (e == 0) {  // subnormal (or zero): m * 2^(1 - BIAS - MANT), exact in float32
    const float v = (float)m * __uint_as_float((unsigned int)(128 - T::BIAS - T::MANT) << 23);
    return sign ? -v : v;
  }
  return __uint_as_float(sign | ((e + 127u - T::BIAS) << 23) | (m << (23 - T::MANT)));
}

// Code of one element: clip(rint((x - zero) / scale), 0, 15) in float32; NaN -> 0.
// Mirror: fdpp.quant._int4_codes.
__device__ __forceinline__ unsigned int int4_code(float x, float scale, float zero) {
  const float t = rintf(f32_div(f32_sub(x, zero), scale));  // a subnormal quotient rounds to 0 either way
  return t >= 15.0f ? 15u : (t >= 0.0f ? (unsigned int)t : 0u);
}

// NaN-propagating max / min (fmaxf / fminf drop NaN; NumPy's max / min keep it).
__device__ __forceinline__ float nan_max(float a, float b) { return (a != a || f32_gt(a, b)) ? a : b; }
__device__ __forceinline__ float nan_min(float a, float b) { return (a != a || f32_gt(b, a)) ? a : b; }

// ---- end of the host-testable part

__device__ __forceinline__ unsigned short f2h_rn(float x) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}

// INT4 parameters of one group from its max and min (float32): scale = fp16((mx - mn) / 15)
// (1.0 when that rounds to 0), zero = fp16(mn + 0) (a zero minimum is +0 whatever the order of
// the max / min reduction saw -0 and +0 in); IEEE float32 subtraction and division.
// Mirror: fdpp.quant._int4_params.
__device__ __forceinline__ void int4_params(float mx, float mn, unsigned short& scale_h, unsigned short& zero_h) {
  unsigned short s = f2h_rn(f32_div(f32_sub(mx, mn), 15.0f));
  if ((s & 0x7fffu) == 0) s = 0x3c00u;  // 1.0
  scale_h = s;
  zero_h = f2h_rn(f32_add(mn, 0.0f));
}

// float16(n * scale + zero), rounded once (what hfma2 computes), as float32: the INT4 value every
// kernel must produce. Mirror: fdpp.quant.dequant_int4.
__device__ __forceinline__ float int4_dequant(unsigned int n, unsigned short scale_h, unsigned short zero_h) {
  const unsigned short nh = f2h_rn((float)n);  // exact: n <= 15
  unsigned short y;
  asm("fma.rn.f16 %0, %1, %2, %3;" : "=h"(y) : "h"(nh), "h"(scale_h), "h"(zero_h));
  return h2f(y);
}

// 8 elements -> 4 bytes, element 2i in the low nibble of byte i.
__device__ __forceinline__ unsigned int int4_pack8(const float* f, float scale, float zero) {
  unsigned int w = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) w |= int4_code(f[i], scale, zero) << (4 * i);
  return w;
}

// Max and min of a group of LANES consecutive lanes (LANES a power of two <= 32, the group
// aligned to LANES within the warp); mask: those lanes.
template <int LANES>
__device__ __forceinline__ void group_max_min(float& mx, float& mn, unsigned int mask) {
#pragma unroll
  for (int o = LANES / 2; o >= 1; o /= 2) {
    mx = nan_max(mx, __shfl_xor_sync(mask, mx, o));
    mn = nan_min(mn, __shfl_xor_sync(mask, mn, o));
  }
}

template <int LANES>
__device__ __forceinline__ unsigned int group_mask() {
  static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0, "LANES: a power of two <= 32");
  if (LANES == 32) return 0xffffffffu;
  const unsigned int lane = threadIdx.x & 31u;
  return ((1u << LANES) - 1u) << (lane & ~(unsigned int)(LANES - 1));
}

// Load 8 consecutive elements of DType as float (16-byte loads: 16-byte aligned for every DType; float: two).
template <typename DType> __device__ __forceinline__ void load8(const DType* p, float* f);
template <> __device__ __forceinline__ void load8<half_t>(const half_t* p, float* f) {
  TypeTraits<half_t>::unpack(*reinterpret_cast<const uint4*>(p), f);
}
template <> __device__ __forceinline__ void load8<bfloat16_t>(const bfloat16_t* p, float* f) {
  TypeTraits<bfloat16_t>::unpack(*reinterpret_cast<const uint4*>(p), f);
}
template <> __device__ __forceinline__ void load8<float>(const float* p, float* f) {
  TypeTraits<float>::unpack(reinterpret_cast<const uint4*>(p)[0], f);
  TypeTraits<float>::unpack(reinterpret_cast<const uint4*>(p)[1], f + 4);
}

// 8 elements -> 8 fp8 codes (x / descale, IEEE division), element i in byte i.
template <int FMT>
__device__ __forceinline__ uint2 fp8_pack8(const float* f, float descale) {
  unsigned int lo = 0, hi = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    lo |= f32_to_fp8<FMT>(f32_div(f[i], descale)) << (8 * i);
    hi |= f32_to_fp8<FMT>(f32_div(f[i + 4], descale)) << (8 * i);
  }
  return make_uint2(lo, hi);
}

}  // namespace fdpp
