"""fdpp.cache.PagedKVCache: page allocation, copy-on-write forks, the active batch's tables, and
the writes (NumPy scatter on the CPU; the paged_append kernel on cupy/torch, tests marked gpu).

Expected values are independent of the cache: every K/V row written is also kept in a plain
per-sequence list, and the pools are read back through the block table (a gather) and compared
bit for bit."""

import re

import numpy as np
import pytest
from nvrtc_util import append_layout_check

from fdpp import registry
from fdpp.cache import (
    APPEND_THREADS,
    PAGED_APPEND_PARAMS,
    TABLE_UPDATE_PARAMS,
    OutOfPagesError,
    PagedAppendConfig,
    PagedKVCache,
    TableUpdateConfig,
    append_compile_space,
)
from fdpp.dtypes import DTYPES
from fdpp.launch import ParamStruct

L, H, D = 2, 2, 64
STARTS = (0, 19, 40)  # prefill lengths of the three sequences (40: two extend chunks)
STEPS, FORK_AT, FREE_AT = 50, 20, 35
DTS = ("fp16", "bf16", "fp32")


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def _pool_pages(ps):
    return 2 * sum(-(-(n + STEPS + 1) // ps) for n in STARTS) + 4


# ---- the reference scenario, shared by the CPU and GPU tests --------------------------------
def _identity(x, i=0):
    return x


def _variant(x, i, to_dev):
    """Row i of a step as a contiguous array, a strided view (aligned) or a misaligned view."""
    if i % 3 == 0:
        return to_dev(x)
    off = 8 if i % 3 == 1 else 1
    pad = np.full(x.shape[:2] + (x.shape[2] + 9,), 3, dtype=x.dtype)
    pad[..., off:off + x.shape[2]] = x
    return to_dev(pad)[..., off:off + x.shape[2]]


def _gather(cache, seq):
    """[n, H, D] K and V of ``seq`` per layer, read through its pages (independent of the writes)."""
    pages, n, ps = np.asarray(cache.pages(seq), dtype=np.int64), cache.length(seq), cache.page_size
    pos = np.arange(n)
    pg, slot = pages[pos // ps], pos % ps
    out = []
    for layer in range(cache.num_layers):
        kv = []
        for pool in (cache.k_pages(layer), cache.v_pages(layer)):
            p = cache.to_numpy(pool)
            kv.append(p[pg, slot] if cache.kv_layout == "NHD" else p[pg, :, slot])
        out.append(kv)
    return out


def _check_seq(cache, seq, exp):
    got = _gather(cache, seq)
    for layer in range(cache.num_layers):
        for g, e in zip(got[layer], exp[seq][layer], strict=True):
            want = np.concatenate(e) if e else np.zeros((0, H, D), g.dtype)
            np.testing.assert_array_equal(_bits(g), _bits(want), err_msg=f"seq {seq} layer {layer}")


def _check_tables(cache):
    """Device tables equal the host mirror; rows are the batch's pages, 0 beyond."""
    bt, lens = cache.to_numpy(cache.block_table), cache.to_numpy(cache.seqlens)
    assert bt.dtype == np.int32 and lens.dtype == np.int32
    want = np.zeros_like(bt)
    for r, s in enumerate(cache.batch):
        want[r, :len(cache.pages(s))] = cache.pages(s)
        assert lens[r] == cache.length(s)
    np.testing.assert_array_equal(bt, want)
    np.testing.assert_array_equal(cache.to_numpy(cache._bt_dev), cache._bt_host)
    np.testing.assert_array_equal(cache.to_numpy(cache._len_dev), cache._len_host)


def _chunks(n):
    return [n] if n < 30 else [25, n - 25]


def _prefill(cache, exp, rand, to_dev):
    seqs = [cache.allocate() for _ in STARTS]
    for s, n in zip(seqs, STARTS, strict=True):
        exp[s] = [([], []) for _ in range(L)]
        for c in _chunks(n) if n else []:
            start = cache.extend_reserve(s, c)
            assert start == cache.length(s) - c
            for layer in range(L):
                k, v = rand(c, H, D), rand(c, H, D)
                cache.extend(layer, s, to_dev(k, layer), to_dev(v, layer + 1))
                exp[s][layer][0].append(k)
                exp[s][layer][1].append(v)
    return seqs


def _fork(cache, exp, batch):
    parent = batch[0]
    child = cache.fork(parent)
    assert cache.pages(child) == cache.pages(parent) and cache.length(child) == cache.length(parent)
    assert all(cache.refcount(p) == 2 for p in cache.pages(parent))
    exp[child] = [(list(k), list(v)) for k, v in exp[parent]]
    batch.append(child)
    cache.set_batch(batch)
    return parent, child


def _after_fork(cache, exp, parent, child, ps):
    """After the first divergent step: full pages stay shared, a partly filled one was copied."""
    n0 = cache.length(parent) - 1  # length at the fork
    pp, pc = cache.pages(parent), cache.pages(child)
    full = n0 // ps
    assert pp[:full] == pc[:full]
    assert set(pp[full:]).isdisjoint(pc[full:])
    _check_seq(cache, parent, exp)
    _check_seq(cache, child, exp)


def run_scenario(cache, seed, to_dev=_identity):
    """Prefill 3 sequences, 50 decode steps; fork at step 20 (divergent appends), free at 35."""
    g = np.random.default_rng(seed)
    dt = DTYPES[cache.dtype].np_dtype

    def rand(*shape):
        return g.standard_normal(shape).astype(dt)

    exp = {}
    batch = _prefill(cache, exp, rand, to_dev)
    cache.set_batch(batch)
    _check_tables(cache)
    for step in range(STEPS):
        if step == FORK_AT:
            parent, child = _fork(cache, exp, batch)
        if step == FREE_AT:
            gone = batch.pop(1)
            cache.set_batch(batch)
            cache.free(gone)
            del exp[gone]
        cache.reserve(1)
        for layer in range(L):
            k, v = rand(len(batch), H, D), rand(len(batch), H, D)
            cache.append(layer, to_dev(k, step), to_dev(v, step + 1))
            for i, s in enumerate(batch):
                exp[s][layer][0].append(k[i:i + 1])
                exp[s][layer][1].append(v[i:i + 1])
        if step == FORK_AT:
            _after_fork(cache, exp, parent, child, cache.page_size)
        if step in (0, FORK_AT, FREE_AT, STEPS - 1):
            _check_tables(cache)
    for s in exp:
        _check_seq(cache, s, exp)
    return batch


# ---- CPU: the NumPy backend -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTS)
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
def test_scenario_numpy(rng, page_size, kv_layout, dtype):
    n_pages = _pool_pages(page_size)
    cache = PagedKVCache(L, n_pages, page_size, H, D, dtype=dtype, kv_layout=kv_layout, max_batch=8,
                         backend="numpy")
    shape = (L, n_pages, page_size, H, D) if kv_layout == "NHD" else (L, n_pages, H, page_size, D)
    assert cache.k_pages(1).shape == shape[1:] and cache.k_pages(1).dtype == DTYPES[dtype].np_dtype
    batch = run_scenario(cache, int(rng.integers(1 << 31)), lambda x, i=0: _variant(x, i, np.asarray))
    cache.set_batch([])
    for s in batch:
        cache.free(s)
    assert cache.num_free_pages == n_pages
    assert not cache._refcnt.any()


def _cache(ps=4, n_pages=64, **kw):
    kw.setdefault("backend", "numpy")
    return PagedKVCache(L, n_pages, ps, H, D, max_batch=8, max_pages_per_seq=16, **kw)


def _fill(cache, seq, n, rng):
    cache.extend_reserve(seq, n)
    dt = DTYPES[cache.dtype].np_dtype
    kv = [(rng.standard_normal((n, H, D)).astype(dt), rng.standard_normal((n, H, D)).astype(dt))
          for _ in range(L)]
    for layer, (k, v) in enumerate(kv):
        cache.extend(layer, seq, k, v)
    return kv


def _step(cache, rng):
    cache.reserve(1)
    b = cache.batch_size
    kv = [(rng.standard_normal((b, H, D)).astype(np.float16),
           rng.standard_normal((b, H, D)).astype(np.float16)) for _ in range(L)]
    for layer, (k, v) in enumerate(kv):
        cache.append(layer, k, v)
    return kv


def test_fork_copy_on_write(rng):
    cache = _cache(ps=16)
    parent = cache.allocate()
    pre = _fill(cache, parent, 10, rng)  # one partly filled page
    child = cache.fork(parent)
    (page,) = cache.pages(parent)
    assert cache.pages(child) == (page,) and cache.refcount(page) == 2
    free0 = cache.num_free_pages
    cache.set_batch([child])
    kv = _step(cache, rng)  # the child's write copies the shared page first
    (copy,) = cache.pages(child)
    assert copy != page and cache.pages(parent) == (page,)
    assert cache.refcount(page) == 1 and cache.refcount(copy) == 1 and cache.num_free_pages == free0 - 1
    exp = {parent: [([k], [v]) for k, v in pre],
           child: [([k, kn], [v, vn]) for (k, v), (kn, vn) in zip(pre, kv, strict=True)]}
    _check_seq(cache, parent, exp)  # parent's tokens unchanged
    _check_seq(cache, child, exp)
    cache.set_batch([parent])
    kv = _step(cache, rng)  # now unshared: written in place, no new page
    assert cache.pages(parent) == (page,) and cache.num_free_pages == free0 - 1
    for layer, (kn, vn) in enumerate(kv):
        exp[parent][layer][0].append(kn)
        exp[parent][layer][1].append(vn)
    _check_seq(cache, parent, exp)
    _check_seq(cache, child, exp)


def test_fork_full_pages_stay_shared(rng):
    cache = _cache(ps=4)
    a = cache.allocate()
    _fill(cache, a, 8, rng)  # two full pages
    b = cache.fork(a)
    cache.set_batch([a, b])
    free0 = cache.num_free_pages
    _step(cache, rng)
    assert cache.pages(a)[:2] == cache.pages(b)[:2] and cache.pages(a)[2] != cache.pages(b)[2]
    assert cache.num_free_pages == free0 - 2  # one fresh page each, no copies


def test_parent_and_child_in_one_batch_copy_once(rng):
    cache = _cache(ps=8)
    a = cache.allocate()
    _fill(cache, a, 5, rng)
    b = cache.fork(a)
    c = cache.fork(a)
    cache.set_batch([a, b, c])
    free0 = cache.num_free_pages
    _step(cache, rng)
    # three holders of one partly filled page: two copies, the last one writes in place
    assert cache.num_free_pages == free0 - 2
    assert len({cache.pages(s)[0] for s in (a, b, c)}) == 3


def test_free_returns_pages_after_forks(rng):
    cache = _cache(ps=4)
    start = cache.num_free_pages
    a = cache.allocate()
    _fill(cache, a, 9, rng)
    b = cache.fork(a)
    cache.set_batch([b])
    _step(cache, rng)
    cache.set_batch([])
    cache.free(a)  # b still holds a's two full pages
    assert cache.num_free_pages == start - 3
    cache.free(b)
    assert cache.num_free_pages == start
    with pytest.raises(ValueError, match="not a live sequence"):
        cache.length(a)


def test_reserve_only_some_rows_need_a_page(rng):
    cache = _cache(ps=4)
    seqs = [cache.allocate() for _ in range(4)]
    for s, n in zip(seqs, (4, 5, 8, 3), strict=True):
        _fill(cache, s, n, rng)
    cache.set_batch(seqs)
    before = {s: cache.pages(s) for s in seqs}
    free0 = cache.num_free_pages
    cache.reserve(1)
    assert cache.num_free_pages == free0 - 2
    for s, grows in zip(seqs, (True, False, True, False), strict=True):
        assert cache.pages(s)[:len(before[s])] == before[s]
        assert len(cache.pages(s)) == len(before[s]) + grows
    np.testing.assert_array_equal(cache.seqlens, [5, 6, 9, 4])
    _check_tables(cache)


def test_reserve_many_tokens_and_rows_shrink(rng):
    cache = _cache(ps=4)
    a, b = cache.allocate(), cache.allocate()
    cache.set_batch([a, b])
    cache.reserve(10)  # 3 pages each, from empty
    assert [len(cache.pages(s)) for s in (a, b)] == [3, 3]
    _check_tables(cache)
    c = cache.allocate()
    _fill(cache, c, 2, rng)
    cache.set_batch([c])  # the old rows' entries are cleared on the device too
    _check_tables(cache)
    assert not cache._bt_host[1:].any()


def test_extend_reserve_of_an_active_sequence(rng):
    cache = _cache(ps=4)
    a = cache.allocate()
    cache.set_batch([a])
    pre = _fill(cache, a, 6, rng)
    _check_tables(cache)
    kv = _step(cache, rng)
    exp = {a: [([k, kn], [v, vn]) for (k, v), (kn, vn) in zip(pre, kv, strict=True)]}
    _check_seq(cache, a, exp)


def _snapshot(cache, seqs):
    return (cache.to_numpy(cache.block_table).copy(), cache.to_numpy(cache.seqlens).copy(),
            list(cache._free), cache._refcnt.copy(), {s: (cache.pages(s), cache.length(s)) for s in seqs},
            cache.to_numpy(cache._k).copy())


def _assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))
        else:
            assert x == y


def test_out_of_pages_changes_nothing(rng):
    cache = _cache(ps=4, n_pages=8)
    a, b = cache.allocate(), cache.allocate()
    _fill(cache, a, 6, rng)  # 2 pages, the last partly filled
    c = cache.fork(a)
    _fill(cache, b, 3, rng)  # 1 page
    cache.set_batch([a, b, c])
    free = cache.num_free_pages
    assert free == 5
    before = _snapshot(cache, [a, b, c])
    # 7 tokens: a copies its shared last page + 2 new, b 2 new, c 2 new (in place after a's copy)
    with pytest.raises(OutOfPagesError, match=f"needs 7 free pages, only {free} are free") as e:
        cache.reserve(7)
    assert isinstance(e.value, RuntimeError) and (e.value.needed, e.value.free) == (7, 5)
    _assert_same(before, _snapshot(cache, [a, b, c]))
    with pytest.raises(OutOfPagesError):
        cache.extend_reserve(b, 30)
    _assert_same(before, _snapshot(cache, [a, b, c]))
    cache.reserve(2)  # what fits still works: a's copy and one new page for b
    assert cache.num_free_pages == free - 2
    assert cache.pages(c) == before[4][c][0] and cache.pages(a)[0] == before[4][a][0][0]


def test_too_long_changes_nothing(rng):
    cache = _cache(ps=4)  # max_pages_per_seq 16: 64 tokens
    a = cache.allocate()
    cache.set_batch([a])
    cache.reserve(60)
    before = _snapshot(cache, [a])
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        cache.reserve(5)
    _assert_same(before, _snapshot(cache, [a]))
    cache.reserve(4)
    assert cache.length(a) == 64


def test_inputs_are_not_modified(rng):
    cache = _cache(ps=4)
    a = cache.allocate()
    cache.set_batch([a])
    cache.reserve(1)
    k = rng.standard_normal((1, H, D)).astype(np.float16)
    keep = k.copy()
    cache.append(0, k, k)
    ids = [a]
    cache.set_batch(ids)
    np.testing.assert_array_equal(_bits(k), _bits(keep))
    assert ids == [a]


# ---- bad arguments ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, exc, words",
    [
        ({"num_layers": 0}, ValueError, "num_layers"),
        ({"num_layers": 1.5}, TypeError, "num_layers"),
        ({"num_pages": True}, TypeError, "num_pages"),
        ({"num_pages": -1}, ValueError, "num_pages"),
        ({"page_size": 3}, ValueError, "page_size must be a power of two"),
        ({"page_size": 512}, ValueError, "page_size"),
        ({"num_kv_heads": 0}, ValueError, "num_kv_heads"),
        ({"head_dim": "64"}, TypeError, "head_dim"),
        ({"dtype": "int8"}, TypeError, "dtype"),
        ({"dtype": np.float64}, TypeError, "dtype"),
        ({"kv_layout": "NDH"}, ValueError, "kv_layout"),
        ({"max_batch": 0}, ValueError, "max_batch"),
        ({"max_pages_per_seq": 0}, ValueError, "max_pages_per_seq"),
        ({"backend": "jax"}, ValueError, "backend"),
        ({"device": 0}, ValueError, "device"),
    ],
)
def test_bad_constructor_arguments(kw, exc, words):
    args = {"num_layers": 2, "num_pages": 8, "page_size": 4, "num_kv_heads": 2, "head_dim": 8,
            "backend": "numpy", **kw}
    pos = [args.pop(n) for n in ("num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim")]
    with pytest.raises(exc, match=words):
        PagedKVCache(*pos, **args)


