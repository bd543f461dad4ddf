"""The host fast path on a CPU: launch records of decode_attention, DecodePlan.run and flat_gemm
driven with CuPy/torch stand-ins (tests/fakegpu.py) and a stub launcher that records each launch.

What a repeat call must still do: reject misaligned and overlapping pointers with the full path's
errors, miss on any change of signature (shape, strides, dtype, device, options, forced plan,
tables), and write the new pointers into the kernel's argument struct.

``python tests/test_host_fastpath.py`` prints micro-timings of the repeat path (pure Python: the
stand-ins cost ~nothing, so this is fdpp's own per-call work).
"""

from __future__ import annotations

import sys
import timeit
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import fakegpu  # noqa: E402

import fdpp  # noqa: E402
from fdpp import api, configs, dispatch, gemm, plan, tables  # noqa: E402
from fdpp.plan import PTR_FIELDS  # noqa: E402


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.delenv(tables.ENV_DIR, raising=False)
    fakegpu.install(monkeypatch)
    api.set_checks(False)
    yield fakegpu
    plan.clear()
    gemm._records.clear()


def _words(launch_args: tuple) -> np.ndarray:
    """The pointer words of a launch's DecodeParams argument."""
    return np.frombuffer(launch_args[0], dtype=np.uint64, count=len(PTR_FIELDS))


W = {f: i for i, f in enumerate(plan.PTR_FIELDS)}  # DecodeParams' pointer words by name
KEY = ("contiguous", None, "NHD", None, False, None, api._NO_QUANT.key(), None)  # decode_attention(q, k, v)


def _ptr(a) -> int:
    return a.data_ptr() if isinstance(a, fakegpu.Tensor) else a.data.ptr


# ---- decode_attention ---------------------------------------------------------------------
_SPLIT = configs.DecodeConfig("fp16", 128, 4, 4, 3, 1, mma=True)  # llama3-8b heads, tensor cores
MERGES = {  # 8 splits, each way of merging them (the table's pick for these inputs varies by GPU)
    "fused": configs.LaunchPlan.split_kv(_SPLIT, 8, fused=True),
    "two-launch": configs.LaunchPlan.split_kv(_SPLIT, 8),
    "cluster": configs.LaunchPlan.cluster_merge(_SPLIT, 8),
}


