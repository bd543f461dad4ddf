#line 2 "kernels_cu/common.cuh"
// Shared device helpers for fdpp kernels: element types, 16-byte vector conversions, cp.async.
// Self-contained (no CUDA headers), so the same source compiles under CuPy's NVRTC on a GPU
// machine and under the cuda-bindings NVRTC wheel on a CPU-only CI machine.
#pragma once

namespace fdpp {

// Storage types. Bit-exact with IEEE binary16 / bfloat16 as used by NumPy, ml_dtypes, CuPy, torch.
struct __align__(2) half_t { unsigned short bits; };
struct __align__(2) bfloat16_t { unsigned short bits; };

__device__ __forceinline__ float h2f(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

template <typename T> struct TypeTraits;

template <> struct TypeTraits<float> {
  static constexpr int VEC = 4;  // elements per 16-byte vector
  __device__ __forceinline__ static void unpack(const uint4& u, float* f) {
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
  }
  __device__ __forceinline__ static float load(const float* p) { return *p; }
  __device__ __forceinline__ static void store(float* p, float x) { *p = x; }
};

template <> struct TypeTraits<half_t> {
  static constexpr int VEC = 8;
  __device__ __forceinline__ static void unpack2(unsigned int w, float* f) {
    f[0] = h2f((unsigned short)(w & 0xffffu));
    f[1] = h2f((unsigned short)(w >> 16));
  }
  __device__ __forceinline__ static void unpack(const uint4& u, float* f) {
    unpack2(u.x, f); unpack2(u.y, f + 2); unpack2(u.z, f + 4); unpack2(u.w, f + 6);
  }
  __device__ __forceinline__ static float load(const half_t* p) { return h2f(p->bits); }
  __device__ __forceinline__ static void store(half_t* p, float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    p->bits = h;
  }
};

template <> struct TypeTraits<bfloat16_t> {
  static constexpr int VEC = 8;
  __device__ __forceinline__ static void unpack2(unsigned int w, float* f) {
    f[0] = __uint_as_float(w << 16);
    f[1] = __uint_as_float(w & 0xffff0000u);
  }
  __device__ __forceinline__ static void unpack(const uint4& u, float* f) {
    unpack2(u.x, f); unpack2(u.y, f + 2); unpack2(u.z, f + 4); unpack2(u.w, f + 6);
  }
  __device__ __forceinline__ static float load(const bfloat16_t* p) {
    return __uint_as_float(((unsigned int)p->bits) << 16);
  }
  __device__ __forceinline__ static void store(bfloat16_t* p, float x) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    p->bits = h;
  }
};

// ---- cp.async (sm_80+): 16-byte global->shared copy; src_bytes = 0 zero-fills without reading.
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, int src_bytes) {
  unsigned int dst = (unsigned int)__cvta_generic_to_shared(smem_dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ float fast_exp2(float x) {  // exp2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- programmatic dependent launch (sm_90+; no-ops below, and when the launch did not ask for it).
// A kernel launched with the PDL attribute (fdpp.launch, KernelCall(pdl=True)) may start while the
// previous kernel of its stream is finishing: it must call pdl_wait() before it reads anything that
// kernel wrote or writes anything it reads (its inputs, the shared split workspace, the tickets).
// pdl_trigger() lets the next PDL-launched kernel of the stream start launching (it still waits for
// this grid to complete and flush before its own pdl_wait() returns).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// l2_prefetch(p, bytes): ask the L2 to fetch [p, p + bytes) from device memory (sm_90+ bulk
// prefetch; p 16-byte aligned, bytes a multiple of 16; a no-op below sm_90). It has no result and
// no effect on any value a thread reads, and the L2 is the GPU's point of coherence, so it may be
// issued before pdl_wait() on memory the kernel before is still writing: it only warms the L2. The
// kernels issue it before pdl_wait() on bytes no earlier kernel writes in practice (the KV cache
// below the new token, weights), so the copies after pdl_wait() hit the L2 instead of waiting for
// device memory while the kernel before is finishing. pdl_read(p): an int read for such a hint (a
// block-table entry) that allocates nothing in L1, where a stale line could outlive pdl_wait().
__device__ __forceinline__ void l2_prefetch(const void* p, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ int pdl_read(const int* p) {
  int v;
  asm volatile("ld.global.cg.s32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

// ---- thread-block clusters (sm_90+; a kernel that calls these is launched only there, as a cluster)
// cluster_sync(): every thread of every CTA of the cluster arrives (its shared-memory writes
// released), then waits for all of them (acquiring theirs). ld_cluster(): a float of the shared
// memory of CTA `rank` of the cluster, at the address `p` has in this CTA (distributed shared memory).
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return r;
}
__device__ __forceinline__ unsigned cluster_size() {
  unsigned n = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
#endif
  return n;
}
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}
// The two halves of cluster_sync(), each thread on its own (not .aligned: threads of a warp may
// arrive at different points): cluster_arrive() releases this thread's earlier accesses (its remote
// reads too) and counts it in; cluster_wait() returns once every thread of the cluster has arrived.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ unsigned cluster_map(const void* p, unsigned rank) {
  unsigned out = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(a), "r"(rank));
#endif
  return out;
}
__device__ __forceinline__ float ld_cluster(unsigned addr) {
  float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
#endif
  return v;
}

__host__ __device__ constexpr int ceil_pow2(int x) { return x <= 1 ? 1 : 2 * ceil_pow2((x + 1) / 2); }

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// A constant that ptxas keeps in one register instead of re-materialising it before every use
// (it moves an immediate into a register again wherever register pressure is high: a MOV per use
// of a LOP3's second constant). x plus lane 0's lane id, which ptxas cannot know is 0.
__device__ __forceinline__ unsigned kept_const(unsigned x) {
  unsigned r;
  asm volatile("{\n .reg .u32 t;\n mov.u32 t, %%laneid;\n shfl.sync.idx.b32 t, t, 0, 31, 0xffffffff;\n add.u32 %0, t, %1;\n}"
               : "=r"(r) : "r"(x));
  return r;
}

}  // namespace fdpp

namespace fdpp {
// ---- tensor-core helpers (sm_80+): ldmatrix and mma.sync m16n8k16 with fp32 accumulation.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem_row) {
  unsigned a = (unsigned)__cvta_generic_to_shared(smem_row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem_row) {
  unsigned a = (unsigned)__cvta_generic_to_shared(smem_row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

template <typename T> struct Mma;
template <> struct Mma<half_t> {
  // d += a (16x16, row) * b (16x8, col); a, b packed f16x2
  __device__ __forceinline__ static void run(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                             unsigned a3, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static unsigned pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};
template <> struct Mma<bfloat16_t> {
  __device__ __forceinline__ static void run(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                             unsigned a3, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static unsigned pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};
}  // namespace fdpp