@pytest.fixture
def ready(rng):
    cache = _cache(ps=4)
    a, b = cache.allocate(), cache.allocate()
    _fill(cache, a, 5, rng)
    cache.set_batch([a, b])
    cache.reserve(1)
    k = rng.standard_normal((2, H, D)).astype(np.float16)
    return cache, a, b, k


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda c, a, b, k: c.append(2, k, k), ValueError, "layer"),
        (lambda c, a, b, k: c.append("0", k, k), TypeError, "layer"),
        (lambda c, a, b, k: c.append(0, k.tolist(), k), TypeError, "k_new must be a numpy.ndarray"),
        (lambda c, a, b, k: c.append(0, k[:1], k), ValueError, "k_new must have shape"),
        (lambda c, a, b, k: c.append(0, k, k[:, :, :32]), ValueError, "v_new must have shape"),
        (lambda c, a, b, k: c.append(0, k, k[0]), ValueError, "v_new must have shape"),
        (lambda c, a, b, k: c.append(0, k.astype(np.float32), k), TypeError, "k_new dtype"),
        (lambda c, a, b, k: c.append(0, k, k.astype(np.int16)), TypeError, "v_new dtype"),
        (lambda c, a, b, k: c.extend(0, a, k[:, :, :], k[:1]), ValueError, "v must have shape"),
        (lambda c, a, b, k: c.extend(0, a, k[:0], k[:0]), ValueError, "k must have shape"),
        (lambda c, a, b, k: c.extend(0, 99, k, k), ValueError, "seq 99"),
        (lambda c, a, b, k: c.extend(0, "a", k, k), TypeError, "seq must be"),
        (lambda c, a, b, k: c.extend(0, b, np.concatenate([k, k]), np.concatenate([k, k])), ValueError,
         "extend_reserve"),
        (lambda c, a, b, k: c.extend_reserve(a, 0), ValueError, "num_tokens"),
        (lambda c, a, b, k: c.reserve(0), ValueError, "num_tokens"),
        (lambda c, a, b, k: c.reserve(1.0), TypeError, "num_tokens"),
        (lambda c, a, b, k: c.set_batch([a, a]), ValueError, "more than once"),
        (lambda c, a, b, k: c.set_batch(a), TypeError, "seq_ids"),
        (lambda c, a, b, k: c.set_batch([a, 7]), ValueError, "seq_ids entry 7"),
        (lambda c, a, b, k: c.set_batch([c.allocate() for _ in range(9)]), ValueError, "max_batch"),
        (lambda c, a, b, k: c.free(a), ValueError, "active batch"),
        (lambda c, a, b, k: c.fork(None), TypeError, "seq must be"),
        (lambda c, a, b, k: c.k_pages(-1), ValueError, "layer"),
        (lambda c, a, b, k: c.refcount(64), ValueError, "page"),
    ],
)
def test_bad_call_arguments(ready, call, exc, words):
    cache, a, b, k = ready
    with pytest.raises(exc, match=words):
        call(cache, a, b, k)


