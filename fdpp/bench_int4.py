"""``python -m fdpp.bench --kv-dtype int4``: INT4 decode attention against its floor and fdpp's fp16.

Per point (batch x seqlen x page size): random INT4 caches (uint8 code pairs, fp16 scales ~ U(0.01,
0.3) and zeros ~ -8 x scale, groups of ``--int4-group``) rotated over enough sets to defeat L2, in
the bench's ``--kv-layout``; paged points shuffle their pages. Rows (the bench's CSV schema):

- ``fdpp`` / ``fdpp-paged`` with kv_dtype ``int4_g<g>``: fdpp.decode_attention /
  paged_decode_attention, CUDA-graph timed (fdpp.timing.time_calls);
- ``floor`` (kv_dtype ``int4_g<g>``): stream_read of the bytes such a call must read: the packed
  codes plus every row's fp16 scales and zeros (``DecodeProblem.kv_bytes``);
- ``fdpp-fp16`` / ``fdpp-paged-fp16`` (kv_dtype fp16): the same call on an fp16 cache of the
  shape, for the ratio the issue asks about (INT4 <= 0.33 x fdpp's fp16 at B=1, N=64k).

``max_rel_err`` of an INT4 row: max |out - ref| / max |ref| against float64 attention over the
dequantised cache of the first set, computed here with CuPy (no fdpp kernel). No peer exists:
FlashInfer has no INT4 KV decode.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np

from fdpp import bench, timing
from fdpp.configs import DecodeProblem
from fdpp.dtypes import DTYPES, int4_format

NOTE = ("no peer: FlashInfer (0.5.3) and the torch SDPA backends have no INT4 KV decode; fp16 rows are "
        "fdpp on an fp16 cache of the same shape")


def _dequant(cp: Any, codes: Any, scale: Any, zero: Any) -> Any:
    """float64 values of INT4 codes (element 2i = low nibble of byte i), fp16(n * s + z)."""
    n = cp.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1])
    g = n.shape[-1] // scale.shape[-1]
    s = cp.repeat(scale.astype(cp.float64), g, axis=-1)
    z = cp.repeat(zero.astype(cp.float64), g, axis=-1)
    return (n.astype(cp.float64) * s + z).astype(cp.float16).astype(cp.float64)


def _reference(cp: Any, q: Any, k: Any, v: Any, nhd: bool) -> Any:
    """float64 attention [B, Hq, D] over full K/V [B, N, Hkv, D] (NHD) / [B, Hkv, N, D]."""
    if not nhd:
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    b, hq, d = q.shape
    r = hq // k.shape[2]
    qq = q.astype(cp.float64).reshape(b, k.shape[2], r, d)
    s = cp.einsum("bhrd,bnhd->bhrn", qq, k) / math.sqrt(d)
    p = cp.exp(s - s.max(axis=-1, keepdims=True))
    o = cp.einsum("bhrn,bnhd->bhrd", p, v) / p.sum(axis=-1, keepdims=True)
    return o.reshape(b, hq, d)


def _int4_set(cp: Any, rng: Any, shape: tuple[int, ...], g: int) -> tuple[Any, ...]:
    *lead, d = shape
    codes = rng.integers(0, 256, size=(*lead, d // 2), dtype=np.uint8)
    s = rng.uniform(0.01, 0.3, size=(*lead, d // g)).astype(cp.float16)
    z = (-8.0 * s.astype(cp.float32)).astype(cp.float16)
    return codes, codes.copy(), s, s.copy(), z, z.copy()  # K codes, V codes, K/V scales, K/V zeros


def run(args: argparse.Namespace, shape: bench.Shape, rs: bench.RunSettings) -> tuple[list[dict[str, Any]], dict]:
    import cupy as cp

    from fdpp import registry

    dt = DTYPES[args.dtype]
    if dt.name != "fp16":
        raise SystemExit("fdpp.bench --kv-dtype int4: --dtype fp16 (CuPy arrays; bf16 q works in the API)")
    fmt = int4_format(args.int4_group)
    cp.cuda.Device(args.device).use()
    gpu = registry.device_limits(args.device).name
    rows: list[dict[str, Any]] = []
    for b in args.batch or [1, 8]:
        for n in args.seqlens or [4096, 16384, 65536]:
            for page in args.page_size:
                rows += _point(args, shape, rs, fmt, gpu, b, n, page)
                cp.get_default_memory_pool().free_all_blocks()
    meta = {"gpu_name": gpu, "kv_dtype": fmt.name, "int4_group_size": fmt.group_size, "peers": NOTE,
            "floor": "stream_read of the packed codes plus the fp16 scales and zeros of every (token, KV head) "
                     "row (DecodeProblem.kv_bytes)", "flagged": []}
    return rows, meta


def _point(args: argparse.Namespace, shape: bench.Shape, rs: bench.RunSettings, fmt: Any, gpu: str, b: int, n: int,
           page: int) -> list[dict[str, Any]]:
    """The three rows of one (batch, seqlen, page size) point."""
    import cupy as cp

    import fdpp

    dt = DTYPES[args.dtype]
    dev, nhd = args.device, args.kv_layout == "NHD"
    l2 = timing.l2_bytes(dev)
    tkw = dict(repeats=rs.repeats, warmup=rs.warmup)
    prob = DecodeProblem(b, shape.hq, shape.hkv, shape.head_dim, n, dt.name, fmt.name, page_size=page)
    nbytes = prob.kv_bytes()
    sets = timing.rotation_count(nbytes, l2, max_sets=16)
    rng = cp.random.default_rng(1234 + b * 7919 + n + page)
    table = lens = None
    if page:
        pages = b * -(-n // page)
        full = (pages, page, shape.hkv, shape.head_dim) if nhd else (pages, shape.hkv, page, shape.head_dim)
        table = cp.asarray(bench.shuffled_table(np.random.default_rng([b, n, page]), b, -(-n // page)))
        lens = cp.full((b,), n, dtype=cp.int32)
    else:
        full = (b, n, shape.hkv, shape.head_dim) if nhd else (b, shape.hkv, n, shape.head_dim)
    data = [_int4_set(cp, rng, full, fmt.group_size) for _ in range(sets)]
    qs = [rng.standard_normal((b, shape.hq, shape.head_dim), dtype=np.float32).astype(cp.float16) for _ in range(sets)]
    outs = [cp.empty((b, shape.hq, shape.head_dim), cp.float16) for _ in range(sets)]

    def attend(i: int, k: Any, v: Any, **kw: Any) -> Any:
        kw.update(kv_layout=args.kv_layout, out=outs[i % sets])
        if page:
            return fdpp.paged_decode_attention(qs[i % sets], k, v, table, lens, **kw)
        return fdpp.decode_attention(qs[i % sets], k, v, **kw)

    def call(i: int) -> Any:
        kc, vc, ks, vs, kz, vz = data[i]
        return attend(i, kc, vc, kv_dtype="int4", k_descale=ks, v_descale=vs, k_zero=kz, v_zero=vz)

    call(0)
    err = math.nan
    checked = not page and b * n <= (1 << 17)
    if checked:  # float64 reference of set 0 (contiguous points)
        kc, vc, ks, vs, kz, vz = data[0]
        ref = _reference(cp, qs[0], _dequant(cp, kc, ks, kz), _dequant(cp, vc, vs, vz), nhd)
        err = float(cp.abs(outs[0].astype(cp.float64) - ref).max() / cp.abs(ref).max())
    cpr = bench.calls_per_replay_for(nbytes, rs.calls_per_replay)
    t = timing.time_calls([lambda i=i: call(i) for i in range(sets)], calls_per_replay=cpr, **tkw)
    floor = timing.time_stream_read(nbytes, device_id=dev, calls_per_replay=cpr, **tkw)
    impl = "fdpp-paged" if page else "fdpp"
    rows = [bench.make_row(impl, shape, b, n, dt.name, page, t.median_us, t.p10_us, t.p90_us, nbytes,
                           floor.median_us, err, gpu, fmt.name),
            bench.make_row("floor", shape, b, n, dt.name, page, floor.median_us, floor.p10_us, floor.p90_us, nbytes,
                           floor.median_us, 0.0, gpu, fmt.name)]
    data.clear()
    # fdpp on an fp16 cache of the same shape
    f16 = DecodeProblem(b, shape.hq, shape.hkv, shape.head_dim, n, dt.name, page_size=page)
    sets16 = timing.rotation_count(f16.kv_bytes(), l2, max_sets=16)
    kvs = [rng.standard_normal(full, dtype=np.float32).astype(cp.float16) for _ in range(2 * sets16)]
    attend(0, kvs[0], kvs[1])
    t16 = timing.time_calls([lambda i=i: attend(i, kvs[2 * i], kvs[2 * i + 1]) for i in range(sets16)],
                            calls_per_replay=bench.calls_per_replay_for(f16.kv_bytes(), rs.calls_per_replay), **tkw)
    rows.append(bench.make_row(f"{impl}-{dt.name}", shape, b, n, dt.name, page, t16.median_us, t16.p10_us, t16.p90_us,
                               f16.kv_bytes(), math.nan, math.nan, gpu, dt.name))
    print(f"B={b} N={n} page={page}: int4 {t.median_us:.2f} us (floor {floor.median_us:.2f}, "
          f"{t.median_us / floor.median_us:.2f} x), fp16 {t16.median_us:.2f} us, "
          f"int4 / fp16 = {t.median_us / t16.median_us:.3f}, max_rel_err "
          f"{f'{err:.2e}' if checked else 'not checked (paged, or B x N > 2^17)'}", flush=True)
    return rows