@pytest.mark.parametrize("merge", sorted(MERGES))
@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_repeat_call_reuses_the_record_and_writes_new_pointers(fake, kind, merge):
    q, k, v = fake.llama_inputs(kind)
    with dispatch.forced_plan(MERGES[merge]):
        o1 = fdpp.decode_attention(q, k, v)
        assert len(plan._records) == 1
        rec = next(iter(plan._records.values()))
        assert rec.plan.mode == merge and rec.splits == 8
        assert len(rec.calls) == (2 if merge == "two-launch" else 1)  # split + combine, or one launch
        fake.LAUNCHES.clear()
        q2, k2, v2 = fake.llama_inputs(kind)  # same signature, new pointers
        o2 = fdpp.decode_attention(q2, k2, v2)
        assert len(plan._records) == 1 and len(fake.LAUNCHES) == len(rec.calls)
        w = _words(fake.LAUNCHES[0][2])
        assert w[W["counters"]] == (rec._tickets[next(iter(rec._tickets))] if merge == "fused" else 0)  # the stream's tickets
        assert list(w[:3]) == [_ptr(q2), _ptr(k2), _ptr(v2)] and w[W["seqlens"]] == 0 and w[W["block_table"]] == 0
        assert w[W["out"]] == _ptr(o2) and _ptr(o2) != _ptr(o1)
        assert w[W["lse"]] == 0  # no lse asked for
        if merge == "cluster":  # merged in the cluster's shared memory: no partials in global memory
            assert w[W["o_part"]] == 0 and w[W["lse_part"]] == 0
            assert tuple(fake.LAUNCHES[0][0]) == (8, 32 // 4, 1)  # a cluster of 8 per (request, KV-head group)
        else:
            assert w[W["o_part"]] and w[W["lse_part"]] == w[W["o_part"]] + 4 * 32 * rec.splits * 128  # lse partials follow the o partials
        fake.LAUNCHES.clear()
        fdpp.decode_attention(q2, k2, v2)  # the partials: the stream's workspace, the same every call
        assert _words(fake.LAUNCHES[0][2])[W["o_part"]] == w[W["o_part"]] and _words(fake.LAUNCHES[0][2])[W["counters"]] == w[W["counters"]]
        assert fake.LAUNCHES[0][1] == rec.calls[0].block and fake.LAUNCHES[0][3] == rec.calls[0].smem


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_return_lse_allocates_a_fresh_lse_per_call(fake, kind):
    q, k, v = fake.llama_inputs(kind)
    _, lse1 = fdpp.decode_attention(q, k, v, return_lse=True)
    fake.LAUNCHES.clear()
    o, lse2 = fdpp.decode_attention(q, k, v, return_lse=True)
    assert lse2.shape == (1, 32) and _ptr(lse2) != _ptr(lse1)
    assert _words(fake.LAUNCHES[0][2])[W["lse"]] == _ptr(lse2)


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_record_hit_still_checks_pointers(fake, kind):
    q, k, v = fake.llama_inputs(kind)
    fdpp.decode_attention(q, k, v)
    with pytest.raises(ValueError, match="16-byte"):
        fdpp.decode_attention(q, k.view_at(2), v)  # same signature, pointer off by 2 bytes
    with pytest.raises(ValueError, match="16-byte"):
        fdpp.decode_attention(q, k, v.view_at(8))
    out = type(q)(q.shape)
    fdpp.decode_attention(q, k, v, out=out)
    n_rec = len(plan._records)
    alias = type(q)(q.shape, ptr=_ptr(k) + 4096)  # out inside k_cache
    with pytest.raises(ValueError, match="out must not overlap k_cache"):
        fdpp.decode_attention(q, k, v, out=alias)
    alias_q = type(q)(q.shape, ptr=_ptr(q))
    with pytest.raises(ValueError, match="out must not overlap q"):
        fdpp.decode_attention(q, k, v, out=alias_q)
    assert len(plan._records) == n_rec


def test_changed_signature_misses(fake):
    q, k, v = fake.llama_inputs("cupy")
    fdpp.decode_attention(q, k, v)
    fdpp.decode_attention(q, k, v, num_splits=2)
    fdpp.decode_attention(q, k, v, softmax_scale=0.5)
    fdpp.decode_attention(q, k, v, return_lse=True)
    assert len(plan._records) == 4
    kb = fake.ndarray((1, 512, 8, 128))
    with pytest.raises(ValueError, match="same shape"):
        fdpp.decode_attention(q, kb, v)
    strided = fake.ndarray((1, 1024, 8, 128), strides=(1024 * 16 * 128, 16 * 128, 128, 1))  # a K/V half
    fdpp.decode_attention(q, strided, strided)
    assert len(plan._records) == 5
    rec = plan._records[api._record_key(KEY, "cupy",
                                        (q, strided, strided, None, None, None, None, None, None), None)]
    assert rec.params["k_sn"] == 16 * 128
    q32 = fake.ndarray((1, 32, 128), np.float32)
    with pytest.raises(TypeError, match="must match q dtype"):
        fdpp.decode_attention(q32, k, v)
    with pytest.raises(TypeError, match="same array type"):
        fdpp.decode_attention(q, fake.Tensor(k.shape), v)
    with pytest.raises(ValueError, match="one device"):
        fdpp.decode_attention(q, fake.ndarray(k.shape, device=1), v)


def test_record_key_follows_forced_plan_tables_dir_and_generation(fake, monkeypatch, tmp_path):
    q, k, v = fake.llama_inputs("cupy")
    fdpp.decode_attention(q, k, v)
    key = api._record_key(KEY, "cupy", (q, k, v, None, None, None, None, None, None), None)
    assert key in plan._records
    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path))
    key2 = api._record_key(KEY, "cupy", (q, k, v, None, None, None, None, None, None), None)
    assert key2 != key
    fdpp.decode_attention(q, k, v)
    assert len(plan._records) == 2
    monkeypatch.delenv(tables.ENV_DIR)
    rec = plan._records[key]
    with dispatch.forced_plan(rec.plan):
        assert api._record_key(KEY, "cupy",
                               (q, k, v, None, None, None, None, None, None), None) != key
    tables.clear_cache()  # tables re-read: every record is dropped on the next lookup
    assert plan.lookup(key) is None and not plan._records


