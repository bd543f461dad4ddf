"""Paged-cache test helpers shared by the CPU and GPU quantized-cache tests (no GPU needed to import)."""

import numpy as np


def _same(x):
    return x


def fill_sequences(cache, lengths, rng, to_array=_same):
    """Allocate one sequence of ``cache`` per entry of ``lengths``, write that many random fp16 tokens
    into layer 0 (K ~ 2 N(0, 1), then V ~ N(0, 1); each passed through ``to_array``, e.g.
    cupy.asarray for a CuPy cache) and make them the batch. Returns the sequences."""
    hkv, d = cache.num_kv_heads, cache.head_dim
    seqs = [cache.allocate() for _ in lengths]
    for s, n in zip(seqs, lengths, strict=True):
        cache.extend_reserve(s, n)
        cache.extend(0, s, to_array((rng.standard_normal((n, hkv, d)) * 2).astype(np.float16)),
                     to_array(rng.standard_normal((n, hkv, d)).astype(np.float16)))
    cache.set_batch(seqs)
    return seqs


def ragged_table(rng, lens, page, spare=3):
    """A block table for requests of ``lens`` tokens in pages of ``page``: every request gets its own
    pages, drawn in a random order from a pool with ``spare`` unused pages; entries past a request's
    pages are 0. Returns (table int32 [B, max pages], pool size)."""
    pages_per = -(-np.asarray(lens) // page)
    num_pages = int(pages_per.sum()) + spare
    perm = rng.permutation(num_pages)
    table = np.zeros((len(pages_per), int(pages_per.max())), np.int32)
    nxt = 0
    for i, p in enumerate(pages_per):
        table[i, :p] = perm[nxt:nxt + p]
        nxt += p
    return table, num_pages
