"""GPU probe: does a split-KV kernel's *access pattern* cost bandwidth by itself?

    python3 scripts/probe_read_pattern.py [--points fp16:1024:8,fp8:65536:16,...] [--warps 4,8]
                                          [--tiles 64,256] [--unroll 8]

A decode-attention CTA of split s and KV head h reads the rows of tokens [s*chunk, (s+1)*chunk) of
head h: in an NHD cache [N, Hkv, D] one row of D elements (256 bytes in fp16 at D = 128, 128 bytes in
FP8) every Hkv rows. The floor (``fdpp.timing.time_stream_read``) reads the same bytes grid-stride:
at any moment every SM reads close to every other. This probe reads an NHD cache of llama3-8b
geometry (Hkv = 8, D = 128) with nothing but loads (16-byte ``ld.global.nc`` into registers, UNROLL
in flight per thread, XOR-folded), one CTA per (split, head) as the attention kernels launch them, in
three orders:

- ``chunked``: split s reads its contiguous token range (what the kernels do today);
- ``interleaved-T``: split s reads token tiles s, s + S, s + 2S, ... of T tokens each, so at any
  moment all splits of a head read neighbouring tiles.

Then ``split_cpasync``, the kernels' loader without their math (cp.async, STAGES deep, a barrier
per tile), in the chunked order, at ``--cp-points`` and ``--cp-shapes``.

Each point is ``kv:N:splits`` (kv = fp16 or fp8; the buffer holds K then V, each [N, Hkv, D]; a
CTA reads each token's K row, then its V row, as the kernels' tiles do). Prints µs per call (CUDA-graph replay over input sets
rotated past L2, median) and the ratio to the floor of the same bytes in the same process.
"""

from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

from fdpp import timing

HKV, D = 8, 128

SRC = r"""
template <int UNROLL, int NW, int ROWV>
__global__ void __launch_bounds__(NW * 32, 1)
split_read(const uint4* __restrict__ base, int n_tok, int hkv, int splits, int chunk, int tile_log,
           unsigned* __restrict__ sink) {
  constexpr int T = NW * 32;
  const int head = blockIdx.x % hkv, s = blockIdx.x / hkv;
  int rows, start = 0;
  const int tile = tile_log > 0 ? 1 << tile_log : 0;
  if (tile > 0) {  // interleaved: this CTA's j-th tile is tile j * splits + s of the head
    const int ntiles = (n_tok + tile - 1) / tile;
    rows = ntiles > s ? (ntiles - s + splits - 1) / splits * tile : 0;
  } else {
    start = s * chunk;
    rows = max(0, min(chunk, n_tok - start));
  }
  const long long total = (long long)rows * 2 * ROWV;  // K and V rows of each token
  const long long vplane = (long long)n_tok * hkv * ROWV;
  unsigned acc = 0;
  for (long long i = threadIdx.x; i < total; i += (long long)T * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long idx = i + (long long)u * T;
      const int r = (int)(idx / (2 * ROWV)), c = (int)(idx % ROWV);
      const long long plane = (idx / ROWV) & 1 ? vplane : 0;  // K row, then V row, of each token
      const int tok = tile > 0 ? (((r >> tile_log) * splits + s) << tile_log) + (r & (tile - 1)) : start + r;
      const bool ok = idx < total && tok < n_tok;
      const uint4* p = base + plane + ((long long)tok * hkv + head) * ROWV + c;
      if (ok) asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                           : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(p));
      else v[u] = make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x2545F491u) sink[0] = acc;
}

// The kernels' loader without their math: TILE tokens' K and V rows per stage copied by cp.async
// (16 bytes a thread, zero-filled past the chunk), STAGES deep; after each wait and barrier the next
// tile's copy is issued, then each thread folds its own chunks of the ready stage (a stand-in for
// the shared-memory reads of the math).
template <int NW, int STAGES, int ROWV, int TILE>
__global__ void __launch_bounds__(NW * 32, 1)
split_cpasync(const uint4* __restrict__ base, int n_tok, int hkv, int splits, int chunk, unsigned* __restrict__ sink) {
  extern __shared__ __align__(128) uint4 sm[];
  constexpr int T = NW * 32, PER = TILE * ROWV * 2, J = PER / T;
  static_assert(PER % T == 0, "a stage's chunks divide among the threads");
  const int head = blockIdx.x % hkv, s = blockIdx.x / hkv, tid = threadIdx.x;
  const int start = s * chunk, end = min(start + chunk, n_tok);
  const int ntiles = end > start ? (end - start + TILE - 1) / TILE : 0;
  const long long vplane = (long long)n_tok * hkv * ROWV;
  auto load = [&](int t, int st) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int idx = tid + j * T, r = idx / (2 * ROWV), c = idx % ROWV;
      const long long plane = (idx / ROWV) & 1 ? vplane : 0;
      const int tok = start + t * TILE + r;
      const bool ok = tok < end;
      const uint4* src = ok ? base + plane + ((long long)tok * hkv + head) * ROWV + c : base;
      const unsigned dst = (unsigned)__cvta_generic_to_shared(sm + st * PER + idx);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(ok ? 16 : 0));
    }
  };
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < ntiles) load(st, st);
    asm volatile("cp.async.commit_group;");
  }
  unsigned acc = 0;
  for (int t = 0; t < ntiles; ++t) {
    asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 2));
    __syncthreads();
    const int tl = t + STAGES - 1;
    if (tl < ntiles) load(tl, tl % STAGES);
    asm volatile("cp.async.commit_group;");
    const uint4* st = sm + (t % STAGES) * PER;
#pragma unroll
    for (int j = 0; j < J; ++j) { const uint4 v = st[tid + j * T]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
  }
  if (acc == 0x2545F491u) sink[0] = acc;
}
"""


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _launcher(kern, grid: tuple, block: tuple, args: tuple, smem: int = 0):
    def call() -> None:
        kern(grid, block, args, shared_mem=smem)  # on CuPy's current stream
    return call