def test_checks_mode_and_numpy_take_the_full_path(fake):
    q, k, v = fake.llama_inputs("cupy")
    fdpp.decode_attention(q, k, v)
    key = KEY
    assert api._fast(key, (q, k, v, None, None, None, None, None, None), None) is not api._MISS
    api.set_checks(True)
    try:
        assert api._fast(key, (q, k, v, None, None, None, None, None, None), None) is api._MISS
    finally:
        api.set_checks(False)
    qn = np.zeros((1, 32, 128), np.float16)
    assert api._fast(key, (qn, qn, qn, None, None, None, None, None, None), None) is api._MISS


def test_paged_repeat_path(fake):
    q = fake.ndarray((2, 32, 128))
    pages = fake.ndarray((64, 16, 8, 128))
    table = fake.ndarray((2, 8), np.int32)
    lens = fake.ndarray((2,), np.int32)
    fdpp.paged_decode_attention(q, pages, pages, table, lens)
    fake.LAUNCHES.clear()
    t2 = fake.ndarray((2, 8), np.int32)
    fdpp.paged_decode_attention(q, pages, pages, t2, lens)
    assert len(plan._records) == 1
    w = _words(fake.LAUNCHES[0][2])
    assert w[W["seqlens"]] == lens.data.ptr and w[W["block_table"]] == t2.data.ptr
    alias = fake.ndarray(q.shape, ptr=t2.data.ptr)
    with pytest.raises(ValueError, match="out must not overlap block_table"):
        fdpp.paged_decode_attention(q, pages, pages, t2, lens, out=alias)


# ---- DecodePlan ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_decode_plan_run_repeats_and_rechecks(fake, kind):
    q, k, v = fake.llama_inputs(kind)
    p = fdpp.DecodePlan(1, 32, 8, 128, 1024)
    p.run(q, k, v)
    rec = p._record
    assert rec is not None
    fake.LAUNCHES.clear()
    q2, k2, v2 = fake.llama_inputs(kind)
    o = p.run(q2, k2, v2)
    assert p._record is rec and list(_words(fake.LAUNCHES[0][2])[:3]) == [_ptr(q2), _ptr(k2), _ptr(v2)]
    assert _words(fake.LAUNCHES[0][2])[W["out"]] == _ptr(o)
    with pytest.raises(ValueError, match="16-byte"):
        p.run(q2, k2.view_at(4), v2)
    with pytest.raises(ValueError, match="do not match the plan"):
        short = type(k)((1, 512, 8, 128))
        p.run(q2, short, short)
    with pytest.raises(TypeError, match="contiguous DecodePlan"):
        p.run(q2, k2)
    assert p._record is rec


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_decode_plan_fast_path_keeps_the_signature_whole(fake, kind):
    """run(q, k, v)'s short path (a contiguous unquantised plan) matches only the record of a call
    of that form: a plan that first ran with cache_seqlens still launches with the new call's
    (absent) lengths, ``out=`` goes through it with its overlap check, and the short path and the
    general one write the same argument words."""
    q, k, v = fake.llama_inputs(kind)
    lens = type(q)((1,), fakegpu.int32 if kind == "torch" else np.int32)
    p = fdpp.DecodePlan(1, 32, 8, 128, 1024)
    assert p._plain
    p.run(q, k, v, cache_seqlens=lens)
    with_lens = p._record
    fake.LAUNCHES.clear()
    p.run(q, k, v)  # not the lens record's signature: the full call, a record without lengths
    assert _words(fake.LAUNCHES[-1][2])[W["seqlens"]] == 0 and p._record is not with_lens
    assert p._signature[3] is None
    out = type(q)(q.shape, q.dtype)
    words = []
    for plain in (True, False):
        p._plain = plain
        fake.LAUNCHES.clear()
        assert p.run(q, k, v, out=out) is out
        words.append(list(_words(fake.LAUNCHES[-1][2])))
        with pytest.raises(ValueError, match="out must not overlap k_cache"):
            p.run(q, k, v, out=type(q)(q.shape, ptr=_ptr(k) + 4096))
    assert words[0] == words[1] and words[0][W["out"]] == _ptr(out)
    assert not fdpp.DecodePlan(1, 32, 8, 128, 1024, page_size=16)._plain
    assert not fdpp.DecodePlan(1, 32, 8, 128, 1024, kv_dtype="fp8_e4m3")._plain


