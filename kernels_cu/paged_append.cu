#line 2 "kernels_cu/paged_append.cu"
// Paged KV cache write: copy rows of new K and V ([rows, num_heads, HEAD_DIM]) into the page pools
// of one layer (fdpp.cache.PagedKVCache: a decode step for the whole batch, or a prefill).
//
// Variants (template parameters; Python: fdpp.cache.PagedAppendConfig, names derived there):
//   DType      fdpp::half_t | fdpp::bfloat16_t | float  (K/V element; copied as raw bits)
//   HEAD_DIM   any positive size; copies use 16-byte vectors when HEAD_DIM * sizeof(DType) allows
//              (else 8, 4 or 2 bytes: VecBytes below, mirrored by PagedAppendConfig.vec_bytes)
//   PAGE_SIZE  tokens per page, a power of two 1..256
//   HND        pool layout: false = NHD [num_pages, PAGE_SIZE, heads, HEAD_DIM],
//              true = HND [num_pages, heads, PAGE_SIZE, HEAD_DIM]; strides are launch-time values
//
// Launch: block APPEND_THREADS, grid (ceil(rows * num_heads * VPR / APPEND_THREADS), 2); grid.y 0
// writes K, 1 writes V. Thread i copies vector i % VPR of head (i / VPR) % num_heads of row
// i / (num_heads * VPR), so a warp writes contiguous bytes of a page.
//
// Row r's token position:  seqlens != nullptr: pos = seqlens[r] - 1   (decode step, after reserve)
//                          seqlens == nullptr: pos = pos0 + r          (prefill of one sequence)
// Row r's pages:           block_table + r * bt_row_stride (bt_row_stride 0: all rows share one list)
// Device-side safety: a row whose pos is outside [0, max_pages * PAGE_SIZE), or whose block-table
// entry is outside [0, num_pages), is skipped (nothing written): a stale or corrupt table never
// writes outside the pool.
//
// paged_append_quant<DType, FMT, G, HEAD_DIM, PAGE_SIZE, HND>: the same writes into a quantized
// cache (fdpp.cache.PagedKVCache(kv_format=...)), quantizing on the way in with the rounding of
// fdpp.quantize_kv (kernels_cu/quant.cuh). One thread quantizes 8 elements (HEAD_DIM % 8 == 0):
//   FMT KV_FP8_E4M3 / KV_FP8_E5M2: pools of 1 byte per element; code = f32_to_fp8(x / descale[h])
//     with the layer's fixed descale (k_sc / v_sc: float32 [num_heads]); G unused (0).
//   FMT KV_INT4: pools of HEAD_DIM / 2 bytes per (token, head), low nibble first; G / 8 lanes a
//     group (max / min by shuffles), fp16 scale / zero per (token, head, group) into the scale
//     pools k_sc / v_sc and k_zp / v_zp ([.., HEAD_DIM / G] per (token, head), strides sc_*).
// Pool strides are in bytes (the quantized pool's elements); same grid and skip rules as above.
//
// paged_rope_append<DType, FMT, G, HEAD_DIM, PAGE_SIZE, HND>: a decode step's fused QKV projection
// output split, rotated and written in one launch (fdpp.cache.PagedKVCache.append_rope): grid.y 0
// writes K rotated (rope.cuh, at clamp(seqlens[r] - 1, 0, n_pos - 1)) and 1 writes V, each into the
// pool as paged_append (FMT 0) or paged_append_quant (FMT a format) would write it from the rotated
// rows rounded to DType; grid.y 2 writes q rotated into q_out. The K / V arguments are those of
// PagedAppendQParams (pool strides in Pool elements: DType for FMT 0, bytes otherwise; k_src / v_src
// point into the QKV rows), the q side is RopeAppendParams. HEAD_DIM % 16 == 0 (a thread's 8
// elements and their rotation partners lie in the other half of the row); decode rows only (seqlens).
//
// paged_table_update<THREADS>: the upload of reserve / set_batch. One staging buffer src (int32:
// num_lens lengths, then num_entries flat block-table indices, then their values) rewrites seqlens
// and the changed block-table entries in place; an index outside [0, table_size) is skipped.
// grid ceil((num_lens + num_entries) / THREADS).
#include "common.cuh"
#include "quant.cuh"
#include "rope.cuh"