def _point(pt: str, rowvs: dict, l2: int) -> tuple:
    """kv:N:splits -> (kv, N, splits, 16-byte chunks per row, bytes, chunk, buffer, set pointers, floor µs)."""
    kv, n, splits = pt.split(":")
    n, splits, rowv = int(n), int(splits), rowvs[kv]
    nbytes = 2 * n * HKV * rowv * 16  # K then V, each [N, Hkv, D]
    stride = -(-nbytes // 256) * 256
    sets = timing.rotation_count(stride, l2)
    buf = cp.empty(sets * stride, dtype=np.uint8)
    cp.cuda.runtime.memset(buf.data.ptr, 0x5A, buf.nbytes)
    ptrs = [buf.data.ptr + i * stride for i in range(sets)]
    floor = timing.time_stream_read(nbytes, ptrs=ptrs).median_us
    return kv, n, splits, rowv, nbytes, -(-n // splits), buf, ptrs, floor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", default="fp16:1024:8,fp16:1024:16,fp16:4096:8,fp16:4096:16,fp16:16384:16,"
                    "fp16:16384:33,fp16:65536:16,fp8:16384:16,fp8:65536:16,fp8:65536:33")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--tiles", default="64,256")
    ap.add_argument("--unroll", type=int, default=8)
    ap.add_argument("--cp-points", default="fp16:16384:16,fp16:65536:16,fp8:16384:16,fp8:65536:16,fp8:65536:33",
                    help="points for the cp.async loader (chunked order)")
    ap.add_argument("--cp-shapes", default="w4s3,w4s6,w8s3,w8s6",
                    help="w<warps>s<stages> of the cp.async loader; TILE = 16 x warps tokens (the kernels' u1)")
    args = ap.parse_args()
    warps, tiles = _ints(args.warps), _ints(args.tiles)
    rowvs = {"fp16": D * 2 // 16, "fp8": D // 16}
    names = [f"split_read<{args.unroll},{w},{rv}>" for w in warps for rv in sorted(set(rowvs.values()))]
    mod = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=names)
    sink = cp.zeros(1, dtype=np.uint32)
    l2 = timing.l2_bytes()
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; unroll {args.unroll}; one CTA per (split, head)")
    print(f"{'point':>18} {'MB':>6} {'floor':>8} {'order':>14} " + " ".join(f"{'w' + str(w):>14}" for w in warps))
    for pt in filter(None, args.points.split(",")):
        kv, toks, splits, rowv, nbytes, chunk, buf, ptrs, floor = _point(pt, rowvs, l2)
        for order in ["chunked"] + [f"interleaved-{t}" for t in tiles]:
            tile = 0 if order == "chunked" else int(order.split("-")[1])
            if tile & (tile - 1):
                raise SystemExit(f"--tiles: powers of two, got {tile}")
            cells = []
            for w in warps:
                k = mod.get_function(f"split_read<{args.unroll},{w},{rowv}>")
                fixed = (np.int32(toks), np.int32(HKV), np.int32(splits), np.int32(chunk),
                         np.int32(tile.bit_length() - 1 if tile else 0), np.uint64(sink.data.ptr))
                calls = [_launcher(k, (splits * HKV, 1, 1), (w * 32, 1, 1), (np.uint64(p),) + fixed) for p in ptrs]
                t = timing.time_calls(calls, repeats=9).median_us
                cells.append(f"{t:8.2f} {t / floor:5.3f}")
            print(f"{pt:>18} {nbytes / 2**20:6.0f} {floor:8.2f} {order:>14} " + " ".join(f"{c:>14}" for c in cells),
                  flush=True)
        del buf

    shapes = [tuple(int(x) for x in sh[1:].split("s")) for sh in args.cp_shapes.split(",") if sh]
    names = {sh + (rv,): f"split_cpasync<{sh[0]},{sh[1]},{rv},{16 * sh[0]}>" for sh in shapes
             for rv in sorted(set(rowvs.values()))}
    mod = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=list(names.values()))
    print("\ncp.async loader, chunked order, TILE = 16 x warps tokens")
    print(f"{'point':>18} {'MB':>6} {'floor':>8} " + " ".join(f"{f'w{sh[0]}s{sh[1]}':>14}" for sh in shapes))
    for pt in filter(None, args.cp_points.split(",")):
        kv, toks, splits, rowv, nbytes, chunk, buf, ptrs, floor = _point(pt, rowvs, l2)
        cells = []
        for w, st in shapes:
            k = mod.get_function(names[(w, st, rowv)])
            smem = st * 16 * w * rowv * 2 * 16
            if smem > cp.cuda.runtime.getDeviceProperties(0)["sharedMemPerBlockOptin"]:
                cells.append("-")
                continue
            k.max_dynamic_shared_size_bytes = smem
            fixed = (np.int32(toks), np.int32(HKV), np.int32(splits), np.int32(chunk), np.uint64(sink.data.ptr))
            calls = [_launcher(k, (splits * HKV, 1, 1), (w * 32, 1, 1), (np.uint64(p),) + fixed, smem) for p in ptrs]
            t = timing.time_calls(calls, repeats=9).median_us
            cells.append(f"{t:8.2f} {t / floor:5.3f}")
        print(f"{pt:>18} {nbytes / 2**20:6.0f} {floor:8.2f} " + " ".join(f"{c:>14}" for c in cells), flush=True)
        del buf


if __name__ == "__main__":
    main()
