#line 2 "kernels_cu/merge.cuh"
// Merging split-KV partials, written once for decode_combine (the two-launch path) and for the
// fused single launch (the last-arriving CTA of a request's KV-head group merges in the kernel).
//
// A partial of row bh (one (request, query head)) and split s is o_part[(bh*S + s)*HEAD_DIM ...]
// (already normalised by its own sum) and lse_part[bh*S + s] (log2 domain; -inf: empty split,
// NaN: poisoned). Merged: lse = log2 sum_s exp2(lse_s), o = sum_s exp2(lse_s - lse) * o_s.
//
// The work of one merge is ROWS rows x COLS float4 columns ("items"), spread over THREADS
// threads: with more threads than items, SUB = THREADS / ITEMS threads share an item and take
// every SUB-th slot; their states are merged through shared memory in a fixed order, so the
// result never depends on the order the partials arrived in (bitwise reproducible).
#pragma once
#include "kv_cache.cuh"

namespace fdpp {

struct MergeState {
  float m, w;   // running max and sum of exp2(lse - m); w = NaN marks a poisoned row
  float4 acc;   // sum of exp2(lse - m) * o
};

__device__ __forceinline__ void merge_into(MergeState& s, float m2, float w2, float4 a2) {
  const float mn = fmaxf(s.m, m2);
  const float mref = mn == neg_inf() ? 0.f : mn;  // both empty: keep zeros
  const float sa = fast_exp2(s.m - mref), sb = fast_exp2(m2 - mref);
  s.m = mn;
  s.w = s.w * sa + w2 * sb;
  s.acc.x = s.acc.x * sa + a2.x * sb; s.acc.y = s.acc.y * sa + a2.y * sb;
  s.acc.z = s.acc.z * sa + a2.z * sb; s.acc.w = s.acc.w * sa + a2.w * sb;
}

// Writes a merged row to the output (out in DType, lse in natural log, or null).
template <typename DType, int HEAD_DIM>
struct FinalSink {
  void* out; float* lse;
  __device__ __forceinline__ void operator()(long long row, int col, float4 v, float lse2) const {
    DType* o = static_cast<DType*>(out) + row * HEAD_DIM + col * 4;
    TypeTraits<DType>::store(o + 0, v.x); TypeTraits<DType>::store(o + 1, v.y);
    TypeTraits<DType>::store(o + 2, v.z); TypeTraits<DType>::store(o + 3, v.w);
    if (col == 0 && lse != nullptr) lse[row] = lse2 * 0.69314718055994531f;
  }
};

// Writes a merged row back as the partial of slot `first` (a first-level bucket's result).
template <int HEAD_DIM>
struct PartialSink {
  float* o_part; float* lse_part; int num_splits, first;
  __device__ __forceinline__ void operator()(long long row, int col, float4 v, float lse2) const {
    const long long slot = row * num_splits + first;
    reinterpret_cast<float4*>(o_part + slot * HEAD_DIM)[col] = v;
    if (col == 0) lse_part[slot] = lse2;
  }
};

// Merge slots first, first + step, ... (count of them) of rows bh0 .. bh0 + ROWS - 1, float4
// columns c0 .. c0 + COLS - 1, and hand each merged item to sink. Every thread of the CTA calls
// it (it has barriers); smem: THREADS * 6 floats (unused when SUB == 1). Partials are read
// through L2 (__ldcg): in the fused path other CTAs wrote them during this launch.
template <int HEAD_DIM, int ROWS, int COLS, int THREADS, typename Sink>
__device__ __forceinline__ void merge_partials(const DecodeParams& p, long long bh0, int c0, int first,
                                               int count, int step, float* smem, const Sink& sink) {
  constexpr int ITEMS = ROWS * COLS;
  constexpr int SUB = THREADS >= ITEMS ? THREADS / ITEMS : 1;
  constexpr int PER = ITEMS > THREADS ? (ITEMS + THREADS - 1) / THREADS : 1;
  const int S = p.num_splits, tid = threadIdx.x;
  const int sub = tid / ITEMS;  // (SUB == 1: 0 for every thread that owns items)
  MergeState st[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    st[j].m = neg_inf(); st[j].w = 0.f; st[j].acc = make_float4(0.f, 0.f, 0.f, 0.f);
    const int item = SUB > 1 ? tid % ITEMS : tid + j * THREADS;
    if (item >= ITEMS || sub >= SUB) continue;
    const long long row = bh0 + item / COLS;
    const float* lp = p.lse_part + row * S;
    const float4* op = reinterpret_cast<const float4*>(p.o_part + row * S * HEAD_DIM) + c0 + item % COLS;
    bool bad = false;
    // BATCH slots' loads are issued together (one L2 round trip per BATCH slots, not per slot),
    // then merged one by one in slot order; slots past count load slot `first` (written) unused
    constexpr int BATCH = 8;
    for (int k0 = sub; k0 < count; k0 += BATCH * SUB) {
      float lsb[BATCH];
      float4 xb[BATCH];
#pragma unroll
      for (int u = 0; u < BATCH; ++u) {
        const int k = k0 + u * SUB;
        const int s = first + (k < count ? k * step : 0);
        lsb[u] = __ldcg(lp + s);
        xb[u] = __ldcg(op + (long long)s * (HEAD_DIM / 4));
      }
#pragma unroll
      for (int u = 0; u < BATCH; ++u) {
        if (k0 + u * SUB >= count) break;
        const float ls = lsb[u];
        const float4 x = xb[u];
        bad |= ls != ls;
        if (ls == neg_inf()) continue;  // empty split
        const float mn = fmaxf(st[j].m, ls);
        const float sc = fast_exp2(st[j].m - mn), w = fast_exp2(ls - mn);  // m = -inf first: sc = 0
        st[j].m = mn;
        st[j].w = st[j].w * sc + w;
        st[j].acc.x = fmaf(w, x.x, st[j].acc.x * sc); st[j].acc.y = fmaf(w, x.y, st[j].acc.y * sc);
        st[j].acc.z = fmaf(w, x.z, st[j].acc.z * sc); st[j].acc.w = fmaf(w, x.w, st[j].acc.w * sc);
      }
    }
    if (bad) st[j].w = __int_as_float(0x7fc00000);
  }
  if constexpr (SUB > 1) {  // merge the SUB states of each item, sub 0 first, in a fixed order
    float* sm_m = smem;
    float* sm_w = smem + THREADS;
    float4* sm_a = reinterpret_cast<float4*>(smem + 2 * THREADS);
    if (sub < SUB) { sm_m[tid] = st[0].m; sm_w[tid] = st[0].w; sm_a[tid] = st[0].acc; }
    __syncthreads();
    if (sub == 0)
#pragma unroll 4
      for (int u = 1; u < SUB; ++u) {
        const int o = u * ITEMS + tid;
        merge_into(st[0], sm_m[o], sm_w[o], sm_a[o]);
      }
  }
  __syncthreads();  // every read of the slots is done: a sink may overwrite slot `first`
  if (sub != 0) return;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int item = SUB > 1 ? tid : tid + j * THREADS;
    if (item >= ITEMS) continue;
    const MergeState& s = st[j];
    float4 v;
    float lse2;
    if (s.w != s.w) {  // poisoned
      const float nan = __int_as_float(0x7fc00000);
      v = make_float4(nan, nan, nan, nan); lse2 = nan;
    } else if (s.m == neg_inf()) {  // every slot empty: a request of length 0
      v = make_float4(0.f, 0.f, 0.f, 0.f); lse2 = neg_inf();
    } else {
      const float inv = 1.f / s.w;
      v = make_float4(s.acc.x * inv, s.acc.y * inv, s.acc.z * inv, s.acc.w * inv);
      lse2 = s.m + __log2f(s.w);
    }
    sink(bh0 + item / COLS, c0 + item % COLS, v, lse2);
  }
}

