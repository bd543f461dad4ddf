"""The exchange of fdpp.distributed: an all-gather of one byte buffer per rank.

:class:`_Exchange` is the interface (``send_buffer``, ``all_gather``), with three implementations:
``_TorchExchange`` (a ``torch.distributed`` ProcessGroup), ``_CupyExchange`` (a
``cupy.cuda.nccl.NcclCommunicator``) and ``_ThreadedExchange`` (ranks of a :class:`ThreadedGroup`:
threads of one process, for tests and CPU simulation). :func:`_exchange_for` picks one for a
``group`` argument and an array type. torch and CuPy are imported only when used.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from fdpp.api import _kind
from fdpp.workspace import scoped as scoped_workspaces


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


def _empty_bytes(kind: str, like: Any, shape: tuple[int, ...]) -> Any:
    if kind == "torch":
        import torch

        return torch.empty(shape, dtype=torch.uint8, device=like.device)
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.empty(shape, dtype=np.uint8)
    return np.empty(shape, dtype=np.uint8)
