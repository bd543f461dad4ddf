#line 2 "kernels_cu/kv_cache.cuh"
// The decode-attention family's one argument struct, and the cache-access policies.
//
// Every kernel of the family (decode_split, decode_split_mma, decode_nosplit, decode_combine)
// takes one DecodeParams by value; its Python mirror is fdpp.configs.DECODE_PARAMS (the CI
// compile test checks the offsets). Quantised K/V (8-bit codes) are dequantised as
// code * k_scale * k_descale[b, kvh] (V alike); the scales are folded into the scores and the
// output, never applied per element. How a CTA finds the K/V rows of its (request, KV head) is a
// policy the attention math is instantiated with:
//   ContiguousCache      k[b, tok, kvh, :] at k + b*k_sb + tok*k_sn + kvh*k_sh (NHD or HND: strides)
//   PagedCache<PAGE>     page = block_table[b, tok / PAGE]; row at
//                        k + page*k_sb + (tok % PAGE)*k_sn + kvh*k_sh (pool [pages, PAGE, Hkv, D]
//                        for NHD, [pages, Hkv, PAGE, D] for HND: strides)
// fetch(tok) reads what a row address needs beyond tok (the block-table entry; nothing for
// contiguous). It is issued one pipeline tile ahead of the copies that use it and nothing looks
// at the value until then (page() validates it where the address is formed), so the block-table
// read overlaps a tile of math instead of stalling the loader. A page index outside
// [0, num_pages) is never dereferenced: the row is read from page 0 instead and the CTA's result
// is poisoned (NaN) by the caller.
#pragma once
#include "common.cuh"

namespace fdpp {

template <bool C, typename A, typename B> struct Select { using type = A; };  // std::conditional
template <typename A, typename B> struct Select<false, A, B> { using type = B; };

// ---- 8-bit KV elements (FP8 caches; K/V only, never q or out). The tensor cores take them as
// fp16, so a code becomes an fp16 value code / scale() exactly, two codes at a time, and the
// kernels fold scale() into the dequantisation scales instead of multiplying every element.
//   E4M3  sm_89+: cvt.rn.f16x2.e4m3x2, one instruction per pair, scale 1. sm_80 (no FP8
//         conversion): sign, exponent and mantissa bits moved into a half's fields (subnormals
//         included), which divides by 2^8: scale 256. The NaN codes (0x7f, 0xff) read as NaN on
//         sm_89+ and as +-480 * 2^-8 on sm_80: the quantisers never write them.
//   E5M2  a half's top byte (E5M2 is truncated fp16): one byte_perm per pair, scale 1.
// pairs(x, lo, hi): x holds two pairs of codes, bytes [a0, b0, a1, b1] (byte 0 lowest); lo =
// f16x2(low a0, high b0), hi = f16x2(a1, b1).
struct __align__(1) fp8_e4m3_t { unsigned char bits; };
struct __align__(1) fp8_e5m2_t { unsigned char bits; };

template <> struct TypeTraits<fp8_e4m3_t> { static constexpr int VEC = 16; };
template <> struct TypeTraits<fp8_e5m2_t> { static constexpr int VEC = 16; };

// How a kernel turns loaded K/V vectors into numbers: TypeTraits' unpack for 16/32-bit types.
template <typename T>
struct KvDecode {
  __device__ __forceinline__ static float scale() { return 1.f; }
  __device__ __forceinline__ static void unpack(const uint4& u, float* f) { TypeTraits<T>::unpack(u, f); }
};

template <typename Derived>
struct Fp8Decode {
  // 16 codes -> 16 floats (code / scale()), for the CUDA-core path
  __device__ __forceinline__ static void unpack(const uint4& u, float* f) {
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      unsigned lo, hi;
      Derived::pairs(w[i], lo, hi);
      f[4 * i] = h2f((unsigned short)(lo & 0xffffu)); f[4 * i + 1] = h2f((unsigned short)(lo >> 16));
      f[4 * i + 2] = h2f((unsigned short)(hi & 0xffffu)); f[4 * i + 3] = h2f((unsigned short)(hi >> 16));
    }
  }
};

template <>
struct KvDecode<fp8_e4m3_t> : Fp8Decode<KvDecode<fp8_e4m3_t>> {
#if __CUDA_ARCH__ >= 890
  __device__ __forceinline__ static float scale() { return 1.f; }
  __device__ __forceinline__ static void pairs(unsigned x, unsigned& lo, unsigned& hi) {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}"
        : "=r"(lo), "=r"(hi) : "r"(x));  // the halves of x as operands: no shift to extract the high one
  }