// The fused single launch's tail, called by every thread of a split CTA after it stored its
// partial. Tickets (p.counters, zero before the launch and zero again after it: the last
// arrival resets each counter, so CUDA-graph replays work): with buckets of p.bucket splits,
// the last CTA to finish a bucket merges it into the bucket's first slot, and the last bucket
// to finish merges the buckets into out / lse; with one bucket the last CTA merges all splits.
// smem is the kernel's dynamic shared memory (the split kernel's merge area first); the role word
// lives past both merge areas (FusedRole::WORD, mirrored by DecodeConfig.smem_bytes), not in a static
// __shared__ variable: static shared memory moves the dynamic base off 128-byte alignment, and that
// slowed the split kernels' main loop by 10-15 % on an H200 (runs H2/H3), with or without a fused plan.
template <int HEAD_DIM, int G, int THREADS>
struct FusedRole {
  static constexpr int SPLIT_MERGE = THREADS / 32 * G * (HEAD_DIM + 2);  // store_merged's floats
  static constexpr int WORD = SPLIT_MERGE > THREADS * 6 ? SPLIT_MERGE : THREADS * 6;
};

template <typename DTypeQ, int HEAD_DIM, int G, int THREADS>
__device__ __forceinline__ void fused_merge(const DecodeParams& p, int b, int h0, int split, float* smem) {
  int& role = *reinterpret_cast<int*>(smem + FusedRole<HEAD_DIM, G, THREADS>::WORD);  // 0: done, 1: merge my bucket, 2: merge everything
  const int S = p.num_splits, R = p.bucket > 0 && p.bucket < S ? p.bucket : S;
  const int nb = (S + R - 1) / R, k = split / R, first = k * R, count = min(R, S - first);
  unsigned* cnt = p.counters + ((long long)b * gridDim.y + blockIdx.y) * (nb > 1 ? nb + 1 : 1);
  const long long bh0 = (long long)b * p.num_q_heads + h0;
  constexpr int F4 = HEAD_DIM / 4;
  __threadfence();  // this CTA's partial is visible before its ticket is
  __syncthreads();
  if (threadIdx.x == 0) {
    if (nb == 1) role = atomicAdd(cnt, 1u) == unsigned(S - 1) ? 2 : 0;
    else role = atomicAdd(cnt + 1 + k, 1u) == unsigned(count - 1) ? 1 : 0;
  }
  __syncthreads();
  if (role == 0) return;
  __threadfence();
  if (role == 1) {
    if (threadIdx.x == 0) atomicExch(cnt + 1 + k, 0u);
    merge_partials<HEAD_DIM, G, F4, THREADS>(p, bh0, 0, first, count, 1, smem,
                                             PartialSink<HEAD_DIM>{p.o_part, p.lse_part, S, first});
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) role = atomicAdd(cnt, 1u) == unsigned(nb - 1) ? 2 : 0;
    __syncthreads();
    if (role == 0) return;
    __threadfence();
  }
  if (threadIdx.x == 0) atomicExch(cnt, 0u);
  // one level: every split; two levels: the bucket results, in their buckets' first slots
  merge_partials<HEAD_DIM, G, F4, THREADS>(p, bh0, 0, 0, nb > 1 ? nb : S, nb > 1 ? R : 1, smem,
                                           FinalSink<DTypeQ, HEAD_DIM>{p.out, p.lse});
}