def test_append_needs_reserve_and_unshared_slot(rng):
    cache = _cache(ps=4)
    a = cache.allocate()
    cache.set_batch([a])
    k = rng.standard_normal((1, H, D)).astype(np.float16)
    with pytest.raises(ValueError, match="reserve"):
        cache.append(0, k, k)  # no token reserved yet
    cache.reserve(2)
    cache.append(0, k, k)
    cache.fork(a)  # forked after reserve: the slot is shared now
    with pytest.raises(ValueError, match="shared"):
        cache.append(0, k, k)
    with pytest.raises(ValueError, match="shared"):
        cache.extend(0, a, k, k)
    cache.reserve(1)  # copies the shared page: writable again
    cache.append(0, k, k)
    cache.extend(0, a, k, k)


def test_append_allowed_again_once_the_fork_is_freed(rng):
    cache = _cache(ps=4)
    a = cache.allocate()
    cache.set_batch([a])
    cache.reserve(1)
    b = cache.fork(a)  # the slot is shared
    k = rng.standard_normal((1, H, D)).astype(np.float16)
    with pytest.raises(ValueError, match="shared"):
        cache.append(0, k, k)
    cache.free(b)  # the page belongs to a alone again
    cache.append(0, k, k)
    gk, gv = _gather(cache, a)[0]
    assert np.array_equal(_bits(gk[-1]), _bits(k[0])) and np.array_equal(_bits(gv[-1]), _bits(k[0]))


