"""The host path on the GPU: launch records (eager-call cache), plan/run, the driver launcher and
the PyTorch custom ops under torch.compile."""

import threading

import numpy as np
import pytest

import fdpp
from fdpp import launch, plan
from fdpp.reference import assert_close, attention_reference

pytestmark = pytest.mark.gpu


def _cp():
    import cupy

    return cupy


def _inputs(b=2, hq=32, hkv=8, d=128, n=1000, dt=np.float16):
    cp = _cp()
    q = cp.random.standard_normal((b, hq, d), dtype=cp.float32).astype(dt)
    k = cp.random.standard_normal((b, n, hkv, d), dtype=cp.float32).astype(dt)
    v = cp.random.standard_normal((b, n, hkv, d), dtype=cp.float32).astype(dt)
    return q, k, v


def test_repeat_calls_reuse_the_record_and_stay_exact():
    cp = _cp()
    plan.clear()
    q, k, v = _inputs()
    first = fdpp.decode_attention(q, k, v)
    n = len(plan._records)
    assert n == 1
    for _ in range(3):
        q2, k2, v2 = _inputs()  # same signature, new pointers and values
        o = fdpp.decode_attention(q2, k2, v2)
        ref, _ = attention_reference(q2, k2, v2)
        assert_close(cp.asnumpy(o), cp.asnumpy(ref), "fp16")
    assert len(plan._records) == n
    assert cp.array_equal(fdpp.decode_attention(q, k, v), first)


def test_record_hit_still_checks_pointers():
    cp = _cp()
    q, k, v = _inputs()
    fdpp.decode_attention(q, k, v)
    buf = cp.zeros(k.size + 8, dtype=cp.float16)
    mis = buf[1:1 + k.size].reshape(k.shape)  # same shape/strides/dtype, pointer off by 2 bytes
    with pytest.raises(ValueError, match="16-byte"):
        fdpp.decode_attention(q, mis, v)
    out = cp.empty(q.shape, q.dtype)
    fdpp.decode_attention(q, k, v, out=out)
    alias = k.reshape(-1)[:q.size].reshape(q.shape)
    with pytest.raises(ValueError, match="out must not overlap k_cache"):
        fdpp.decode_attention(q, k, v, out=alias)


def test_decode_plan_contiguous_and_paged():
    cp = _cp()
    q, k, v = _inputs(n=2048)
    p = fdpp.DecodePlan(2, 32, 8, 128, 2048, dtype="fp16", return_lse=True)
    o, lse = p.run(q, k, v)
    o2, lse2 = fdpp.decode_attention(q, k, v, return_lse=True)
    assert cp.array_equal(o, o2) and cp.array_equal(lse, lse2)
    with pytest.raises(ValueError, match="do not match the plan"):
        p.run(q, k[:, :1024], v[:, :1024])
    pages = cp.random.standard_normal((300, 16, 8, 128), dtype=cp.float32).astype(cp.float16)
    table = cp.asarray(np.random.default_rng(0).permutation(300)[:256].reshape(2, 128).astype(np.int32))
    lens = cp.asarray([2048, 77], cp.int32)
    pp = fdpp.DecodePlan(2, 32, 8, 128, 2048, dtype="fp16", page_size=16)
    assert cp.array_equal(pp.run(q, pages, pages, table, lens),
                          fdpp.paged_decode_attention(q, pages, pages, table, lens))
    with pytest.raises(TypeError, match="paged DecodePlan"):
        pp.run(q, k, v)


def _threaded(fn, threads):
    """Run fn(i) on ``threads`` threads started together; re-raise the first error."""
    barrier, errors = threading.Barrier(threads), []

    def body(i):
        try:
            barrier.wait()
            fn(i)
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(e)

    ts = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_threads_sharing_a_record_each_get_their_own_result(lib):
    """Four threads call with one signature (one launch record and its one argument struct), each
    on a stream of its own with inputs of its own, 100 times: every result is bitwise the one its
    inputs give alone. A two-launch plan: its combine launches after the split's launch has
    released the GIL, which without the record's lock let another thread's pointers in (seen once
    as a wrong context-parallel result, test_gpu_distributed.py, run Z5)."""
    from fdpp import dispatch
    from fdpp.configs import CombineConfig, DecodeProblem, LaunchPlan, default_kernel

    cp, threads, reps = _cp(), 4, 100
    prob = DecodeProblem(1, 32, 8, 128, 3000, "fp16")
    two = LaunchPlan.split_kv(default_kernel(prob, split=True), 16, CombineConfig("fp16", 128, 4, 1), source="test")
    sets = [_inputs(b=1, n=3000) for _ in range(threads)]
    if lib == "torch":
        torch = pytest.importorskip("torch")
        sets = [tuple(torch.as_tensor(a, device="cuda") for a in s) for s in sets]
    plan.clear()
    with dispatch.forced_plan(two):
        want = [cp.asnumpy(cp.asarray(fdpp.decode_attention(*s))) for s in sets]
    cp.cuda.runtime.deviceSynchronize()
    got = [[] for _ in range(threads)]

    def rank(i):
        if lib == "torch":
            stream = torch.cuda.Stream()
            ctx = torch.cuda.stream(stream)
        else:
            stream = ctx = cp.cuda.Stream(non_blocking=True)
        with dispatch.forced_plan(two), ctx:
            got[i] = [fdpp.decode_attention(*sets[i]) for _ in range(reps)]
        stream.synchronize()

    _threaded(rank, threads)
    assert len(plan._records) == 1  # one record served every thread
    for i in range(threads):
        bad = [r for r, o in enumerate(got[i]) if not np.array_equal(cp.asnumpy(cp.asarray(o)), want[i])]
        assert not bad, f"thread {i}: {len(bad)} of {reps} results are not its inputs' (first: call {bad[0]})"


