"""Scratch memory every op shares, one set per (device, stream): float32 partials and zeroed tickets.

- :func:`partials`: the split partials of attention calls and the stream-K partials of flat GEMM.
  One float32 array per (device, stream handle), grown when a call needs more. Kernels on one
  stream run in order (with programmatic dependent launch too: a kernel touches its scratch only
  after ``griddepcontrol.wait``, i.e. after the kernel before it has completed), so the next call
  overwrites the partials only after this call has read them.
- :func:`tickets`: uint32 counters for the last-CTA-merges schemes (attention's fused merge,
  GEMM's stream-K fix-up). Zeroed once, when made (on the stream: inside a graph capture the
  zeroing is captured too); every kernel leaves the tickets it used at zero. A graph replayed on
  another stream while fdpp runs on its capture stream would share them: replay graphs on the
  stream they were captured on, or serialise.
- Both are CuPy memory, for torch calls too: outside torch's caching allocator, so a torch CUDA
  graph (``torch.compile(mode="reduce-overhead")``) does not see a live tensor it did not make.
  A stream's first call inside a torch graph capture takes temporaries from torch instead (its
  capture-aware allocator; tickets zeroed by a captured memset) and registers nothing here.
- Outgrown buffers are kept (``_retired``): a captured graph may still point at them.
  :func:`scoped` frees the partials a block created (tools that capture on throwaway streams).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

PARTIALS_MIN = 1 << 16  # floats: small calls share one allocation per stream
TICKETS_MIN = 1 << 12

_partials: dict[tuple[int, int], Any] = {}  # (device, stream) -> float32 CuPy array
_tickets: dict[tuple[int, int], tuple[Any, int]] = {}  # (device, stream) -> (zeroed memory, count)
_retired: list[Any] = []  # outgrown partials
_tickets_retired: list[Any] = []  # outgrown tickets (never freed: records remember their address)


def partials(device: int, stream_ptr: int, n_floats: int) -> Any:
    """A float32 CuPy array of at least ``n_floats`` for the calls on (``device``, ``stream_ptr``)."""
    key = (device, stream_ptr)
    ws = _partials.get(key)
    if ws is None or ws.size < n_floats:
        import cupy

        if ws is not None:
            _retired.append(ws)
        with _on_device(cupy, device):
            ws = cupy.empty(max(n_floats, PARTIALS_MIN), dtype=np.float32)
        _partials[key] = ws
    return ws


def tickets(device: int, stream: Any, n: int) -> int:
    """Address of at least ``n`` zeroed uint32 tickets for the calls on (``device``, ``stream``)."""
    key = (device, stream.ptr)
    cur = _tickets.get(key)
    if cur is None or cur[1] < n:
        import cupy

        if cur is not None:
            _tickets_retired.append(cur)
        size = max(n, TICKETS_MIN)
        with _on_device(cupy, device):
            mem = cupy.cuda.alloc(4 * size)
            cupy.cuda.runtime.memsetAsync(mem.ptr, 0, 4 * size, stream.ptr)
        cur = _tickets[key] = (mem, size)
    return cur[0].ptr


def has_tickets(device: int, stream_ptr: int) -> bool:
    return (device, stream_ptr) in _tickets


@contextmanager
def scoped() -> Iterator[None]:
    """Drop the partials created inside the block when it exits (for tools that capture graphs on
    throwaway streams and drop the graphs before the block ends; otherwise every new stream would
    keep its partials alive). A flat GEMM launch record keeps the partials of the streams it ran on
    alive until the record goes. Tickets (16 KiB a stream) are kept: launch records remember their
    address per stream handle, and a later stream may get a freed stream's handle."""
    before, n_retired = set(_partials), len(_retired)
    try:
        yield
    finally:
        for key in set(_partials) - before:
            del _partials[key]
        del _retired[n_retired:]


class _on_device:
    """``cupy.cuda.Device(dev)`` only when ``dev`` is not already current (a Device per call costs)."""

    __slots__ = ("cupy", "dev", "ctx")

    def __init__(self, cupy: Any, dev: int):
        self.cupy, self.dev, self.ctx = cupy, dev, None

    def __enter__(self) -> None:
        if self.cupy.cuda.runtime.getDevice() != self.dev:
            self.ctx = self.cupy.cuda.Device(self.dev)
            self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