#else
  __device__ __forceinline__ static float scale() { return 256.f; }
  __device__ __forceinline__ static unsigned hi_bytes(unsigned a) {  // codes in bytes 1 and 3 -> f16x2 / 256
    return (a & 0x80008000u) | ((a >> 1) & 0x3f803f80u);
  }
  __device__ __forceinline__ static void pairs(unsigned x, unsigned& lo, unsigned& hi) {
    lo = hi_bytes(__byte_perm(x, 0u, 0x1100));
    hi = hi_bytes(__byte_perm(x, 0u, 0x3322));
  }
#endif
};

template <>
struct KvDecode<fp8_e5m2_t> : Fp8Decode<KvDecode<fp8_e5m2_t>> {
  __device__ __forceinline__ static float scale() { return 1.f; }
  __device__ __forceinline__ static void pairs(unsigned x, unsigned& lo, unsigned& hi) {
    lo = __byte_perm(x, 0u, 0x1404);  // [0, a0, 0, b0]
    hi = __byte_perm(x, 0u, 0x3424);  // [0, a1, 0, b1]
  }
};

// ---- INT4 KV elements: int4_t<GROUP> is one byte holding two 4-bit codes (element 2i in the low
// nibble of byte i), with an fp16 scale and zero per (token, KV head, GROUP elements of D); K/V
// row r's element is fp16(code * scale + zero), one rounding: exactly fma.rn.f16x2 of the exact
// fp16 code (fdpp.quant.dequant_int4). GROUP in {32, 64, 128}. Tensor-core path only.
//   codes(x): the 8 nibbles of x -> f16x2 pairs (n_i, n_{i+4}), exact (magic-number conversion).
template <int GROUP> struct __align__(1) int4_t { unsigned char bits; };

template <typename T> struct Int4Group { static constexpr int value = 0; };  // 0: not INT4
template <int G> struct Int4Group<int4_t<G>> { static constexpr int value = G; };

template <int GROUP>
struct KvDecode<int4_t<GROUP>> {
  static_assert(GROUP == 32 || GROUP == 64 || GROUP == 128, "INT4 groups of 32, 64 or 128 elements");
  __device__ __forceinline__ static float scale() { return 1.f; }
  // Word x's 8 codes -> r[i] = f16x2 (n_i, n_{i+4}), i = 0..3, exact, with 5 integer operations:
  // nibbles 0 / 4 (bits 0-3 of each half) or-ed into the mantissa of 1024.0 (0x6400) give 1024 + n,
  // nibbles 1 / 5 (bits 4-7) into 64.0's (0x5400, whose mantissa unit is 1/16) give 64 + n, without
  // a shift; x >> 8 brings nibbles 2, 3 / 6, 7 there. One subtraction each removes the offset.
  // lo / hi are the masks 0x000f000f / 0x00f000f0 (kept in registers by the caller: kept_const).
  __device__ __forceinline__ static void codes(unsigned x, unsigned lo, unsigned hi, unsigned (&r)[4]) {
    const unsigned y = x >> 8;
    const unsigned h[4] = {(x & lo) | 0x64006400u, (x & hi) | 0x54005400u, (y & lo) | 0x64006400u, (y & hi) | 0x54005400u};
#pragma unroll
    for (int i = 0; i < 4; ++i)
      asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r[i]) : "r"(h[i]), "r"(i % 2 ? 0x54005400u : 0x64006400u));
  }
  // codes n (f16x2, exact) -> fp16(n * s + z), one rounding per half
  __device__ __forceinline__ static unsigned dequant(unsigned n, unsigned s, unsigned z) {
    unsigned r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(n), "r"(s), "r"(z));
    return r;
  }
};

// A group's fp16 scale or zero of two rows from the loader's words: f16x2 (row a's, row b's), one
// byte_perm. NGRP >= 2 groups per row: 4-byte aligned rows, words hold groups (2i, 2i+1). NGRP == 1:
// two words, [value, 0] or [0 | neighbour, value] (the loader cannot align a lone 2-byte value).
template <int NGRP>
__device__ __forceinline__ unsigned int4_param2(const unsigned* wa, const unsigned* wb, int grp) {
  if constexpr (NGRP == 1) return __byte_perm(wa[0] | (wa[1] >> 16), wb[0] | (wb[1] >> 16), 0x5410);
  else return __byte_perm(wa[grp >> 1], wb[grp >> 1], grp & 1 ? 0x7632 : 0x5410);
}

// 4-byte cp.async (through L1: .ca); src_bytes < 4 zero-fills the rest without reading it.
__device__ __forceinline__ void cp_async4(void* smem_dst, const void* gmem_src, int src_bytes) {
  unsigned int dst = (unsigned int)__cvta_generic_to_shared(smem_dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes)
               : "memory");
}