# ---- kernel: compiles offline, the Python mirrors agree with the source ----------------------
def test_param_structs_match_compiler():
    for struct in (PAGED_APPEND_PARAMS, TABLE_UPDATE_PARAMS):
        ok, log = append_layout_check(struct)
        assert ok, log
    f = PAGED_APPEND_PARAMS.fields
    ok, log = append_layout_check(ParamStruct("PagedAppendParams", [f[1], f[0], *f[2:]]))
    assert not ok and "PagedAppendParams.k_src" in log  # the check does catch a mismatch
    off = PAGED_APPEND_PARAMS.offsets()  # C layout by hand: 6 pointers, 12 int64, 4 int32
    assert [off[n] for n in ("k_src", "seqlens", "k_src_row", "rows", "num_heads", "pos0")] == [
        0, 40, 48, 136, 144, 156]
    assert PAGED_APPEND_PARAMS.dtype.itemsize == 160
    assert list(TABLE_UPDATE_PARAMS.offsets().values()) == [0, 8, 16, 24, 32, 36]
    assert TABLE_UPDATE_PARAMS.dtype.itemsize == 40
    src = registry.kernel_source("paged_append.cu")
    assert int(re.search(r"constexpr int APPEND_THREADS = (\d+);", src).group(1)) == APPEND_THREADS