# ---- flat_gemm ----------------------------------------------------------------------------
def _gemm_inputs(kind: str, m: int = 1, n: int = 4096, k: int = 4096):
    t = fakegpu.Tensor if kind == "torch" else fakegpu.ndarray
    return t((m, k)), t((n, k)), t((n,))


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_flat_gemm_records(fake, kind):
    x, w, b = _gemm_inputs(kind)
    y1 = fdpp.flat_gemm(x, w)
    assert len(gemm._records) == 1
    rec = next(iter(gemm._records.values()))
    fake.LAUNCHES.clear()
    x2, w2, b2 = _gemm_inputs(kind)
    y2 = fdpp.flat_gemm(x2, w2, bias=b2)  # bias: another signature
    y3 = fdpp.flat_gemm(x2, w2, bias=b2)
    assert len(gemm._records) == 2 and len(fake.LAUNCHES) == 2
    for (grid, block, args, smem, _), y in zip(fake.LAUNCHES, (y2, y3), strict=True):
        assert [int(a) for a in args[:4]] == [_ptr(x2), _ptr(w2), _ptr(b2), _ptr(y)]
        assert grid == rec.grid and block == rec.block and smem == rec.smem
        assert int(args[6]) == 0 and int(args[7]) == 0  # w_scale: none (16-bit weights); no residual
        assert [int(a) for a in args[8:]] == [4096, 4096, 4096, 1, 4096, 4096, *[int(t) for t in rec.tail[6:]]]
        assert float(args[-1]) == -1.0  # rms_eps: no RMSNorm prologue
    assert y1.shape == (1, 4096) and _ptr(y2) != _ptr(y3)


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_flat_gemm_fused_records(fake, kind):
    """rms_eps is part of the record key and travels as the last argument; the residual's pointer
    is a per-call argument, which may be out itself but not overlap it otherwise (checked on record
    hits too)."""
    x, w, _ = _gemm_inputs(kind)
    r = type(x)((1, 4096))
    fake.LAUNCHES.clear()
    fdpp.flat_gemm(x, w, rms_eps=1e-5, residual=r, out=r)
    fdpp.flat_gemm(x, w, rms_eps=1e-5, residual=r, out=r)
    assert len(gemm._records) == 1
    fdpp.flat_gemm(x, w, rms_eps=1e-6, residual=r, out=r)
    assert len(gemm._records) == 2
    for (_, _, args, _, _), eps in zip(fake.LAUNCHES, (1e-5, 1e-5, 1e-6), strict=True):
        assert int(args[3]) == int(args[7]) == _ptr(r)  # y and residual: the same buffer
        assert float(args[-1]) == pytest.approx(eps)
    out = type(x)((1, 4096))
    with pytest.raises(ValueError, match="residual must be out itself"):
        fdpp.flat_gemm(x, w, rms_eps=1e-5, residual=type(x)((1, 4096), ptr=_ptr(out) + 64), out=out)
    with pytest.raises(ValueError, match="rms_eps must be finite"):
        fdpp.flat_gemm(x, w, rms_eps=-1.0)


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_flat_gemm_hit_still_checks_pointers_and_signature(fake, kind):
    x, w, b = _gemm_inputs(kind)
    out = type(x)((1, 4096))
    fdpp.flat_gemm(x, w, bias=b, out=out)
    with pytest.raises(ValueError, match="x must be 16-byte aligned"):
        fdpp.flat_gemm(x.view_at(2), w, bias=b, out=out)
    with pytest.raises(ValueError, match="w must be 16-byte aligned"):
        fdpp.flat_gemm(x, w.view_at(8), bias=b, out=out)
    with pytest.raises(ValueError, match="out must not overlap w"):
        fdpp.flat_gemm(x, w, bias=b, out=type(x)((1, 4096), ptr=_ptr(w) + 64))
    with pytest.raises(ValueError, match="out must not overlap bias"):
        fdpp.flat_gemm(x, w, bias=b, out=type(x)((1, 4096), ptr=_ptr(b)))
    with pytest.raises(ValueError, match="w has K"):
        fdpp.flat_gemm(x, type(w)((4096, 2048)))
    with pytest.raises(ValueError, match="out must have shape"):
        fdpp.flat_gemm(x, w, out=type(x)((1, 2048)))
    assert len(gemm._records) == 1