struct DecodeParams {
  const void* q; const void* k; const void* v;
  const int* seqlens;      // [B] or null (every request n_max long)
  const int* block_table;  // paged: [B, pages per request], row stride bt_sb; else null
  const float* k_descale; const float* v_descale;  // quantised K/V: [B, Hkv] scales (strides below) or null;
                                                   // INT4: the fp16 group scales (read as half bits)
  const void* k_zero; const void* v_zero;  // INT4: fp16 group zeros; else null
  void* out; float* lse;   // [B, Hq, D] (q's type), [B, Hq] natural log or null
  float* o_part; float* lse_part;  // [B, Hq, splits, D], [B, Hq, splits] (log2): the partials
  unsigned* counters;  // fused plans: zeroed tickets, [B * Hq / GROUP_SIZE][1 + buckets]; else null
  long long q_sb, q_sh;
  long long k_sb, k_sn, k_sh;  // elements; contiguous: request, token, head; paged: page, slot, head
  long long v_sb, v_sn, v_sh;
  long long bt_sb;
  long long kd_sb, kd_sh, vd_sb, vd_sh;  // descale strides (0: one value for every request/head)
  long long kd_sn, vd_sn;  // INT4 scales: token (paged: slot) strides; kd_sb/vd_sb are then page strides
  long long kz_sb, kz_sn, kz_sh, vz_sb, vz_sn, vz_sh;  // INT4 zeros: as the scales
  int n_max;       // tokens a request can hold (paged: pages per request * PAGE_SIZE)
  int num_pages;   // paged: pool size
  int num_q_heads, ratio, chunk, num_splits;
  int bucket;        // fused plans: splits merged per first-level bucket (>= num_splits: one level)
  float scale_log2;  // softmax_scale * log2(e)
  float k_scale, v_scale;  // scalar dequantisation scales (1 unless quantised), times the arrays' values
  float umax2;     // softmax_mode "unified_max" (the *_umax kernels): phi * log2(e); else unread
  int l2_prefetch;  // K/V rows of its chunk a CTA asks the L2 for before pdl_wait() (0: none)
};

// Dequantisation scales of K and V for (request b, KV head kvh), times the decoder's scale
// (common.cuh): what scores and outputs are multiplied by.
template <typename DTypeKV>
__device__ __forceinline__ float2 kv_descales(const DecodeParams& p, int b, int kvh) {
  float k = p.k_scale * KvDecode<DTypeKV>::scale(), v = p.v_scale * KvDecode<DTypeKV>::scale();
  const bool arrays = Int4Group<DTypeKV>::value == 0;  // INT4: the arrays are per-group (int4_param2)
  if (arrays && p.k_descale != nullptr) k *= __ldg(p.k_descale + b * p.kd_sb + kvh * p.kd_sh);
  if (arrays && p.v_descale != nullptr) v *= __ldg(p.v_descale + b * p.vd_sb + kvh * p.vd_sh);
  float2 r;
  r.x = k; r.y = v;
  return r;
}

// Valid length of request b, or -1 when the given length is outside [0, n_max] (the request's
// output is then NaN: a wrong length is never answered with finite numbers).
__device__ __forceinline__ int request_length(const DecodeParams& p, int b) {
  if (p.seqlens == nullptr) return p.n_max;
  const int n = p.seqlens[b];
  return (n < 0 || n > p.n_max) ? -1 : n;
}

template <typename DTypeKV>
struct ContiguousCache {
  static constexpr int PAGE = 0;  // no pages: every row is located by its token alone
  const DTypeKV* k; const DTypeKV* v;
  long long k_sn, v_sn;
  __device__ __forceinline__ ContiguousCache(const DecodeParams& p, int b, int kvh)
      : k(static_cast<const DTypeKV*>(p.k) + b * p.k_sb + kvh * p.k_sh),
        v(static_cast<const DTypeKV*>(p.v) + b * p.v_sb + kvh * p.v_sh), k_sn(p.k_sn), v_sn(p.v_sn) {}
  __device__ __forceinline__ int fetch(int) const { return 0; }
  __device__ __forceinline__ int page(int raw, bool&) const { return raw; }
  __device__ __forceinline__ const DTypeKV* k_row(int, int tok) const { return k + tok * k_sn; }
  __device__ __forceinline__ const DTypeKV* v_row(int, int tok) const { return v + tok * v_sn; }
  // INT4 scale / zero rows: base(array, its strides) for (b, kvh), then row(base, ...) per token
  template <typename E>
  __device__ __forceinline__ static const E* base(const void* p, long long sb, long long sh, int b, int kvh) {
    return static_cast<const E*>(p) + b * sb + kvh * sh;
  }
  template <typename E>
  __device__ __forceinline__ static const E* row(const E* base, long long, long long sn, int, int tok) {
    return base + tok * sn;
  }
};