namespace fdpp {

constexpr int APPEND_THREADS = 128;

// The kernel's one argument (Python mirror: fdpp.cache.PAGED_APPEND_PARAMS). Strides in elements.
struct PagedAppendParams {
  const void* k_src;        // [rows, num_heads, HEAD_DIM], last dim contiguous
  const void* v_src;
  void* k_pool;             // one layer's pool, NHD or HND
  void* v_pool;
  const int* block_table;   // int32, row r at block_table + r * bt_row_stride
  const int* seqlens;       // int32 [rows], or nullptr (pos = pos0 + r)
  long long k_src_row, k_src_head, v_src_row, v_src_head;
  long long k_page, k_s1, k_s2;  // pool strides: page, then dim 1 and dim 2 of the page
  long long v_page, v_s1, v_s2;  // (NHD: token, head; HND: head, token)
  long long bt_row_stride;
  long long rows;
  int num_heads;
  int num_pages;
  int max_pages;            // entries per block-table row
  int pos0;
};
// Field offsets are checked against fdpp.cache.PAGED_APPEND_PARAMS by tests/test_paged_cache.py
// (offline NVRTC; __builtin_offsetof does not compile under CuPy's run-time compiler).
static_assert(sizeof(PagedAppendParams) == 160, "PagedAppendParams size");

// Widest copy (16, 8, 4 or 2 bytes) that divides a head's row of HEAD_DIM elements.
template <typename DType, int HEAD_DIM> struct VecBytes {
  static constexpr int ROW = HEAD_DIM * (int)sizeof(DType);
  static constexpr int value = ROW % 16 == 0 ? 16 : ROW % 8 == 0 ? 8 : ROW % 4 == 0 ? 4 : 2;
};
template <int BYTES> struct RawVec;
template <> struct RawVec<16> { using type = uint4; };
template <> struct RawVec<8> { using type = uint2; };
template <> struct RawVec<4> { using type = unsigned int; };
template <> struct RawVec<2> { using type = unsigned short; };

// One thread's write in paged_append and paged_append_quant: vector v (of VPR) of head h of row r.
template <typename DType, typename Pool> struct AppendSlot {
  const DType* src;  // head h of row r in k_src / v_src
  Pool* dst;         // the (token, head) row in k_pool / v_pool (pool strides in Pool elements)
  long long slot;    // the token's slot in its page
  long long pos;     // the token's position in its sequence
  int h, v, page;
  bool is_v;         // grid.y 1: V
};

// The write of thread (blockIdx.x, threadIdx.x) (Params: PagedAppendParams or PagedAppendQParams,
// which share these fields; VPR vectors a (row, head)), into t; false when it writes nothing: past
// the last row, or the rules at the top (not a reserved slot, or a corrupt block-table entry).
template <int VPR, int PAGE_SIZE, bool HND, typename Params, typename DType, typename Pool>
__device__ __forceinline__ bool append_slot(const Params& p, AppendSlot<DType, Pool>& t) {
  const long long per_row = (long long)p.num_heads * VPR;
  const long long i = (long long)blockIdx.x * APPEND_THREADS + threadIdx.x;
  if (i >= p.rows * per_row) return false;
  const long long r = i / per_row;
  const int rem = (int)(i - r * per_row);
  const int h = rem / VPR, v = rem - h * VPR;

  // uniform over a (row, head), so an int4 group of paged_append_quant returns as a whole
  const long long pos = p.seqlens != nullptr ? (long long)p.seqlens[r] - 1 : (long long)p.pos0 + r;
  if (pos < 0 || pos >= (long long)p.max_pages * PAGE_SIZE) return false;  // not a reserved slot: skip
  const int page = p.block_table[r * p.bt_row_stride + pos / PAGE_SIZE];
  if (page < 0 || page >= p.num_pages) return false;                        // corrupt entry: skip
  const long long slot = pos & (PAGE_SIZE - 1);

  const bool is_v = blockIdx.y != 0;
  const long long src_row = is_v ? p.v_src_row : p.k_src_row;
  const long long src_head = is_v ? p.v_src_head : p.k_src_head;
  const long long s_page = is_v ? p.v_page : p.k_page;
  const long long s1 = is_v ? p.v_s1 : p.k_s1;
  const long long s2 = is_v ? p.v_s2 : p.k_s2;
  const DType* src = static_cast<const DType*>(is_v ? p.v_src : p.k_src) + r * src_row + h * src_head;
  Pool* dst = static_cast<Pool*>(is_v ? p.v_pool : p.k_pool) + (long long)page * s_page +
              (HND ? h * s1 + slot * s2 : slot * s1 + h * s2);
  t = AppendSlot<DType, Pool>{src, dst, slot, pos, h, v, page, is_v};
  return true;
}

template <typename DType, int HEAD_DIM, int PAGE_SIZE, bool HND>
__global__ void __launch_bounds__(APPEND_THREADS) paged_append(const PagedAppendParams p) {
  static_assert(PAGE_SIZE >= 1 && PAGE_SIZE <= 256 && (PAGE_SIZE & (PAGE_SIZE - 1)) == 0,
                "PAGE_SIZE must be a power of two in 1..256");
  static_assert(HEAD_DIM >= 1, "HEAD_DIM must be positive");
  constexpr int VB = VecBytes<DType, HEAD_DIM>::value;
  constexpr int EPV = VB / (int)sizeof(DType);  // elements per vector
  constexpr int VPR = HEAD_DIM / EPV;           // vectors per (row, head)
  using Vec = typename RawVec<VB>::type;

  AppendSlot<DType, DType> t;
  if (!append_slot<VPR, PAGE_SIZE, HND>(p, t)) return;
  reinterpret_cast<Vec*>(t.dst)[t.v] = reinterpret_cast<const Vec*>(t.src)[t.v];
}

// The argument of paged_append_quant (Python mirror: fdpp.cache.PAGED_APPEND_Q_PARAMS): the fields
// of PagedAppendParams (pool strides in bytes), then the scale pointers and scale-pool strides.
struct PagedAppendQParams {
  const void* k_src;
  const void* v_src;
  void* k_pool;
  void* v_pool;
  const int* block_table;
  const int* seqlens;
  long long k_src_row, k_src_head, v_src_row, v_src_head;
  long long k_page, k_s1, k_s2;
  long long v_page, v_s1, v_s2;
  long long bt_row_stride;
  long long rows;
  int num_heads;
  int num_pages;
  int max_pages;
  int pos0;
  void* k_sc;               // fp8: const float [num_heads] descale; int4: fp16 scale pool (layer)
  void* v_sc;
  unsigned short* k_zp;     // int4: fp16 zero pool of the layer
  unsigned short* v_zp;
  long long sc_page, sc_s1, sc_s2;  // int4 scale / zero pool strides (elements), NHD / HND as above
};
static_assert(sizeof(PagedAppendQParams) == 216, "PagedAppendQParams size");

// Quantize and store thread t's 8 elements f (paged_append_quant's rounding; int4: every lane of
// the group calls this, the group's max / min by shuffles, lane 0 of the group stores its scale / zero).
template <int FMT, int G, bool HND, typename DType>
__device__ __forceinline__ void quant_store8(const PagedAppendQParams& p, const AppendSlot<DType, unsigned char>& t,
                                             const float* f) {
  const int h = t.h, v = t.v;
  if constexpr (FMT == KV_INT4) {
    constexpr int LANES = G / 8;
    const unsigned int mask = group_mask<LANES>();
    float mx = f[0], mn = f[0];
#pragma unroll
    for (int e = 1; e < 8; ++e) { mx = nan_max(mx, f[e]); mn = nan_min(mn, f[e]); }
    group_max_min<LANES>(mx, mn, mask);
    unsigned short sh, zh;
    int4_params(mx, mn, sh, zh);
    reinterpret_cast<unsigned int*>(t.dst)[v] = int4_pack8(f, h2f(sh), h2f(zh));
    if (v % LANES == 0) {
      const long long g = (long long)t.page * p.sc_page +
                          (HND ? h * p.sc_s1 + t.slot * p.sc_s2 : t.slot * p.sc_s1 + h * p.sc_s2) + v / LANES;
      static_cast<unsigned short*>(t.is_v ? p.v_sc : p.k_sc)[g] = sh;
      (t.is_v ? p.v_zp : p.k_zp)[g] = zh;
    }
  } else {
    const float descale = static_cast<const float*>(t.is_v ? p.v_sc : p.k_sc)[h];
    reinterpret_cast<uint2*>(t.dst)[v] = fp8_pack8<FMT>(f, descale);
  }
}

template <typename DType, int FMT, int G, int HEAD_DIM, int PAGE_SIZE, bool HND>
__global__ void __launch_bounds__(APPEND_THREADS) paged_append_quant(const PagedAppendQParams p) {
  static_assert(PAGE_SIZE >= 1 && PAGE_SIZE <= 256 && (PAGE_SIZE & (PAGE_SIZE - 1)) == 0,
                "PAGE_SIZE must be a power of two in 1..256");
  static_assert(HEAD_DIM >= 8 && HEAD_DIM % 8 == 0, "HEAD_DIM must be a positive multiple of 8");
  static_assert(FMT == KV_FP8_E4M3 || FMT == KV_FP8_E5M2 || FMT == KV_INT4, "FMT: a quantized format");
  static_assert(FMT != KV_INT4 || ((G == 32 || G == 64 || G == 128) && HEAD_DIM % G == 0),
                "int4: group size 32, 64 or 128 dividing HEAD_DIM");
  constexpr int VPR = HEAD_DIM / 8;  // 8-element vectors per (row, head)

  AppendSlot<DType, unsigned char> t;
  if (!append_slot<VPR, PAGE_SIZE, HND>(p, t)) return;  // int4: whole groups (VPR is a multiple of G / 8)
  float f[8];
  load8<DType>(t.src + t.v * 8, f);
  quant_store8<FMT, G, HND>(p, t, f);
}

// Round 8 floats to DType and store them (one element at a time: no alignment beyond DType's own).
template <typename DType>
__device__ __forceinline__ void store8(DType* p, const float* f) {
#pragma unroll
  for (int e = 0; e < 8; ++e) TypeTraits<DType>::store(p + e, f[e]);
}

// The rotation of elements [8 v, 8 v + 8) of a head's row (rope.cuh) at position pos of the tables
// (float32 [n_pos, HEAD_DIM / 2]), each result rounded to DType (what a rotated row holds).
template <typename DType, int HEAD_DIM>
__device__ __forceinline__ void rope8(const DType* row, int v, const float* cos_t, const float* sin_t, int pos,
                                      float* f) {
  constexpr int HALF = HEAD_DIM / 2;
  const bool lo = v * 8 < HALF;
  const int i0 = lo ? v * 8 : v * 8 - HALF;  // the tables' column of element 0
  float own[8], other[8];
  load8<DType>(row + v * 8, own);
  load8<DType>(row + (lo ? v * 8 + HALF : v * 8 - HALF), other);
  const float* c = cos_t + (long long)pos * HALF + i0;
  const float* s = sin_t + (long long)pos * HALF + i0;
#pragma unroll
  for (int e = 0; e < 8; ++e)
    f[e] = round_to<DType>(lo ? rope_lo(own[e], other[e], c[e], s[e]) : rope_hi(other[e], own[e], c[e], s[e]));
}

template <int FMT, typename DType> struct PoolOf { using type = unsigned char; };
template <typename DType> struct PoolOf<0, DType> { using type = DType; };

// The q side of paged_rope_append (Python mirror: fdpp.cache.ROPE_APPEND_PARAMS). Strides in elements.
struct RopeAppendParams {
  const void* q_src;    // [rows, num_q_heads, HEAD_DIM] (the QKV rows' q part), last dim contiguous
  void* q_out;          // [rows, num_q_heads, HEAD_DIM]
  const float* cos_t;   // [n_pos, HEAD_DIM / 2]
  const float* sin_t;
  long long q_src_row, q_src_head, q_out_row, q_out_head;
  int num_q_heads;
  int n_pos;
};
static_assert(sizeof(RopeAppendParams) == 72, "RopeAppendParams size");

template <typename DType, int FMT, int G, int HEAD_DIM, int PAGE_SIZE, bool HND>
__global__ void __launch_bounds__(APPEND_THREADS) paged_rope_append(const PagedAppendQParams p,
                                                                    const RopeAppendParams r) {
  static_assert(PAGE_SIZE >= 1 && PAGE_SIZE <= 256 && (PAGE_SIZE & (PAGE_SIZE - 1)) == 0,
                "PAGE_SIZE must be a power of two in 1..256");
  static_assert(HEAD_DIM >= 16 && HEAD_DIM % 16 == 0, "HEAD_DIM must be a positive multiple of 16");
  static_assert(FMT == 0 || FMT == KV_FP8_E4M3 || FMT == KV_FP8_E5M2 || FMT == KV_INT4, "FMT: 0 or a format");
  static_assert(FMT != KV_INT4 || ((G == 32 || G == 64 || G == 128) && HEAD_DIM % G == 0),
                "int4: group size 32, 64 or 128 dividing HEAD_DIM");
  constexpr int VPR = HEAD_DIM / 8;  // 8-element vectors per (row, head)
  if (blockIdx.y == 2) {  // q: rotated into q_out
    const long long per_row = (long long)r.num_q_heads * VPR;
    const long long i = (long long)blockIdx.x * APPEND_THREADS + threadIdx.x;
    if (i >= p.rows * per_row) return;
    const long long row = i / per_row;
    const int rem = (int)(i - row * per_row), h = rem / VPR, v = rem - h * VPR;
    const int pos = min(max(p.seqlens[row] - 1, 0), r.n_pos - 1);
    float f[8];
    rope8<DType, HEAD_DIM>(static_cast<const DType*>(r.q_src) + row * r.q_src_row + h * r.q_src_head, v, r.cos_t,
                           r.sin_t, pos, f);
    store8(static_cast<DType*>(r.q_out) + row * r.q_out_row + h * r.q_out_head + v * 8, f);
    return;
  }
  using Pool = typename PoolOf<FMT, DType>::type;  // DType for FMT 0, bytes for a quantized pool
  AppendSlot<DType, Pool> t;
  if (!append_slot<VPR, PAGE_SIZE, HND>(p, t)) return;  // int4: whole groups, as paged_append_quant
  if constexpr (FMT == 0) {
    if (t.is_v) {  // V's raw bits, as paged_append copies them (16 bytes at a time)
      constexpr int N = 8 * (int)sizeof(DType) / 16;
#pragma unroll
      for (int j = 0; j < N; ++j)
        reinterpret_cast<uint4*>(t.dst + t.v * 8)[j] = reinterpret_cast<const uint4*>(t.src + t.v * 8)[j];
      return;
    }
  }
  float f[8];
  if (t.is_v) {
    load8<DType>(t.src + t.v * 8, f);
  } else {
    rope8<DType, HEAD_DIM>(t.src, t.v, r.cos_t, r.sin_t, (int)min(t.pos, (long long)r.n_pos - 1), f);
  }
  if constexpr (FMT == 0) {
    store8(t.dst + t.v * 8, f);
  } else {
    quant_store8<FMT, G, HND>(p, t, f);
  }
}

// The argument of paged_table_update (Python mirror: fdpp.cache.TABLE_UPDATE_PARAMS).
struct PagedTableUpdateParams {
  const int* src;
  int* block_table;
  int* seqlens;
  long long table_size;  // entries of block_table
  int num_lens;
  int num_entries;
};
static_assert(sizeof(PagedTableUpdateParams) == 40, "PagedTableUpdateParams size");

template <int THREADS>
__global__ void __launch_bounds__(THREADS) paged_table_update(const PagedTableUpdateParams p) {
  const long long i = (long long)blockIdx.x * THREADS + threadIdx.x;
  if (i < p.num_lens) {
    p.seqlens[i] = p.src[i];
    return;
  }
  const long long j = i - p.num_lens;
  if (j >= p.num_entries) return;
  const int idx = p.src[p.num_lens + j];  // duplicate indices carry equal values
  if (idx >= 0 && idx < p.table_size) p.block_table[idx] = p.src[p.num_lens + p.num_entries + j];
}

}  // namespace fdpp