def test_flat_gemm_key_follows_forced_plan_and_table(fake, monkeypatch, tmp_path):
    x, w, _ = _gemm_inputs("cupy")
    fdpp.flat_gemm(x, w)
    cfg = gemm.GemvConfig("fp16", 4, 2, 2, 1)
    fake.LAUNCHES.clear()
    with gemm.forced_plan(gemm.GemmPlan("gemv", cfg, 132)):  # a grid: no occupancy query
        fdpp.flat_gemm(x, w)
    assert len(gemm._records) == 2 and fake.LAUNCHES[0][1] == (cfg.threads, 1, 1)
    with dispatch.forced_plan(configs.LaunchPlan.split_kv(configs.DecodeConfig("fp16", 128), 4)):
        fdpp.flat_gemm(x, w)  # a forced attention plan is not the GEMM's: the first record serves
    assert len(gemm._records) == 2
    gen = tables.generation()
    from fdpp.configs import SM90

    gemm.write_table(tmp_path / "t.json", SM90, [])
    assert tables.generation() == gen + 1  # a table written: GEMM plans may change, as attention's
    fdpp.flat_gemm(x, w)
    assert len(gemm._records) == 3


def test_flat_gemm_key_follows_the_user_tuning_dir(fake, monkeypatch, tmp_path):
    """User GEMM tables live in $FDPP_TUNING_DIR: changing it must not reuse a record planned from
    the old dir's table."""
    x, w, _ = _gemm_inputs("cupy")
    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path / "a"))
    fdpp.flat_gemm(x, w)
    fdpp.flat_gemm(x, w)
    assert len(gemm._records) == 1
    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path / "b"))
    fdpp.flat_gemm(x, w)
    assert len(gemm._records) == 2


def test_flat_gemm_cublas_plans_keep_no_record(fake, monkeypatch):
    x, w, _ = _gemm_inputs("torch")
    calls = []
    monkeypatch.setattr(sys.modules["torch"], "mm", lambda a, b, out=None: calls.append(1) or out, raising=False)
    with gemm.forced_plan(gemm.GemmPlan("cublas")):
        fdpp.flat_gemm(x, w)
        fdpp.flat_gemm(x, w)
    assert calls == [1, 1] and not gemm._records


# ---- micro-timing -------------------------------------------------------------------------
def repeat_path_us(n: int = 20000) -> dict[str, float]:
    """Per-call µs of repeat calls on the stand-ins (best of 5 batches of ``n``)."""
    def t(fn) -> float:
        fn()
        return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6

    res = {}
    for kind in ("cupy", "torch"):
        q, k, v = fakegpu.llama_inputs(kind)
        res[f"decode_attention {kind}"] = t(lambda q=q, k=k, v=v: fdpp.decode_attention(q, k, v))
        p = fdpp.DecodePlan(1, 32, 8, 128, 1024)
        res[f"DecodePlan.run {kind}"] = t(lambda p=p, q=q, k=k, v=v: p.run(q, k, v))
        x, w, _ = _gemm_inputs(kind)
        res[f"flat_gemm {kind}"] = t(lambda x=x, w=w: fdpp.flat_gemm(x, w))
    return res


def test_repeat_path_is_cheap(fake, monkeypatch):
    monkeypatch.setattr(fakegpu._Function, "__call__", lambda self, *a, **kw: None)
    res = repeat_path_us(n=200)
    assert all(us < 1000 for us in res.values()), res  # a gross regression (the full path each call)
    assert len(plan._records) == 4 and len(gemm._records) == 2


if __name__ == "__main__":
    mp = pytest.MonkeyPatch()
    fakegpu.install(mp, record=False)
    for name, us in repeat_path_us().items():
        print(f"{name:28s} {us:6.2f} us")


@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("which", ["k_cache", "v_cache", "out"])
def test_an_array_on_another_device_is_a_value_error_naming_it(fake, kind, which):
    """The cross-device hostile case without a second GPU: stand-in arrays that report device 1
    (the H200 test of it needs two GPUs and skips on one)."""
    q, k, v = fake.llama_inputs(kind)
    other = (fake.Tensor(k.shape, dev=1) if kind == "torch" else fake.ndarray(k.shape, device=1))
    args = {"k_cache": k, "v_cache": v, "out": None}
    if which == "out":
        args["out"] = fake.Tensor(q.shape, dev=1) if kind == "torch" else fake.ndarray(q.shape, device=1)
    else:
        args[which] = other
    with pytest.raises(ValueError, match=which):
        fdpp.decode_attention(q, args["k_cache"], args["v_cache"], out=args["out"])
    assert not fake.LAUNCHES