def test_config_names():
    c = PagedAppendConfig("fp16", 128, 16)
    assert c.key == "paged_append.f16.d128.p16.nhd" and c.source == "paged_append.cu"
    assert c.name_expression() == "fdpp::paged_append<fdpp::half_t,128,16,false>"
    assert PagedAppendConfig("bf16", 64, 1, True).name_expression() == "fdpp::paged_append<fdpp::bfloat16_t,64,1,true>"
    assert c.smem_bytes() == 0 and c.threads == APPEND_THREADS
    t = TableUpdateConfig()
    assert (t.key, t.name_expression(), t.source) == ("paged_table_update.t256", "fdpp::paged_table_update<256>",
                                                      "paged_append.cu")
    vb = {(dt, d): PagedAppendConfig(dt, d, 1).vec_bytes
          for dt, d in [("fp16", 128), ("fp16", 4), ("fp16", 2), ("fp16", 1), ("fp32", 1), ("fp32", 2)]}
    assert list(vb.values()) == [16, 8, 4, 2, 4, 8]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_append_variants_compile(arch):
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs the cuda-bindings NVRTC wheel")
    cfgs = append_compile_space(head_dims=(64, 96, 128, 256), page_sizes=(1, 2, 16, 64, 256))
    cfgs += [PagedAppendConfig(dt, d, 8) for dt in DTS for d in (1, 2, 6, 100)]  # narrow vectors
    cfgs += [TableUpdateConfig()]
    reports = registry.compile_offline(cfgs, arch)
    for c in cfgs:
        r = reports[c.key]
        assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), r
        assert r.registers * c.threads <= 65536 and r.static_smem == 0, r