template <int PAGE_SIZE>
struct PagedCache {
  static_assert(PAGE_SIZE >= 1 && (PAGE_SIZE & (PAGE_SIZE - 1)) == 0, "PAGE_SIZE: a power of two");
  template <typename DTypeKV>
  struct Bind {
    static constexpr int PAGE = PAGE_SIZE;
    const DTypeKV* k; const DTypeKV* v;
    long long k_sp, k_sn, v_sp, v_sn;
    const int* pages;
    int num_pages;
    __device__ __forceinline__ Bind(const DecodeParams& p, int b, int kvh)
        : k(static_cast<const DTypeKV*>(p.k) + kvh * p.k_sh),
          v(static_cast<const DTypeKV*>(p.v) + kvh * p.v_sh),
          k_sp(p.k_sb), k_sn(p.k_sn), v_sp(p.v_sb), v_sn(p.v_sn),
          pages(p.block_table + b * p.bt_sb), num_pages(p.num_pages) {}
    __device__ __forceinline__ int fetch(int tok) const { return __ldg(pages + (unsigned)tok / PAGE_SIZE); }
    __device__ __forceinline__ int page(int raw, bool& bad) const {
      const bool oob = (unsigned)raw >= (unsigned)num_pages;
      bad |= oob;
      return oob ? 0 : raw;
    }
    __device__ __forceinline__ const DTypeKV* k_row(int pg, int tok) const {
      return k + pg * k_sp + ((unsigned)tok % PAGE_SIZE) * k_sn;
    }
    __device__ __forceinline__ const DTypeKV* v_row(int pg, int tok) const {
      return v + pg * v_sp + ((unsigned)tok % PAGE_SIZE) * v_sn;
    }
    template <typename E>
    __device__ __forceinline__ static const E* base(const void* p, long long, long long sh, int, int kvh) {
      return static_cast<const E*>(p) + kvh * sh;
    }
    template <typename E>
    __device__ __forceinline__ static const E* row(const E* base, long long sp, long long sn, int pg, int tok) {
      return base + pg * sp + ((unsigned)tok % PAGE_SIZE) * sn;
    }
  };
};

// Cache policy tag -> the accessor bound to a KV element type.
struct Contiguous {
  template <typename DTypeKV> using Bind = ContiguousCache<DTypeKV>;
};
template <typename Cache, typename DTypeKV> using CacheOf = typename Cache::template Bind<DTypeKV>;

// Before pdl_wait() (common.cuh, l2_prefetch): the first min(chunk, l2_prefetch) K and V rows of
// split `split`'s chunk of (request b, KV head kvh), up to n_max, are asked of the L2, one bulk
// prefetch per row, so that while the kernel before is finishing, device memory already streams
// this kernel's first tiles. Nothing here reads the request's length (it may not be written yet);
// a paged cache's block-table entries are read through pdl_read() (L2 only: a stale entry cannot
// linger in L1 past pdl_wait()) and an entry outside [0, num_pages) is skipped. Only a hint: what
// the kernel reads afterwards comes from its own loads, after pdl_wait(). INT4 rows are the codes
// (HEAD_DIM / 2 bytes); their scales are left to the loads.
template <typename DTypeKV, typename Cache, int HEAD_DIM>
__device__ __forceinline__ void prefetch_chunk_l2(const DecodeParams& p, int b, int kvh, int split) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.l2_prefetch <= 0) return;
  constexpr int ROW_BYTES = HEAD_DIM * (int)sizeof(DTypeKV) / (Int4Group<DTypeKV>::value > 0 ? 2 : 1);
  static_assert(ROW_BYTES % 16 == 0, "bulk prefetch: rows of whole 16-byte vectors");
  using Acc = CacheOf<Cache, DTypeKV>;
  const Acc kv(p, b, kvh);
  const int start = split * p.chunk;
  const int stop = min(start + min(p.chunk, p.l2_prefetch), p.n_max);
  for (int tok = start + (int)threadIdx.x; tok < stop; tok += (int)blockDim.x) {
    int pg = 0;
    if constexpr (Acc::PAGE > 0) {
      pg = pdl_read(p.block_table + b * p.bt_sb + (unsigned)tok / Acc::PAGE);
      if ((unsigned)pg >= (unsigned)p.num_pages) continue;
    }
    l2_prefetch(kv.k_row(pg, tok), ROW_BYTES);
    l2_prefetch(kv.v_row(pg, tok), ROW_BYTES);
  }
#endif
}

}  // namespace fdpp