# ---- output reuse (CuPy) and the driver launchers' argument memory --------------------------
def test_cupy_output_is_reused_only_once_nothing_refers_to_it(fake):
    q, k, v = fake.llama_inputs("cupy")
    o1 = fdpp.decode_attention(q, k, v)
    p1 = o1.data.ptr
    o2 = fdpp.decode_attention(q, k, v)  # o1 is alive: a new buffer
    assert o2.data.ptr != p1
    del o1
    o3 = fdpp.decode_attention(q, k, v)  # o1's buffer, released
    assert o3.data.ptr == p1
    view = o3.view()  # a view holds its base
    del o3
    o4 = fdpp.decode_attention(q, k, v)
    assert o4.data.ptr not in (p1, o2.data.ptr)
    mp = view.data  # a MemoryPointer alone holds the memory
    del view
    o5 = fdpp.decode_attention(q, k, v)
    assert o5.data.ptr not in (p1, o2.data.ptr, o4.data.ptr)
    del mp
    o6 = fdpp.decode_attention(q, k, v)
    assert o6.data.ptr == p1
    rec = next(iter(plan._records.values()))
    assert len(rec._reuse.entries) <= plan.REUSE_ENTRIES
    x, w, _ = _gemm_inputs("cupy")  # flat_gemm's outputs alike
    y1 = fdpp.flat_gemm(x, w)
    py = y1.data.ptr
    assert fdpp.flat_gemm(x, w).data.ptr != py  # y1 alive; the result is dropped at once
    del y1
    assert fdpp.flat_gemm(x, w).data.ptr == py


def test_output_reuse_keeps_streams_apart_and_stays_bounded():
    r = plan._Reuse(lambda: (fakegpu.ndarray((4,)), None))
    a = r.get(1)[0]
    pa = a.data.ptr
    del a
    b = r.get(2)[0]  # stream 2 never gets stream 1's entry, even a free one
    assert b.data.ptr != pa
    c = r.get(1)[0]  # stream 1 gets its own, free again
    assert c.data.ptr == pa
    held = [r.get(7)[0] for _ in range(2 * plan.REUSE_ENTRIES)]  # all alive: fresh ones; the list stays bounded
    assert len({h.data.ptr for h in held}) == len(held) and len(r.entries) == plan.REUSE_ENTRIES
    assert r.get(7)[0].data.ptr not in {h.data.ptr for h in held}
    del held, b, c
    e = r.get(9)[0]
    assert any(x[1] is e for x in r.entries) and len(r.entries) == plan.REUSE_ENTRIES  # a free entry made room


def test_reuse_off_allocates_every_call(fake, monkeypatch):
    monkeypatch.setattr(plan, "REUSE_OUTPUTS", False)
    q, k, v = fake.llama_inputs("cupy")
    p1 = fdpp.decode_attention(q, k, v).data.ptr
    assert fdpp.decode_attention(q, k, v).data.ptr != p1


@pytest.mark.parametrize("launcher", ["bindings", "cupy-driver"])
def test_driver_launchers_read_the_arguments_where_the_records_write_them(fake, launcher):
    from fdpp import launch

    q, k, v = fake.llama_inputs("cupy")
    fdpp.decode_attention(q, k, v)
    call = next(iter(plan._records.values())).calls[0]
    assert call._addresses() == [call.params.ctypes.data]  # the struct, by address
    x, w, b = _gemm_inputs("cupy")
    fdpp.flat_gemm(x, w, bias=b)
    rec = next(iter(gemm._records.values()))
    args = rec.args
    addrs = rec.call._addresses()
    assert len(addrs) == 19 and addrs == sorted(addrs)
    monkeypatch_launcher = launch.LAUNCHER
    try:
        launch.LAUNCHER = launcher  # writes the pointer words, then launches (no driver here: it raises)
        y = type(x)((1, 4096))
        with pytest.raises(Exception):  # noqa: B017 - cuda.bindings / libcuda are absent on the CPU
            rec.run(fdpp.plan.pointers("cupy", (x, w, b, x, y)), y)  # any words in w_scale's and residual's slots
        assert [int(args[n][0]) for n in ("x", "w", "bias", "y", "w_scale", "residual")] == [
            _ptr(x), _ptr(w), _ptr(b), _ptr(y), _ptr(x), _ptr(y)]
        assert int(args["ws"][0]) and int(args["counters"][0])
        assert [float(args[n][0]) for n in gemm.GEMM_ARGS.names[gemm.N_GEMM_PTRS:]] == [float(t) for t in rec.tail]
    finally:
        launch.LAUNCHER = monkeypatch_launcher


