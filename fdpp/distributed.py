"""Context-parallel decode: a KV cache sharded along the sequence across GPUs (one process per GPU).

Every rank holds a disjoint part of each request's keys and values (any part: contiguous blocks,
round-robin tokens, uneven or empty) and the same query ``q``. A step is::

    local  : (out_r, lse_r) = fdpp.decode_attention(q, local_k, local_v, return_lse=True)
    gather : every rank receives (out_s, lse_s) of all W ranks      (one NCCL all-gather)
    merge  : out = fdpp.merge_states(outs, lses)                    (ranks in order 0..W-1)

The merge is exact to rounding (softmax over a union of disjoint key sets) and the same on every
rank: the gathered inputs and the merge kernel are the same, so all ranks get bitwise identical
results.

The exchange is a small internal interface, ``fdpp.exchange._Exchange`` (``all_gather`` of one byte
buffer per rank into ``[W, nbytes]``), with three implementations:

- ``_TorchExchange`` — a ``torch.distributed`` ProcessGroup of the NCCL backend
  (``all_gather_into_tensor`` on torch's current stream), for torch tensors;
- ``_CupyExchange`` — a ``cupy.cuda.nccl.NcclCommunicator`` (``allGather`` on CuPy's current
  stream), for CuPy arrays;
- ``_ThreadedExchange`` — W simulated ranks as threads of one process (:class:`ThreadedGroup`),
  for tests and CPU simulation with NumPy arrays (fdpp's emulator).

One buffer per rank carries both halves of the partial state, so a step costs one collective:
bytes ``[0, B*Hq*D*itemsize)`` hold ``out_r`` in q's dtype (written there by ``decode_attention``
itself), then ``B*Hq`` float32 lse values, padded to 16 bytes. ``out_r`` is exchanged in q's
dtype, not float32: ``decode_attention`` has already rounded it to q's dtype, so sending it in
float32 would carry no more information and double the bytes. Each part then has one rounding to
q's dtype more than a single-GPU call over the whole cache; the merge accumulates in float32, so
the merged output differs from the single-GPU one by about one unit in the last place of q's dtype
(well inside fdpp's tolerances, ``fdpp.dtypes``). The lse is exchanged as float32 bits, unrounded.

Why an all-gather: every rank needs the whole output (it feeds the next layer on every rank), and
W partial states of ``B*Hq`` rows are a few kB each, so one latency-bound all-gather followed by a
local merge is the cheapest exchange; an all-reduce of rescaled partials would first need the
global maximum lse (a second collective).

torch and CuPy are imported only when their arrays are passed; ``import fdpp`` needs neither.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from fdpp.api import _kind, _overlaps, _view, check_flag, decode_attention, paged_decode_attention
from fdpp.exchange import ThreadedGroup, _empty_bytes, _exchange_for
from fdpp.merge import merge_states

__all__ = ["ThreadedGroup", "context_parallel_decode", "shard_bounds", "shard_cache", "sharded_decode_attention"]

_ALIGN = 16  # bytes: merge_states reads device parts with 16-byte vectors


# ---- the rank's partial state in a byte buffer ---------------------------------------------
class _Layout:
    """Where out [B, Hq, D] (q's dtype) and lse [B, Hq] (float32) sit in one rank's byte buffer."""

    def __init__(self, b: int, hq: int, d: int, itemsize: int):
        self.b, self.hq, self.d, self.itemsize = b, hq, d, itemsize
        self.out_bytes = b * hq * d * itemsize
        self.lse_offset = -(-self.out_bytes // _ALIGN) * _ALIGN
        self.nbytes = -(-(self.lse_offset + 4 * b * hq) // _ALIGN) * _ALIGN

    def out_view(self, kind: str, rows: Any, dtype: Any) -> Any:
        """rows [W, nbytes] uint8 -> [W, B, Hq, D] of ``dtype`` (a view)."""
        w = rows.shape[0]
        o = _as_dtype(kind, rows, dtype)[:, : self.out_bytes // self.itemsize]
        return o.reshape(w, self.b, self.hq, self.d)

    def lse_view(self, kind: str, rows: Any) -> Any:
        """rows [W, nbytes] uint8 -> [W, B, Hq] float32 (a view)."""
        w, start = rows.shape[0], self.lse_offset // 4
        return _as_dtype(kind, rows, None)[:, start: start + self.b * self.hq].reshape(w, self.b, self.hq)


def _as_dtype(kind: str, rows: Any, dtype: Any) -> Any:
    """A C-contiguous uint8 array [W, nbytes] reinterpreted as ``dtype`` (None: float32)."""
    if kind == "torch":
        import torch

        return rows.view(torch.float32 if dtype is None else dtype)
    return rows.view(np.float32 if dtype is None else dtype)


def _copy_into(kind: str, dst: Any, src: Any) -> None:
    if kind == "torch":
        dst.copy_(src)
    else:
        dst[...] = src


_RENAME = {"k_cache": "local_k", "v_cache": "local_v", "k_pages": "local_k", "v_pages": "local_v",
           "cache_seqlens": "local_seqlens"}
_RENAME_RE = re.compile(r"\b(" + "|".join(_RENAME) + r")\b")


def _local_partial(q: Any, local_k: Any, local_v: Any, local_seqlens: Any, block_table: Any, row: Any,
                   kind: str, layout: _Layout, opts: dict[str, Any]) -> None:
    """This rank's (out, lse) over its shard, written into ``row`` (uint8 [nbytes]): out by
    decode_attention itself, lse copied. Errors name this module's arguments (local_k, ...)."""
    rows = row.reshape(1, layout.nbytes)
    out_slot = layout.out_view(kind, rows, q.dtype)[0]
    try:
        if block_table is None:
            _, lse = decode_attention(q, local_k, local_v, cache_seqlens=local_seqlens, return_lse=True,
                                      out=out_slot, **opts)
        else:
            if local_seqlens is None:
                raise TypeError("local_seqlens must be an int32 array [batch] when block_table is given "
                                "(paged shards), got None")
            _, lse = paged_decode_attention(q, local_k, local_v, block_table, local_seqlens, return_lse=True,
                                            out=out_slot, **opts)
    except (TypeError, ValueError) as e:
        msg = _RENAME_RE.sub(lambda m: _RENAME[m.group(1)], str(e))
        if msg == str(e):
            raise
        raise type(e)(msg) from None
    _copy_into(kind, layout.lse_view(kind, rows)[0], lse)


def _merge_rows(kind: str, rows: Any, layout: _Layout, dtype: Any, out: Any, return_lse: bool) -> Any:
    """rows [W, nbytes]: every rank's partial state -> the merged out (and lse)."""
    outs, lses = layout.out_view(kind, rows, dtype), layout.lse_view(kind, rows)
    o, lse = merge_states(outs, lses, out=out)
    return (o, lse) if return_lse else o


def _check_q(q: Any) -> tuple[str, _Layout]:
    kind = _kind(q)
    if kind == "other":
        raise TypeError(f"q must be a NumPy array, CuPy array or torch tensor, got {type(q).__name__}")
    shape = tuple(q.shape)
    if len(shape) != 3:
        raise ValueError(f"q must have shape [batch, num_q_heads, head_dim], got {shape}")
    itemsize = q.element_size() if kind == "torch" else q.itemsize
    return kind, _Layout(*shape, itemsize)


def _check_out(kind: str, out: Any, q: Any, local_k: Any, local_v: Any) -> None:
    """out's array type, and no overlap with the cache (merge_states checks shape and dtype)."""
    if out is None:
        return
    if _kind(out) != kind:
        raise TypeError(f"out must be the same array type as q ({kind}), got "
                        f"{type(out).__module__}.{type(out).__name__}")
    ov = _view(out, kind)
    for name, x in (("q", q), ("local_k", local_k), ("local_v", local_v)):
        if _kind(x) == kind and _overlaps(ov, _view(x, kind)):
            raise ValueError(f"out must not overlap {name}")


def _opts(softmax_scale: Any, kv_layout: Any, num_splits: Any, batch_invariant: Any, kv_dtype: Any = None,
          k_descale: Any = None, v_descale: Any = None) -> dict[str, Any]:
    return dict(softmax_scale=softmax_scale, kv_layout=kv_layout, num_splits=num_splits,
                batch_invariant=batch_invariant, kv_dtype=kv_dtype, k_descale=k_descale, v_descale=v_descale)


# ---- public API -----------------------------------------------------------------------------
def context_parallel_decode(q: Any, local_k: Any, local_v: Any, local_seqlens: Any = None, *, group: Any,
                            softmax_scale: float | None = None, kv_layout: str = "NHD",
                            num_splits: int | None = None, return_lse: bool = False, out: Any = None,
                            block_table: Any = None, batch_invariant: bool = False, kv_dtype: str | None = None,
                            k_descale: Any = None, v_descale: Any = None) -> Any:
    """Decode attention over a KV cache sharded along the sequence across the ranks of ``group``.

    Every rank calls this with the same ``q`` and its own shard; every rank returns the attention
    of ``q`` over the union of all shards.

    Parameters
    ----------
    q : array [B, Hq, D]
        fp16, bf16 or fp32. torch CUDA tensor (with a torch group), CuPy array (with a CuPy NCCL
        communicator) or NumPy array (with a :class:`ThreadedGroup` rank). **Must be identical on
        every rank** (values, shape, dtype): this is not checked (it would cost a collective);
        different shapes or dtypes make the ranks' buffers differ in size, which NCCL does not
        detect (a hang or garbage).
    local_k, local_v : array
        This rank's shard, q's dtype and array type, on q's device. Contiguous shards (no
        ``block_table``): [B, N_local, Hkv, D] for ``kv_layout="NHD"`` or [B, Hkv, N_local, D] for
        ``"HND"``, as ``k_cache``/``v_cache`` of :func:`fdpp.decode_attention`. Paged shards
        (``block_table`` given): this rank's page pools [num_pages, page_size, Hkv, D] ("NHD") or
        [num_pages, Hkv, page_size, D] ("HND"), as ``k_pages``/``v_pages`` of
        :func:`fdpp.paged_decode_attention`. The shards of the ranks must be disjoint sets of
        each request's tokens and together its whole cache; which tokens a rank holds and in which
        order does not matter (attention is invariant to the order of the keys), and N_local may
        differ between ranks or be 0.
    local_seqlens : int32 array [B], optional
        Valid tokens of each request in this rank's shard (0 allowed: that rank contributes
        nothing to that request). Contiguous shards: ``None`` means N_local for all. Required
        with ``block_table``.
    group : communicator (keyword)
        ``torch.distributed.ProcessGroup`` of the NCCL backend (e.g. ``torch.distributed.group.WORLD``)
        for torch tensors; ``cupy.cuda.nccl.NcclCommunicator`` on q's device for CuPy arrays;
        ``ThreadedGroup(W).rank(r)`` for NumPy arrays (simulation in threads).
    softmax_scale, kv_layout, num_splits, batch_invariant, kv_dtype, k_descale, v_descale
        As in :func:`fdpp.decode_attention`, applied to this rank's shard (``num_splits``: the
        splits of the local shard; FP8 shards: ``kv_dtype`` and this shard's descales).
    return_lse : bool
        Also return the lse over the whole cache (natural log).
    out : array [B, Hq, D], optional
        q's dtype and array type, C-contiguous (device: 16-byte aligned); written and returned.
    block_table : int32 array [B, max_pages_per_seq], optional
        This rank's block table into its own page pools: paged shards.

    Returns
    -------
    out : array [B, Hq, D], q's dtype and array type
        Attention over the whole (all ranks') cache; bitwise the same on every rank. Zeros for a
        request whose length is 0 on every rank.
    lse : float32 array [B, Hq] (only with ``return_lse=True``)
        -inf for a request whose length is 0 on every rank.

    Raises
    ------
    TypeError, ValueError
        Bad arguments, naming the argument (``group``, ``local_k``, ``local_seqlens``, ...).
        Checks of the shard run before the exchange: an error raised on some ranks only leaves the
        others waiting in the collective (NCCL's timeout applies), as with any collective.

    Notes
    -----
    One step is the local split-KV decode (``return_lse=True``) writing straight into a send
    buffer, one all-gather of every rank's (out, lse) — ``B*Hq*(D*itemsize + 4)`` bytes per rank,
    16-byte padded, out in q's dtype and lse in float32 (see the module docstring for why not out
    in float32) — and one :func:`fdpp.merge_states` launch over the W parts in rank order.

    Streams: torch runs everything on torch's current stream (``all_gather_into_tensor``
    synchronous mode: the NCCL stream is ordered with the current stream, the host does not
    wait); CuPy on CuPy's current stream. No host synchronisation or device-to-host copy, so the
    call can be captured in a CUDA graph: with ``torch.cuda.graph`` (NCCL >= 2.9.6; make one eager
    call first, which also creates the NCCL communicator, synchronise, and replay the graph on
    every rank in the same order as the other ranks' collectives; should ProcessGroupNCCL's
    watchdog thread break a capture in torch's default "global" mode, capture with
    ``capture_error_mode="thread_local"``); with CuPy stream capture, make one eager
    call on the capture stream's device first and pass ``out``: the send and receive buffers are
    kept per (device, stream, shape) for CuPy (so a graph's pointers stay valid; hence no two host
    threads should call on one stream at once), while the local lse and, with ``return_lse``, the
    merged lse are temporaries from CuPy's pool, as in :func:`fdpp.decode_attention`.

    The exchange is small — 16 kB per rank for B = 1, 64 query heads, D = 128, fp16 — so it is
    latency-bound; NVLink multicast (NVLS) brings nothing here: run with ``NCCL_NVLS_ENABLE=0``.
    """
    check_flag("return_lse", return_lse)
    kind, layout = _check_q(q)
    ex = _exchange_for(group, kind, q)
    _check_out(kind, out, q, local_k, local_v)
    send = ex.send_buffer(kind, q, layout.nbytes)
    _local_partial(q, local_k, local_v, local_seqlens, block_table, send, kind, layout,
                   _opts(softmax_scale, kv_layout, num_splits, batch_invariant, kv_dtype, k_descale, v_descale))
    rows = ex.all_gather(send)
    return _merge_rows(kind, rows, layout, q.dtype, out, return_lse)


def sharded_decode_attention(q: Any, k_shards: Sequence[Any], v_shards: Sequence[Any],
                             seqlens_shards: Sequence[Any] | None = None, *,
                             block_tables: Sequence[Any] | None = None, softmax_scale: float | None = None,
                             kv_layout: str = "NHD", num_splits: int | None = None, return_lse: bool = False,
                             out: Any = None, batch_invariant: bool = False) -> Any:
    """What :func:`context_parallel_decode` computes over W ranks, on one device and without NCCL:
    every shard's partial state in turn into row s of a ``[W, nbytes]`` buffer (the all-gather's
    result), then the same merge.

    For testing the sharded computation on one GPU, and for a cache sharded on one device.

    Parameters
    ----------
    q : array [B, Hq, D]
        fp16, bf16 or fp32; NumPy, CuPy or torch (CUDA).
    k_shards, v_shards : sequences of W arrays
        Shard s as ``local_k`` / ``local_v`` of :func:`context_parallel_decode` (contiguous
        [B, N_s, Hkv, D] / [B, Hkv, N_s, D], or page pools with ``block_tables``). W >= 1.
    seqlens_shards : sequence of W int32 arrays [B] (entries may be None for contiguous shards), optional
        ``local_seqlens`` of each shard. Required with ``block_tables``.
    block_tables : sequence of W int32 arrays [B, max_pages_s], optional
        Paged shards: shard s's block table into its pools.
    softmax_scale, kv_layout, num_splits, return_lse, out, batch_invariant
        As in :func:`context_parallel_decode`.

    Returns
    -------
    out : array [B, Hq, D] (and lse float32 [B, Hq] with ``return_lse=True``)
        Bitwise what every rank of :func:`context_parallel_decode` returns for the same shards.
    """
    check_flag("return_lse", return_lse)
    kind, layout = _check_q(q)
    w = _count("k_shards", k_shards)
    if _count("v_shards", v_shards) != w:
        raise ValueError(f"v_shards must hold one shard per k_shards entry ({w}), got {len(v_shards)}")
    lens = [None] * w if seqlens_shards is None else list(seqlens_shards)
    tables = [None] * w if block_tables is None else list(block_tables)
    for name, seq in (("seqlens_shards", lens), ("block_tables", tables)):
        if len(seq) != w:
            raise ValueError(f"{name} must hold one entry per shard ({w}), got {len(seq)}")
    for s in range(w):
        _check_out(kind, out, q, k_shards[s], v_shards[s])
    rows = _empty_bytes(kind, q, (w, layout.nbytes))
    opts = _opts(softmax_scale, kv_layout, num_splits, batch_invariant)
    for s in range(w):
        try:
            _local_partial(q, k_shards[s], v_shards[s], lens[s], tables[s], rows[s], kind, layout, opts)
        except (TypeError, ValueError) as e:
            msg = str(e)
            for local, name in (("local_k", "k_shards"), ("local_v", "v_shards"), ("local_seqlens", "seqlens_shards")):
                msg = re.sub(rf"\b{local}\b", f"{name}[{s}]", msg)
            raise type(e)(msg) from None
    return _merge_rows(kind, rows, layout, q.dtype, out, return_lse)


def _count(name: str, seq: Any) -> int:
    if not isinstance(seq, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of arrays (one per shard), got {type(seq).__name__}")
    if not seq:
        raise ValueError(f"{name} must hold at least one shard, got an empty sequence")
    return len(seq)


def shard_bounds(n_max: int, world_size: int) -> list[tuple[int, int]]:
    """Balanced contiguous shards of positions [0, n_max): rank r holds [start_r, stop_r).

    Parameters
    ----------
    n_max : int
        Positions of the cache (N_max), >= 0.
    world_size : int
        Number of shards, >= 1.

    Returns
    -------
    list of W (start, stop) pairs, in order, covering [0, n_max); the first ``n_max % W`` shards
    hold one position more; shards are empty when W > n_max.
    """
    for name, x, lo in (("n_max", n_max, 0), ("world_size", world_size, 1)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {x!r}")
    base, extra = divmod(int(n_max), int(world_size))
    bounds, start = [], 0
    for r in range(int(world_size)):
        stop = start + base + (r < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def shard_cache(k_cache: Any, v_cache: Any, cache_seqlens: Any, bounds: Sequence[tuple[int, int]], *,
                kv_layout: str = "NHD") -> list[tuple[Any, Any, Any]]:
    """Cut a contiguous cache along the sequence into shards (views, no copy).

    Parameters
    ----------
    k_cache, v_cache : array [B, N_max, Hkv, D] ("NHD") or [B, Hkv, N_max, D] ("HND")
        NumPy, CuPy or torch.
    cache_seqlens : int array [B] or None
        Valid length of each request (None: N_max for all).
    bounds : sequence of (start, stop)
        Disjoint position ranges in [0, N_max], increasing (e.g. :func:`shard_bounds`).
    kv_layout : {"NHD", "HND"}

    Returns
    -------
    list of (k_shard, v_shard, local_seqlens) per range: views of positions [start, stop) along
    the sequence axis, and int32 lengths ``clip(len - start, 0, stop - start)`` (of the array type
    of ``cache_seqlens``; None when it is None).
    """
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    if len(k_cache.shape) != 4:
        raise ValueError(f"k_cache must have 4 dimensions, got shape {tuple(k_cache.shape)}")
    axis = 1 if kv_layout == "NHD" else 2
    n_max, prev = k_cache.shape[axis], 0
    for i, (a, b) in enumerate(bounds):
        if not prev <= a <= b <= n_max:
            raise ValueError(f"bounds[{i}] = ({a}, {b}) must satisfy {prev} <= start <= stop <= {n_max} "
                             "(disjoint, increasing, inside the cache)")
        prev = b
    shards = []
    for a, b in bounds:
        sl = (slice(None), slice(a, b)) if axis == 1 else (slice(None), slice(None), slice(a, b))
        shards.append((k_cache[sl], v_cache[sl], _local_lengths(cache_seqlens, a, b)))
    return shards


def _local_lengths(lens: Any, start: int, stop: int) -> Any:
    if lens is None:
        return None
    if _kind(lens) == "torch":
        import torch

        return (lens.to(torch.int64) - start).clamp(0, stop - start).to(torch.int32)
    return (lens.astype(np.int64) - start).clip(0, stop - start).astype(np.int32)
