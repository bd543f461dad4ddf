"""Context-parallel decode: a KV cache sharded along the sequence across GPUs (one process per GPU).

Every rank holds a disjoint part of each request's keys and values (any part: contiguous blocks,
round-robin tokens, uneven or empty) and the same query ``q``. A step is::

    local  : (out_r, lse_r) = fdpp.decode_attention(q, local_k, local_v, return_lse=True)
    gather : every rank receives (out_s, lse_s) of all W ranks      (one NCCL all-gather)
    merge  : out = fdpp.merge_states(outs, lses)                    (ranks in order 0..W-1)

The merge is exact to rounding (softmax over a union of disjoint key sets) and the same on every
rank: the gathered inputs and the merge kernel are the same, so all ranks get bitwise identical
results.

The exchange is a small internal interface, :class:`_Exchange` (``all_gather`` of one byte buffer
per rank into ``[W, nbytes]``), with three implementations:

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

import contextlib
import re
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fdpp.api import _kind, _overlaps, _view, decode_attention, paged_decode_attention, scoped_workspaces
from fdpp.merge import merge_states

_ALIGN = 16  # bytes: merge_states reads device parts with 16-byte vectors


# ---- the exchange ---------------------------------------------------------------------------
class _Exchange:
    """All-gather of one 1-D uint8 buffer per rank; the ranks' buffers have one size.

    ``all_gather(send)`` returns ``[world_size, send.size]`` uint8 (the array type of ``send``),
    row r holding rank r's buffer, ordered after the work already queued on the caller's current
    stream (device arrays) and before the work queued after it."""

    world_size: int
    rank: int

    def send_buffer(self, kind: str, like: Any, nbytes: int) -> Any:
        """A uint8 buffer [nbytes] on ``like``'s device for this rank's part (a new one per call)."""
        return _empty_bytes(kind, like, (nbytes,))

    def all_gather(self, send: Any) -> Any:  # pragma: no cover - the interface
        raise NotImplementedError


class _TorchExchange(_Exchange):
    """``torch.distributed.all_gather_into_tensor`` over a ProcessGroup (any backend here; the
    public entry point requires NCCL for CUDA tensors)."""

    def __init__(self, group: Any):
        self.group = group
        self.world_size = group.size()
        self.rank = group.rank()

    def all_gather(self, send: Any) -> Any:
        import torch
        import torch.distributed as dist

        recv = torch.empty(self.world_size * send.numel(), dtype=send.dtype, device=send.device)
        _all_gather_single(dist)(recv, send, group=self.group)
        return recv.view(self.world_size, send.numel())


def _all_gather_single(dist: Any) -> Any:
    """``all_gather_into_tensor`` (torch >= 1.13), under its newer name ``all_gather_single`` where
    torch has it (same arguments; the old name warns there)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _CupyExchange(_Exchange):
    """``ncclAllGather`` through ``cupy.cuda.nccl.NcclCommunicator`` on CuPy's current stream."""

    def __init__(self, comm: Any):
        self.comm = comm
        self.world_size = comm.size()
        self.rank = comm.rank_id()
        self.device = comm.device_id()

    def send_buffer(self, kind: str, like: Any, nbytes: int) -> Any:
        return _cupy_scratch(self.device, (nbytes,))

    def all_gather(self, send: Any) -> Any:
        import cupy
        from cupy.cuda import nccl

        with cupy.cuda.Device(self.device):
            recv = _cupy_scratch(self.device, (self.world_size, send.size))
            stream = cupy.cuda.get_current_stream()
            self.comm.allGather(send.data.ptr, recv.data.ptr, send.size, nccl.NCCL_UINT8, stream.ptr)
        return recv


_scratch: dict[tuple[int, int, tuple[int, ...]], Any] = {}


def _cupy_scratch(dev: int, shape: tuple[int, ...]) -> Any:
    """A uint8 CuPy buffer kept per (device, current stream, shape) and reused by every call there.

    Kept alive, so a CuPy graph that captured a call keeps valid pointers (a temporary would go
    back to CuPy's pool after the capture and be handed out again while the graph still writes
    it); reuse is safe because the calls on one stream run in order (the next call writes the
    send buffer only after this call's all-gather read it, and the receive buffer only after this
    call's merge read it). A few kB to a few MB per problem shape. Like fdpp's own per-stream
    workspaces, not for several host threads enqueueing on one stream at once."""
    import cupy

    key = (dev, cupy.cuda.get_current_stream(dev).ptr, shape)
    buf = _scratch.get(key)
    if buf is None:
        with cupy.cuda.Device(dev):
            buf = _scratch[key] = cupy.empty(shape, dtype=np.uint8)
    return buf