def test_threads_sharing_a_gemm_record_each_get_their_own_result():
    """flat_gemm's record (one argument struct, the driver launcher) from four threads. Weaker than
    the attention test: one launch per call leaves a narrow window, and with the lock taken out it
    still passed in run Z5's call 6 (3 rounds); it guards the results, not the race's detection."""
    from fdpp import gemm

    cp, threads, reps = _cp(), 4, 100
    xs = [cp.random.standard_normal((4, 4096), dtype=cp.float32).astype(cp.float16) for _ in range(threads)]
    w = (cp.random.standard_normal((1024, 4096), dtype=cp.float32) * 0.02).astype(cp.float16)
    old = launch.LAUNCHER
    launch.LAUNCHER = "cupy-driver"
    try:
        gemm._records.clear()
        want = [cp.asnumpy(fdpp.flat_gemm(x, w)) for x in xs]
        got = [[] for _ in range(threads)]

        def rank(i):
            with cp.cuda.Stream(non_blocking=True) as stream:
                got[i] = [fdpp.flat_gemm(xs[i], w) for _ in range(reps)]
                stream.synchronize()

        _threaded(rank, threads)
    finally:
        launch.LAUNCHER = old
    assert len(gemm._records) == 1  # one record served every thread
    for i in range(threads):
        assert all(np.array_equal(cp.asnumpy(y), want[i]) for y in got[i]), f"thread {i}"


@pytest.mark.parametrize("name", [n for n in launch.LAUNCHERS if n != "cupy"])
def test_every_launcher_matches_the_cupy_launcher(name):
    cp = _cp()
    from fdpp import gemm

    q, k, v = _inputs()
    x = cp.random.standard_normal((4, 4096), dtype=cp.float32).astype(cp.float16)
    w = (cp.random.standard_normal((1024, 4096), dtype=cp.float32) * 0.02).astype(cp.float16)
    old = launch.LAUNCHER
    launch.LAUNCHER = "cupy"
    try:
        want = fdpp.decode_attention(q, k, v, return_lse=True)
        want_y = fdpp.flat_gemm(x, w)
        launch.LAUNCHER = name
        for _ in range(2):  # the record's first call with this launcher, and a repeat
            got = fdpp.decode_attention(q, k, v, return_lse=True)
            got_y = fdpp.flat_gemm(x, w)
        cp.cuda.runtime.deviceSynchronize()
    finally:
        launch.LAUNCHER = old
    assert cp.array_equal(got[0], want[0]) and cp.array_equal(got[1], want[1])
    assert cp.array_equal(got_y, want_y) and gemm._records


def test_a_reused_output_is_never_one_still_held():
    cp = _cp()
    plan.clear()
    q, k, v = _inputs()
    o1 = fdpp.decode_attention(q, k, v)
    keep = o1.copy()
    for _ in range(3):  # o1 alive: other buffers, o1 untouched
        q2, k2, v2 = _inputs()
        o2 = fdpp.decode_attention(q2, k2, v2)
        assert o2.data.ptr != o1.data.ptr
    cp.cuda.runtime.deviceSynchronize()
    assert cp.array_equal(o1, keep)
    ptr = o1.data.ptr
    del o1
    o3 = fdpp.decode_attention(q, k, v)  # o1's buffer, free again, with the same values recomputed
    assert o3.data.ptr == ptr and cp.array_equal(o3, keep)
    ref, _ = attention_reference(q2, k2, v2)
    assert_close(cp.asnumpy(o2), cp.asnumpy(ref), "fp16")


def test_torch_compile_fullgraph_and_cuda_graphs():
    torch = pytest.importorskip("torch")
    import fdpp.torch_ops  # noqa: F401 - registers torch.ops.fdpp.*

    q = torch.randn(2, 32, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 4096, 8, 128, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    lens = torch.tensor([4096, 1000], device="cuda", dtype=torch.int32)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.float16) * 0.02
    pages = torch.randn(600, 16, 8, 128, device="cuda", dtype=torch.float16)
    table = torch.randperm(600, device="cuda")[:512].reshape(2, 256).to(torch.int32)

    def step(q, k, v, lens, w):
        o = torch.ops.fdpp.decode_attention(q, k, v, lens, None, "NHD", None)
        o2, lse = torch.ops.fdpp.decode_attention_lse(q, k, v, lens, None, "NHD", None)
        p = torch.ops.fdpp.paged_decode_attention(q, pages, pages, table, lens, None, "NHD", None)
        y = torch.ops.fdpp.flat_gemm(o.reshape(2, -1), w, None)
        return y + 1, o2 * 2, lse, p

    eager = step(q, k, v, lens, w)
    full = torch.compile(step, fullgraph=True)(q, k, v, lens, w)  # raises on any graph break
    for a, b in zip(eager, full, strict=True):
        assert torch.equal(a, b)
    ro = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        got = ro(q, k, v, lens, w)
    for a, b in zip(eager, got, strict=True):
        assert torch.equal(a, b)