def test_bad_page_size_fails_to_compile():
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs the cuda-bindings NVRTC wheel")
    with pytest.raises(registry.KernelCompileError, match="PAGE_SIZE"):
        registry.compile_offline([PagedAppendConfig("fp16", 64, 3)], "sm_90")


# ---- GPU: cupy and torch backends against the NumPy backend ---------------------------------
def _to_dev(backend):
    if backend == "cupy":
        import cupy

        return cupy.asarray
    import torch

    def conv(x):
        if x.dtype == DTYPES["bf16"].np_dtype:
            return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).cuda().view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(x)).cuda()

    return conv


def _assert_caches_equal(dev, ref):
    for layer in range(ref.num_layers):
        for a, b in ((dev.k_pages(layer), ref.k_pages(layer)), (dev.v_pages(layer), ref.v_pages(layer))):
            np.testing.assert_array_equal(_bits(dev.to_numpy(a)), _bits(b))
    np.testing.assert_array_equal(dev.to_numpy(dev.block_table), ref.block_table)
    np.testing.assert_array_equal(dev.to_numpy(dev.seqlens), ref.seqlens)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "torch"])
@pytest.mark.parametrize("dtype", DTS)
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_scenario_gpu_matches_numpy(rng, backend, dtype, kv_layout, page_size):
    if backend == "torch":
        pytest.importorskip("torch")
    seed = int(rng.integers(1 << 31))
    caches = [PagedKVCache(L, _pool_pages(page_size), page_size, H, D, dtype=dtype, kv_layout=kv_layout,
                           max_batch=8, backend=be) for be in (backend, "numpy")]
    conv = _to_dev(backend)
    run_scenario(caches[0], seed, lambda x, i=0: _variant(x, i, conv))
    run_scenario(caches[1], seed)
    _assert_caches_equal(*caches)


