"""GPU test helpers shared by tests/test_gpu_fp8.py and tests/test_gpu_int4.py. Importable without a
GPU or CuPy: CuPy is imported when a helper runs."""

import numpy as np

from fdpp.dtypes import DTYPES


def _cp():
    import cupy

    return cupy


def poisoned(b, hq, d, dt):
    """A [b, hq, d] output buffer of dtype ``dt`` filled with NaN (a row a kernel skips stays NaN)."""
    return _cp().full((b, hq, d), np.nan, dtype=np.float32).astype(DTYPES[dt].np_dtype)


def assert_graph_replay_matches(run, out, replays):
    """Capture ``run()`` (one decode writing the 16-bit ``out``, already run once eagerly) in a CUDA
    graph on a non-blocking stream that waits for the work queued before (the inputs), replay it
    ``replays`` times with ``out`` poisoned (NaN) before each, and check that ``out`` ends bit for
    bit what the eager run left there."""
    cp = _cp()
    first = out.copy()
    stream = cp.cuda.Stream(non_blocking=True)
    stream.wait_event(cp.cuda.get_current_stream().record())  # the work queued before (inputs) first
    with stream:
        stream.begin_capture()
        run()
        graph = stream.end_capture()
        for _ in range(replays):
            out[...] = np.nan
            graph.launch(stream)
        stream.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(out.view(cp.uint16)), cp.asnumpy(first.view(cp.uint16)))