// The cluster merge (sm_90): the CLUSTER split CTAs of one (request, KV-head group) form a thread-
// block cluster (grid.x == CLUSTER, one cluster per group), and merge through distributed shared
// memory instead of global partials: no workspace, no tickets, no second launch. Each CTA first
// merges its warps' states red[w][g] (acc[HEAD_DIM], m, l; written, then a barrier) into its own
// state cst[g] (o unnormalised, m, l), placed after red; after a cluster barrier, CTA `rank` merges
// columns [rank * PER, (rank + 1) * PER) of the G x HEAD_DIM outputs, reading every CTA's state in
// rank order (fixed: bitwise reproducible), and writes out / lse; a second barrier keeps every CTA
// (its shared memory) alive until the others have read it. That barrier is split: a thread arrives
// as soon as its remote reads are done (when one pass covers the CTA's columns, PER <= THREADS) and
// waits at the very end, so its merge math and stores overlap the other CTAs' reads (run T6: 1-3 %
// off the cluster plans at B = 1, results/device_runT1/README.md). A bad CTA (bad page, bad length) poisons
// its state (l = NaN), so the merged rows are NaN. Called by every thread of the CTA.
template <typename DTypeQ, int HEAD_DIM, int G, int NUM_WARPS, int CLUSTER>
__device__ __forceinline__ void cluster_merge(const DecodeParams& a, float* red, int b, int h0, bool bad, float vds) {
  constexpr int THREADS = NUM_WARPS * 32, ROW = HEAD_DIM + 2;
  float* cst = red + NUM_WARPS * G * ROW;
  for (int idx = threadIdx.x; idx < G * (HEAD_DIM + 1); idx += THREADS) {  // d == HEAD_DIM: (m, l)
    const int g = idx / (HEAD_DIM + 1), d = idx % (HEAD_DIM + 1);
    float mx = neg_inf();
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) mx = fmaxf(mx, red[(w * G + g) * ROW + HEAD_DIM]);
    const float mref = mx == neg_inf() ? 0.f : mx;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float* r = red + (w * G + g) * ROW;
      s += r[d < HEAD_DIM ? d : HEAD_DIM + 1] * fast_exp2(r[HEAD_DIM] - mref);
    }
    if (d < HEAD_DIM) {
      cst[g * ROW + d] = s;
    } else {
      cst[g * ROW + HEAD_DIM] = mx;
      cst[g * ROW + HEAD_DIM + 1] = bad || gridDim.x != CLUSTER ? __int_as_float(0x7fc00000) : s;
    }
  }
  cluster_sync();
  constexpr int ITEMS = G * HEAD_DIM, PER = (ITEMS + CLUSTER - 1) / CLUSTER;
  const int rank = static_cast<int>(cluster_rank());
  bool arrived = false;  // at the second barrier: every thread arrives exactly once
  for (int i = threadIdx.x; i < PER; i += THREADS) {
    const int item = rank * PER + i;
    if (item >= ITEMS) break;
    const int g = item / HEAD_DIM, d = item % HEAD_DIM;
    float ms[CLUSTER], ls[CLUSTER], os[CLUSTER];
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r) {
      const unsigned row = cluster_map(cst + g * ROW, r);
      ms[r] = ld_cluster(row + 4 * HEAD_DIM);
      ls[r] = ld_cluster(row + 4 * (HEAD_DIM + 1));
      os[r] = ld_cluster(row + 4 * d);
    }
    if (PER <= THREADS) {  // this thread's only pass: its remote reads are done
      cluster_arrive();
      arrived = true;
    }
    float mx = neg_inf();
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r) mx = fmaxf(mx, ms[r]);
    const float mref = mx == neg_inf() ? 0.f : mx;
    float lsum = 0.f, o = 0.f;
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r) {
      const float sc = fast_exp2(ms[r] - mref);
      lsum += ls[r] * sc;
      o += os[r] * sc;
    }
    const bool poisoned = !(lsum >= 0.f);  // NaN: a bad CTA, or NaN / Inf scores
    const float inv = poisoned ? __int_as_float(0x7fc00000) : (lsum > 0.f ? vds / lsum : 0.f);
    const float lse2 = poisoned ? __int_as_float(0x7fc00000) : (lsum > 0.f ? mref + __log2f(lsum) : neg_inf());
    const long long bh = (long long)b * a.num_q_heads + h0 + g;
    TypeTraits<DTypeQ>::store(static_cast<DTypeQ*>(a.out) + bh * HEAD_DIM + d, o * inv);
    if (d == 0 && a.lse != nullptr) a.lse[bh] = lse2 * 0.69314718055994531f;
  }
  if (!arrived) cluster_arrive();
  cluster_wait();  // no CTA leaves (its shared memory) before every remote read is done
}

}  // namespace fdpp