def _graph_setup(backend, rng, dtype="fp16"):
    caches = [PagedKVCache(L, 64, 16, H, D, dtype=dtype, max_batch=4, backend=be) for be in (backend, "numpy")]
    dt = DTYPES[dtype].np_dtype
    for c in caches:
        seqs = [c.allocate() for _ in range(3)]
    pre = {s: [(rng.standard_normal((n, H, D)).astype(dt), rng.standard_normal((n, H, D)).astype(dt))
               for _ in range(L)] for s, n in zip(seqs, (3, 14, 31), strict=True)}
    conv = _to_dev(backend)
    for c, to in zip(caches, (conv, _identity), strict=True):
        for s, kv in pre.items():
            c.extend_reserve(s, len(kv[0][0]))
            for layer, (k, v) in enumerate(kv):
                c.extend(layer, s, to(k), to(v))
        c.set_batch(seqs)
    steps = [rng.standard_normal((2, L, 3, H, D)).astype(dt) for _ in range(24)]
    return caches, seqs, steps, conv


def _graph_step(caches, seqs, i):
    """Host work between replays: a fork and a batch change at step 8 (same batch size)."""
    for c in caches:
        if i == 8:
            child = c.fork(seqs[1])
            c.set_batch([seqs[0], child, seqs[2]])
        c.reserve(1)


