"""PagedKVCache + paged_decode_attention end to end: prefill, then 50 decode steps of
reserve -> append (every layer) -> attention, compared at every step with the float64 reference
over the same tokens kept in plain per-sequence lists, and (GPU) bit for bit with the contiguous
decode_attention over a cache holding the same tokens (one split: same chunk, same grid)."""

import dataclasses
import warnings

import numpy as np
import pytest

import fdpp
from fdpp import configs, dispatch
from fdpp.dtypes import DTYPES
from fdpp.reference import assert_close, attention_reference

L, HQ, HKV, D = 2, 8, 2, 64


def _run(backend, page, layout, rng, steps=50, dtype="fp16"):
    np_dt = DTYPES[dtype].np_dtype
    per_seq = max(1, 160 // page)
    cache = fdpp.PagedKVCache(L, 3 * per_seq + 4, page, HKV, D, dtype=dtype, kv_layout=layout, max_batch=4,
                              max_pages_per_seq=per_seq, backend=backend)
    xp = _xp(backend)
    seqs = [cache.allocate() for _ in range(3)]
    toks = {s: [[] for _ in range(L)] for s in seqs}  # seq -> layer -> list of (k, v) rows
    for s, n in zip(seqs, (0, 19, 40), strict=True):
        if n:
            cache.extend_reserve(s, n)
            for layer in range(L):
                k, v = (rng.standard_normal((n, HKV, D)).astype(np_dt) for _ in range(2))
                cache.extend(layer, s, xp(k), xp(v))
                toks[s][layer] += list(zip(k, v, strict=True))
    cache.set_batch(seqs)
    for step in range(steps):
        cache.reserve(1)
        for layer in range(L):
            k, v = (rng.standard_normal((3, HKV, D)).astype(np_dt) for _ in range(2))
            cache.append(layer, xp(k), xp(v))
            for i, s in enumerate(seqs):
                toks[s][layer].append((k[i], v[i]))
            q = rng.standard_normal((3, HQ, D)).astype(np_dt)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                out = fdpp.paged_decode_attention(xp(q), cache.k_pages(layer), cache.v_pages(layer),
                                                  cache.block_table, cache.seqlens, kv_layout=layout)
            kc, vc, lens = _contiguous(toks, seqs, layer, cache.max_pages_per_seq * page, np_dt, layout)
            ref, _ = attention_reference(q, kc, vc, lens, kv_layout=layout)
            assert_close(cache.to_numpy(out), ref, dtype)
            if backend != "numpy" and step % 10 == 0:  # the same variant, one split: bit for bit
                cfg = configs.DecodeConfig(dtype, D, HQ // HKV, 4, 3, 1, mma=True)
                with dispatch.forced_plan(configs.LaunchPlan.split_kv(cfg, 1)):
                    same = fdpp.decode_attention(xp(q), xp(kc), xp(vc), cache_seqlens=xp(lens), kv_layout=layout)
                with dispatch.forced_plan(configs.LaunchPlan.split_kv(dataclasses.replace(cfg, page_size=page), 1)):
                    one = fdpp.paged_decode_attention(xp(q), cache.k_pages(layer), cache.v_pages(layer),
                                                      cache.block_table, cache.seqlens, kv_layout=layout)
                np.testing.assert_array_equal(cache.to_numpy(one), cache.to_numpy(same))
    assert [cache.length(s) for s in seqs] == [steps, 19 + steps, 40 + steps]


def _contiguous(toks, seqs, layer, n_max, np_dt, layout):
    k = np.zeros((len(seqs), n_max, HKV, D), np_dt)
    v = np.zeros_like(k)
    lens = np.array([len(toks[s][layer]) for s in seqs], np.int32)
    for i, s in enumerate(seqs):
        for t, (kr, vr) in enumerate(toks[s][layer]):
            k[i, t], v[i, t] = kr, vr
    if layout == "HND":
        k, v = k.transpose(0, 2, 1, 3).copy(), v.transpose(0, 2, 1, 3).copy()
    return k, v, lens


def _xp(backend):
    if backend == "numpy":
        return np.asarray
    if backend == "cupy":
        import cupy

        return cupy.asarray
    import torch

    return lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()


@pytest.mark.parametrize("page, layout", [(1, "NHD"), (16, "HND"), (64, "NHD")])
def test_numpy_backend(page, layout, rng):
    _run("numpy", page, layout, rng, steps=20)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "torch"])
@pytest.mark.parametrize("page, layout", [(1, "NHD"), (16, "NHD"), (16, "HND"), (256, "NHD")])
def test_gpu_backends(backend, page, layout, rng):
    if backend == "torch":
        pytest.importorskip("torch")
    _run(backend, page, layout, rng)