class ThreadedGroup:
    """W simulated ranks as threads of one process: the exchange of :func:`context_parallel_decode`
    without a network, for tests and CPU simulation.

    Parameters
    ----------
    world_size : int
        Number of ranks, >= 1.
    timeout : float
        Seconds a rank waits for the others in an all-gather before ``threading.BrokenBarrierError``.

    Notes
    -----
    ``group.rank(r)`` is rank r's communicator (pass it as ``group=``); :meth:`run` calls a
    function once per rank, each in its own thread. The all-gather stacks the ranks' buffers with
    the array type's own ``stack`` (NumPy, CuPy or torch). It is meant for NumPy arrays (fdpp's
    emulator when there is no GPU, else fdpp's GPU path for NumPy inputs); device arrays must all
    be on one device. With a GPU present, every rank thread of :meth:`run` calls ``fn`` on a CuPy
    stream and a torch stream of its own (as separate GPUs would: fdpp keeps its split partials
    per stream, and two ranks interleaving launches on one stream would mix them), and a device
    all-gather synchronises the rank's stream before handing its buffer over and after reading
    the others'. One exchange at a time per group.
    """

    def __init__(self, world_size: int, timeout: float = 60.0):
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        self.world_size = int(world_size)
        self._barrier = threading.Barrier(self.world_size, timeout=timeout)
        self._slots: list[Any] = [None] * self.world_size

    def rank(self, r: int) -> _ThreadedExchange:
        """Rank ``r``'s communicator.

        Parameters
        ----------
        r : int
            0 <= r < world_size.

        Returns
        -------
        The object to pass as ``group=`` on rank r's thread (``.rank`` and ``.world_size`` tell
        which it is).
        """
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= r < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {r!r}")
        return _ThreadedExchange(self, int(r))

    def run(self, fn: Callable[[_ThreadedExchange], Any]) -> list[Any]:
        """Call ``fn(self.rank(r))`` for every rank r, each in its own thread.

        Parameters
        ----------
        fn : callable
            Takes rank r's communicator (:meth:`rank`); typically calls
            :func:`context_parallel_decode` with ``group=`` it and rank r's shard.

        Returns
        -------
        list
            ``fn``'s results in rank order.

        Raises
        ------
        The first exception of any rank (a rank's own error before another rank's
        ``BrokenBarrierError``), after every thread stopped: the barrier is broken when a rank
        fails, so no rank waits for a failed one. The group is reusable afterwards.
        """
        results: list[Any] = [None] * self.world_size
        errors: list[tuple[int, BaseException]] = []

        def body(r: int) -> None:
            try:
                with contextlib.ExitStack() as streams:
                    synced = _own_streams(streams)
                    results[r] = fn(self.rank(r))
                    for sync in synced:  # the results are complete when run returns
                        sync()
            except BaseException as e:  # noqa: BLE001 - re-raised below on the calling thread
                errors.append((r, e))
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"fdpp-rank{r}") for r in range(self.world_size)]
        with scoped_workspaces():  # the rank streams' fdpp workspaces go with the streams
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        self._barrier.reset()
        if errors:
            # the root cause first: a rank's own error rather than another rank's broken barrier
            errors.sort(key=lambda re_: isinstance(re_[1], threading.BrokenBarrierError))
            raise errors[0][1]
        return results


def _own_streams(stack: contextlib.ExitStack) -> list[Callable[[], None]]:
    """With a GPU: enter a new CuPy stream and, where torch is loaded with CUDA, a new torch stream
    on this thread; return their synchronise calls."""
    from fdpp.api import gpu_available

    syncs = []
    if gpu_available():
        import cupy

        # a blocking stream: ordered after the legacy default stream, where the inputs were made
        syncs.append(stack.enter_context(cupy.cuda.Stream(non_blocking=False)).synchronize)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        ts = torch.cuda.Stream()
        ts.wait_stream(torch.cuda.current_stream())
        stack.enter_context(torch.cuda.stream(ts))
        syncs.append(ts.synchronize)
    return syncs


def _sync_current(kind: str) -> None:
    if kind == "torch":
        import torch

        torch.cuda.current_stream().synchronize()
    elif kind == "cupy":
        import cupy

        cupy.cuda.get_current_stream().synchronize()