def test_output_reuse_never_hands_one_array_to_two_threads(monkeypatch):
    import threading
    import time

    refs = plan._refs

    def refs_then_yield(ent):  # a thread switch between the free check and the claim
        r = refs(ent)
        time.sleep(0)
        return r

    monkeypatch.setattr(plan, "_refs", refs_then_yield)
    r = plan._Reuse(lambda: (fakegpu.ndarray((4,)), None))
    holding: dict[int, list] = {t: [] for t in range(4)}  # what each thread holds, read under guard
    guard = threading.Lock()
    clashes: list[tuple[int, int]] = []

    def worker(tid: int) -> None:
        mine = holding[tid]
        for _ in range(800):
            a = r.get(0)[0]  # one stream (the null stream) shared by the threads
            with guard:
                clashes.extend((tid, o) for o, m in holding.items() if o != tid and any(x is a for x in m))
                mine.append(a)
            del a
            if len(mine) > 2:
                with guard:
                    old = mine.pop(0)
                del old

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        ts = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert not clashes and len(r.entries) <= plan.REUSE_ENTRIES


def test_kernel_call_passes_struct_fields_by_value_with_the_cupy_launcher(fake):
    from fdpp import launch

    args = np.zeros(1, dtype=gemm.GEMM_ARGS)
    args["x"], args["ldx"], args["grid"] = 1 << 40, 4096, 132
    cfg = gemm.GemvConfig("fp16", 4, 2, 2, 1)
    fake.LAUNCHES.clear()
    launch.KernelCall(cfg, (132, 1, 1), 0, args, fields=True, fn=fakegpu._Function())(fakegpu._NULL_STREAM)
    (grid, block, passed, smem, _), = fake.LAUNCHES
    assert grid == (132, 1, 1) and block == (cfg.threads, 1, 1) and smem == cfg.smem_bytes()
    assert len(passed) == 19 and [type(a) for a in passed[:9]] == [np.uint64] * 8 + [np.int64]
    assert int(passed[0]) == 1 << 40 and int(passed[8]) == 4096 and int(passed[16]) == 132 and type(passed[16]) is np.int32
    assert type(passed[18]) is np.float32  # rms_eps


def test_flat_gemm_inside_a_torch_capture_takes_capture_safe_scratch(fake, monkeypatch):
    """The first call on a stream inside a torch graph capture gets its partials and tickets from
    torch (torch.empty / torch.zeros: capture-aware, zeroed by a captured memset) and registers no
    workspace; the next call outside the capture makes (and keeps) the stream's real scratch."""
    from fdpp import workspace

    torch = sys.modules["torch"]
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    made = []
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: made.append(a) or real_zeros(*a, **kw))
    x, w, _ = _gemm_inputs("torch")
    with gemm.forced_plan(gemm.GemmPlan("gemv", gemm.GemvConfig("fp16", 4, 2, 2, 1), 132)):
        fake.LAUNCHES.clear()
        fdpp.flat_gemm(x, w)
        assert made and not workspace._partials and not workspace._tickets  # torch's, nothing registered
        args = fake.LAUNCHES[-1][2]
        assert int(args[4]) and int(args[5])  # partials and tickets pointers were given
        capturing[0] = False
        fdpp.flat_gemm(x, w)
        (key, (mem, _)), = workspace._tickets.items()
        assert int(fake.LAUNCHES[-1][2][5]) == mem.ptr and key in workspace._partials
        fdpp.flat_gemm(x, w)  # the repeat path reuses them
        assert int(fake.LAUNCHES[-1][2][5]) == mem.ptr and len(made) == 1