@pytest.mark.gpu
def test_cupy_graph_replays_append(rng):
    import cupy

    (dev, ref), seqs, steps, conv = _graph_setup("cupy", rng)
    kbuf, vbuf = conv(steps[0][0]), conv(steps[0][1])
    stream = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(cupy.cuda.get_current_stream().record())  # the work queued before (inputs) first
    with stream:
        _graph_step((dev, ref), seqs, 0)
        for layer in range(L):  # eager first: compiles the variant
            dev.append(layer, kbuf[layer], vbuf[layer])
            ref.append(layer, steps[0][0][layer], steps[0][1][layer])
        stream.begin_capture()
        for layer in range(L):
            dev.append(layer, kbuf[layer], vbuf[layer])
        graph = stream.end_capture()
        for i in range(1, len(steps)):
            _graph_step((dev, ref), seqs, i)
            kbuf[...] = conv(steps[i][0])
            vbuf[...] = conv(steps[i][1])
            graph.launch(stream)
            for layer in range(L):
                ref.append(layer, steps[i][0][layer], steps[i][1][layer])
        stream.synchronize()
    _assert_caches_equal(dev, ref)


@pytest.mark.gpu
def test_torch_graph_replays_append(rng):
    torch = pytest.importorskip("torch")
    (dev, ref), seqs, steps, conv = _graph_setup("torch", rng, "bf16")
    kbuf, vbuf = conv(steps[0][0]), conv(steps[0][1])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _graph_step((dev, ref), seqs, 0)
        for layer in range(L):
            dev.append(layer, kbuf[layer], vbuf[layer])
            ref.append(layer, steps[0][0][layer], steps[0][1][layer])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(L):
            dev.append(layer, kbuf[layer], vbuf[layer])
    for i in range(1, len(steps)):
        _graph_step((dev, ref), seqs, i)
        kbuf.copy_(conv(steps[i][0]))
        vbuf.copy_(conv(steps[i][1]))
        graph.replay()
        for layer in range(L):
            ref.append(layer, steps[i][0][layer], steps[i][1][layer])
    torch.cuda.synchronize()
    _assert_caches_equal(dev, ref)


@pytest.mark.gpu
def test_kernel_skips_bad_rows(rng):
    import cupy

    cache = PagedKVCache(1, 32, 16, H, D, max_batch=8, max_pages_per_seq=4, backend="cupy")
    seqs = [cache.allocate() for _ in range(5)]
    cache.set_batch(seqs)
    cache.reserve(3)
    k = cupy.asarray(rng.standard_normal((5, H, D)).astype(np.float16))
    cache._len_dev[:5] = cupy.asarray(np.array([0, 4 * 16 + 1, 3, 3, 3], np.int32))  # pos -1, beyond
    cache._bt_dev[2, 0] = -1  # entries outside [0, num_pages)
    cache._bt_dev[3, 0] = 32
    before = cupy.asnumpy(cache.k_pages(0)).copy()
    cache.append(0, k, k)
    after = cupy.asnumpy(cache.k_pages(0))
    page4 = cache.pages(seqs[4])[0]
    changed = np.flatnonzero((_bits(after) != _bits(before)).any(axis=(1, 2, 3)))
    assert changed.tolist() == [page4]
    np.testing.assert_array_equal(_bits(after[page4, 2]), _bits(cupy.asnumpy(k[4])))
    changed_slots = np.flatnonzero((_bits(after[page4]) != _bits(before[page4])).any(axis=(1, 2)))
    assert changed_slots.tolist() == [2]


def test_to_numpy_is_a_copy_on_the_numpy_backend():
    """It returned a live view: writing into the "host copy" of seqlens moved later appends."""
    c = PagedKVCache(1, 8, 4, 1, 64, backend="numpy", max_batch=1)
    s = c.allocate()
    c.set_batch([s])
    c.reserve(5)
    lens = c.to_numpy(c.seqlens)
    lens[0] -= 1
    pool = c.to_numpy(c.k_pages(0))
    pool[...] = 7
    assert int(c.seqlens[0]) == 5 and not (c.k_pages(0) == 7).any()
    with pytest.raises(ValueError, match="layer"):
        c.attention_kwargs(99)