class _ThreadedExchange(_Exchange):
    def __init__(self, group: ThreadedGroup, rank: int):
        self.group = group
        self.world_size = group.world_size
        self.rank = rank

    def all_gather(self, send: Any) -> Any:
        g, kind = self.group, _kind(send)
        _sync_current(kind)  # this rank's buffer is written before another thread reads it
        g._slots[self.rank] = send
        g._barrier.wait()  # every rank has deposited
        parts = list(g._slots)
        sizes = {int(_numel(p)) for p in parts}
        if len(sizes) > 1:
            raise ValueError(f"ranks sent buffers of different sizes {sorted(sizes)} (q, its batch, "
                             "heads, head_dim and dtype must be the same on every rank)")
        recv = _stack(kind, parts)
        _sync_current(kind)  # the others' buffers are read before their owners free them
        g._barrier.wait()  # every rank has read the slots: the next exchange may overwrite them
        return recv


def _numel(x: Any) -> int:
    return x.numel() if _kind(x) == "torch" else x.size


def _stack(kind: str, parts: list[Any]) -> Any:
    if kind == "torch":
        import torch

        return torch.stack(parts)
    if kind == "cupy":
        import cupy

        return cupy.stack(parts)
    return np.stack(parts)


def _exchange_for(group: Any, kind: str, q: Any) -> _Exchange:
    """The exchange of ``group`` for arrays of ``kind``; TypeError/ValueError naming ``group``."""
    if isinstance(group, ThreadedGroup):
        raise TypeError("group must be one rank's communicator: pass group.rank(r) of the ThreadedGroup, "
                        "not the ThreadedGroup itself")
    if isinstance(group, _Exchange):
        return group
    mod = type(group).__module__.split(".")[0]
    got = f"{type(group).__module__}.{type(group).__name__}"
    if kind == "torch":
        import torch.distributed as dist

        if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
            raise TypeError("group must be a torch.distributed ProcessGroup (NCCL backend) for torch tensors, "
                            f"e.g. torch.distributed.group.WORLD, got {got}")
        backend = str(dist.get_backend(group))
        if "nccl" not in backend:
            raise ValueError(f"group must use the NCCL backend for CUDA tensors, got backend {backend!r}")
        return _TorchExchange(group)
    if kind == "cupy":
        try:
            from cupy.cuda import nccl

            comm_type = nccl.NcclCommunicator
        except (ImportError, AttributeError):  # CuPy built without NCCL, or no NCCL library found
            comm_type = None
        if comm_type is None or not isinstance(group, comm_type):
            why = "" if comm_type is not None else " (and this CuPy finds no NCCL: cupy.cuda.nccl unavailable)"
            raise TypeError(f"group must be a cupy.cuda.nccl.NcclCommunicator for CuPy arrays{why}, got {got}")
        ex = _CupyExchange(group)
        if ex.device != q.device.id:
            raise ValueError(f"group's NCCL communicator is on device {ex.device}, q is on device {q.device.id}")
        return ex
    hint = " (a torch/CuPy communicator needs torch tensors/CuPy arrays)" if mod in ("torch", "cupy") else ""
    raise TypeError("group must be a ThreadedGroup rank (fdpp.distributed.ThreadedGroup(W).rank(r)) for NumPy "
                    f"arrays{hint}, got {got}")


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


def _empty_bytes(kind: str, like: Any, shape: tuple[int, ...]) -> Any:
    if kind == "torch":
        import torch

        return torch.empty(shape, dtype=torch.uint8, device=like.device)
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.empty(shape, dtype=np.uint8)
    return np.empty(shape, dtype=np.uint8)


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


def _opts(softmax_scale: Any, kv_layout: Any, num_splits: Any, batch_invariant: Any) -> dict[str, Any]:
    return dict(softmax_scale=softmax_scale, kv_layout=kv_layout, num_splits=num_splits,
                batch_invariant=batch_invariant)


# ---- public API -----------------------------------------------------------------------------
def context_parallel_decode(q: Any, local_k: Any, local_v: Any, local_seqlens: Any = None, *, group: Any,
                            softmax_scale: float | None = None, kv_layout: str = "NHD",
                            num_splits: int | None = None, return_lse: bool = False, out: Any = None,
                            block_table: Any = None, batch_invariant: bool = False) -> Any:
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
    softmax_scale, kv_layout, num_splits, batch_invariant
        As in :func:`fdpp.decode_attention`, applied to this rank's shard (``num_splits``: the
        splits of the local shard).
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
    kind, layout = _check_q(q)
    ex = _exchange_for(group, kind, q)
    _check_out(kind, out, q, local_k, local_v)
    send = ex.send_buffer(kind, q, layout.nbytes)
    _local_partial(q, local_k, local_v, local_seqlens, block_table, send, kind, layout,
                   _opts(softmax_scale, kv_layout, num_splits, batch_invariant))
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
