"""Property-based tests (hypothesis) of the public API on the NumPy path, and of PagedKVCache.

The property, for ``decode_attention``, ``decode_attention_nosplit``, ``paged_decode_attention`` and
``flat_gemm``: every input either matches the float64 reference within the dtype's tolerance
(``fdpp.reference.assert_close``) or raises ValueError/TypeError whose message names the offending
argument; never any other exception, and the inputs are never modified.

Each example is a valid call (random shapes, dtypes, strided / transposed / negative-stride /
read-only views, NHD and HND, paged pools with shuffled and shared pages and garbage in the unused
block-table entries, lengths from 0 to the capacity, split counts, scales, ``out``) to which at
most one mutation is applied. A mutation knows which argument it breaks, so the test also checks
the other direction: a call with no mutation must not raise (``decode_attention_nosplit`` on a
machine without a GPU raises its documented RuntimeError instead). The NumPy path runs as on a
machine without a GPU everywhere (fixture ``numpy_emulator``).

Gaps found by these tests are pinned by the ``test_gap_*`` tests at the end, marked
``xfail(strict=True)``: they fail today and turn into an XPASS (a failure) once fdpp is fixed,
so the marker is then removed. The property skips only the name check for those inputs (see
``NAME_GAP``), never the exception-type check.

Sizes are small (N <= ~300 tokens, a few heads) and every test is derandomised (hypothesis'
database off), so a run is reproducible and the file stays well under a minute on one core.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

import fdpp  # noqa: E402
from fdpp import api  # noqa: E402
from fdpp.cache import OutOfPagesError, PagedKVCache  # noqa: E402
from fdpp.configs import HEAD_DIMS, PAGE_SIZES  # noqa: E402
from fdpp.reference import assert_close, attention_reference, paged_attention_reference  # noqa: E402

NP_DT = {"fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16), "fp32": np.dtype(np.float32)}
DTS = tuple(NP_DT)
UNSUPPORTED = (np.float64, np.int32, np.int8, np.complex64, np.bool_, np.uint16)
#: Names for a mutation whose error message is known not to name the argument (pinned by a
#: ``test_gap_*`` test): only the exception type is checked for it.
NAME_GAP = ("<known gap: message does not name the argument>",)


@pytest.fixture(autouse=True)
def numpy_emulator(monkeypatch):
    """The NumPy path as on a machine without a GPU (the split-KV emulator and NumPy's GEMM), on
    every machine: the GPU kernels are tested by tests/test_gpu_*.py, and random shapes here would
    compile hundreds of kernel variants there."""
    monkeypatch.setattr(api, "gpu_available", lambda: False)


def _settings(n: int, **kw: Any) -> settings:
    return settings(max_examples=n, derandomize=True, database=None, deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much], **kw)


# ---- arrays ---------------------------------------------------------------------------------
def _rand(r: np.random.Generator, shape: tuple[int, ...], dt: str, scale: float = 1.0) -> np.ndarray:
    return (r.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(NP_DT[dt])


VIEWS = ("c", "f", "sliced", "step", "neg", "perm", "readonly", "dstride")


def _as_view(x: np.ndarray, kind: str, r: np.random.Generator) -> np.ndarray:
    """An array with the logical contents of ``x`` and the memory layout ``kind``."""
    if kind == "c" or x.size == 0:
        return x
    if kind == "f":
        return np.asfortranarray(x)
    if kind == "sliced":  # inside a larger buffer, at an offset along every axis
        pad = tuple(int(p) for p in r.integers(0, 3, size=x.ndim))
        big = np.zeros(tuple(n + 2 * p for n, p in zip(x.shape, pad, strict=True)), x.dtype)
        sl = tuple(slice(p, p + n) for n, p in zip(x.shape, pad, strict=True))
        big[sl] = x
        return big[sl]
    if kind == "step":  # every other row along one axis
        ax = int(r.integers(0, x.ndim))
        shape = list(x.shape)
        shape[ax] *= 2
        big = np.zeros(shape, x.dtype)
        sl = tuple(slice(None, None, 2) if i == ax else slice(None) for i in range(x.ndim))
        big[sl] = x
        return big[sl]
    if kind == "neg":  # negative strides along one axis
        ax = int(r.integers(0, x.ndim))
        flip = tuple(slice(None, None, -1) if i == ax else slice(None) for i in range(x.ndim))
        return np.ascontiguousarray(x[flip])[flip]
    if kind == "perm":  # stored in another axis order, seen through a transpose
        perm = tuple(int(i) for i in r.permutation(x.ndim))
        inv = tuple(int(i) for i in np.argsort(perm))
        return np.ascontiguousarray(x.transpose(perm)).transpose(inv)
    if kind == "readonly":
        y = x.copy()
        y.flags.writeable = False
        return y
    if kind == "dstride":  # a stride of 2 elements in the last axis
        big = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
        big[..., ::2] = x
        return big[..., ::2]
    raise AssertionError(kind)


def _bits(a: Any) -> Any:
    if not isinstance(a, np.ndarray):
        return a
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).copy() if a.dtype != object else a.copy()


def _canonical_out(shape: tuple[int, ...], dtype: np.dtype, r: np.random.Generator, offset: bool) -> np.ndarray:
    """A C-contiguous output with canonical strides, NaN-filled (poisoned), optionally at an odd
    element offset in a larger buffer (NumPy has no alignment rule)."""
    size = math.prod(shape)
    off = int(r.integers(1, 4)) if offset else 0
    buf = np.full(size + off, np.nan, dtype=np.float32).astype(dtype)
    return buf[off:off + size].reshape(shape)


# ---- cases ----------------------------------------------------------------------------------
@dataclass
class Case:
    fn: str
    args: list[Any]
    kw: dict[str, Any]
    dt: str
    layout: str = "NHD"
    checks: bool = False
    mutation: str | None = None
    names: tuple[str, ...] = ()  # an error must name one of these
    meta: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:  # what hypothesis prints for a falsifying example
        return f"Case<{self.describe()}>"

    def describe(self) -> str:
        def shp(x: Any) -> str:
            if isinstance(x, np.ndarray):
                return f"ndarray{x.shape}:{x.dtype}:strides{x.strides}"
            return repr(x)[:60]

        return (f"{self.fn}({', '.join(shp(a) for a in self.args)}, "
                f"{', '.join(f'{k}={shp(v)}' for k, v in self.kw.items())}) mutation={self.mutation} "
                f"checks={self.checks}")


def _scale(draw: Any, d: int) -> Any:
    kind = draw(st.sampled_from(["none", "none", "float", "zero", "np32", "np64", "int0"]))
    if kind == "none":
        return None
    if kind == "zero":
        return 0.0
    if kind == "int0":
        return 0
    x = draw(st.floats(-2.0, 2.0, allow_nan=False)) / math.sqrt(d)
    return {"float": float, "np32": np.float32, "np64": np.float64}[kind](x)


def _splits(draw: Any, n: int) -> Any:
    kind = draw(st.sampled_from(["none", "none", "small", "list", "np"]))
    if kind == "none":
        return None
    if kind == "small":
        return draw(st.integers(1, max(1, n + 2)))
    if kind == "np":
        return np.int64(draw(st.integers(1, 64)))
    return draw(st.sampled_from([1, 2, 3, 7, 64, 1023, 1024]))


def _lens(draw: Any, r: np.random.Generator, b: int, cap: int, required: bool) -> Any:
    kinds = ["int32", "int32", "int64", "uint16", "uint32"] + ([] if required else ["none", "none"])
    kind = draw(st.sampled_from(kinds))
    if kind == "none":
        return None
    vals = draw(st.lists(st.one_of(st.integers(0, cap), st.sampled_from([0, cap, max(0, cap - 1), min(1, cap)])),
                         min_size=b, max_size=b))
    return np.asarray(vals, dtype=kind)


# -- mutations shared by the contiguous and paged calls (they edit Case in place) -------------
def _mut_scalars(draw: Any, c: Case) -> tuple[str, tuple[str, ...]]:
    which = draw(st.sampled_from(["kv_layout", "softmax_scale", "num_splits"] if c.fn != "decode_attention_nosplit"
                                 else ["kv_layout", "softmax_scale"]))
    if which == "kv_layout":
        c.kw["kv_layout"] = draw(st.sampled_from(["nhd", "BHND", "NDH", "", None, 0, ("NHD",)]))
    elif which == "softmax_scale":
        c.kw["softmax_scale"] = draw(st.sampled_from(
            [float("nan"), float("inf"), -float("inf"), "0.1", True, 1j, np.array(0.1), [0.1], np.float32("nan")]))
    else:
        c.kw["num_splits"] = draw(st.sampled_from([0, -1, 1025, 2**40, 2.0, True, "4", np.float64(2)]))
    return which, (which,)


def _mut_out(draw: Any, c: Case, b: int, hq: int, d: int, inputs: dict[str, np.ndarray]) -> tuple[str, tuple[str, ...]]:
    dt = NP_DT[c.dt]
    kind = draw(st.sampled_from(["shape", "dtype", "unsupported", "noncontig", "overlap", "list", "readonly"]))
    if kind == "shape":
        shape = draw(st.sampled_from([(b, hq, d + 1), (b + 1, hq, d), (b, hq * d), (b, hq, d, 1), (b, hq + 1, d)]))
        c.kw["out"] = np.zeros(shape, dt)
    elif kind == "dtype":
        c.kw["out"] = np.zeros((b, hq, d), draw(st.sampled_from([x for x in NP_DT.values() if x != dt])))
    elif kind == "unsupported":
        c.kw["out"] = np.zeros((b, hq, d), draw(st.sampled_from(UNSUPPORTED)))
        return "out:unsupported_dtype", NAME_GAP
    elif kind == "noncontig":
        opts = [np.zeros((b, hq, 2 * d), dt)[..., ::2], np.zeros((b, d, hq), dt).transpose(0, 2, 1)]
        if hq > 1:
            opts.append(np.zeros((b, 2 * hq, d), dt)[:, ::2])
        if b > 1:
            opts.append(np.zeros((hq, b, d), dt).transpose(1, 0, 2))
        opts = [o for o in opts if not o.flags.c_contiguous]
        c.kw["out"] = opts[draw(st.integers(0, len(opts) - 1))]
    elif kind == "overlap":
        name = draw(st.sampled_from(sorted(inputs)))
        x = inputs[name]
        size = b * hq * d
        if x.dtype == dt and x.flags.c_contiguous and x.size >= size:
            c.kw["out"] = x.reshape(-1)[:size].reshape(b, hq, d)  # aliasing the input itself
        else:  # the input re-made inside a byte buffer whose first half out also covers
            out_bytes = size * dt.itemsize
            off = (out_bytes // 2) // 8 * 8
            raw = np.zeros(off + x.nbytes + out_bytes, np.uint8)
            y = raw[off:off + x.nbytes].view(x.dtype).reshape(x.shape)
            y[...] = x
            _replace_input(c, name, y)
            c.kw["out"] = raw[:out_bytes].view(dt).reshape(b, hq, d)
        return f"out:overlap:{name}", ("out",)
    elif kind == "list":
        c.kw["out"] = np.zeros((b, hq, d), dt).tolist()
    else:  # read-only
        o = np.zeros((b, hq, d), dt)
        o.flags.writeable = False
        c.kw["out"] = o
        return "out:readonly", NAME_GAP
    return f"out:{kind}", ("out",)


def _replace_input(c: Case, name: str, y: np.ndarray) -> None:
    pos = c.meta["arg_pos"]
    if name in pos:
        c.args[pos[name]] = y
    else:
        c.kw[name] = y


def _mut_lens(draw: Any, c: Case, b: int, cap: int, required: bool) -> tuple[str, tuple[str, ...]]:
    kind = draw(st.sampled_from(["big", "neg", "shape", "dtype", "list"] + (["none"] if required else [])))
    if required:
        base = c.args[4]
    else:
        base = c.kw.get("cache_seqlens")
        base = np.full(b, cap) if base is None else base
    lens = np.asarray(base, dtype=np.int64).copy()
    if kind == "big":
        lens[draw(st.integers(0, b - 1))] = cap + draw(st.sampled_from([1, 2, 1000, 2**31 - 1 - cap]))
        new: Any = lens.astype(np.int32)
    elif kind == "neg":
        lens[draw(st.integers(0, b - 1))] = draw(st.sampled_from([-1, -2, -(2**31)]))
        new = lens.astype(np.int32)
    elif kind == "shape":
        new = draw(st.sampled_from([np.zeros(b + 1, np.int32), np.zeros((b, 1), np.int32), np.array(0, np.int32),
                                    np.zeros(0, np.int32), np.zeros((1, b), np.int32)]))
    elif kind == "dtype":
        new = lens.astype(draw(st.sampled_from([np.float32, np.float64, np.bool_, np.complex64])))
    elif kind == "list":
        new = lens.tolist()
    else:
        new = None
    if required:
        c.args[4] = new
    else:
        c.kw["cache_seqlens"] = new
    return f"cache_seqlens:{kind}", ("cache_seqlens",)


# -- contiguous -------------------------------------------------------------------------------
CONTIG_MUTATIONS = ("none", "q_ndim", "k_ndim", "v_ndim", "v_shape", "kv_batch", "heads", "zero_batch", "head_dim",
                    "k_head_dim", "v_head_dim", "k_dtype", "v_dtype", "unsupported_dtype", "array_type",
                    "missing", "scalars", "lens", "out")


@st.composite
def contiguous_cases(draw: Any, mut: str = "none") -> Case:
    r = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    fn = draw(st.sampled_from(["decode_attention"] * 4 + ["decode_attention_nosplit"]))
    b, hkv, ratio = draw(st.integers(1, 5)), draw(st.integers(1, 4)), draw(st.integers(1, 8))
    d = draw(st.sampled_from(HEAD_DIMS))
    n = draw(st.integers(1, 96))
    dt = draw(st.sampled_from(DTS))
    layout = draw(st.sampled_from(["NHD", "HND"]))
    hq = hkv * ratio
    kshape = (b, n, hkv, d) if layout == "NHD" else (b, hkv, n, d)
    q = _as_view(_rand(r, (b, hq, d), dt), draw(st.sampled_from(VIEWS)), r)
    k = _as_view(_rand(r, kshape, dt), draw(st.sampled_from(VIEWS)), r)
    v = _as_view(_rand(r, kshape, dt), draw(st.sampled_from(VIEWS)), r)
    kw: dict[str, Any] = {"kv_layout": layout, "softmax_scale": _scale(draw, d),
                          "return_lse": draw(st.booleans()), "cache_seqlens": _lens(draw, r, b, n, False)}
    if fn == "decode_attention":
        kw["num_splits"] = _splits(draw, n)
    out_kind = draw(st.sampled_from(["none", "none", "c", "offset"]))
    if out_kind != "none":
        kw["out"] = _canonical_out((b, hq, d), NP_DT[dt], r, out_kind == "offset")
    c = Case(fn, [q, k, v], kw, dt, layout, checks=draw(st.booleans()),
             meta={"arg_pos": {"q": 0, "k_cache": 1, "v_cache": 2}})
    if mut == "none":
        return c
    c.mutation, c.names = _contig_mutation(draw, c, mut, r, b, hq, hkv, d, n, kshape)
    return c


def _contig_mutation(draw: Any, c: Case, mut: str, r: np.random.Generator, b: int, hq: int, hkv: int, d: int,
                     n: int, kshape: tuple[int, ...]) -> tuple[str, tuple[str, ...]]:
    q, k, v = c.args
    dt, layout = c.dt, c.layout

    def kv_shape(bb: int, hh: int, dd: int, nn: int = n) -> tuple[int, ...]:
        return (bb, nn, hh, dd) if layout == "NHD" else (bb, hh, nn, dd)

    if mut == "q_ndim":
        c.args[0] = draw(st.sampled_from([q[0], q[..., None], q.reshape(-1), q[None]]))
        return mut, ("q",)
    if mut in ("k_ndim", "v_ndim"):
        i = 1 if mut == "k_ndim" else 2
        x = c.args[i]
        c.args[i] = draw(st.sampled_from([x[0], x[..., None]]))
        return mut, ("k_cache",) if i == 1 else ("v_cache",)
    if mut == "v_shape":
        c.args[2] = _rand(r, kv_shape(b, hkv, d, n + 1), dt)
        return mut, ("v_cache",)
    if mut == "kv_batch":
        bb = b + draw(st.sampled_from([1, 2])) if b == 1 or draw(st.booleans()) else b - 1
        c.args[1], c.args[2] = _rand(r, kv_shape(bb, hkv, d), dt), _rand(r, kv_shape(bb, hkv, d), dt)
        c.kw.pop("cache_seqlens", None)
        return mut, ("k_cache", "q")
    if mut == "heads":  # Hq not a multiple of Hkv, or no heads
        opts = [h for h in range(0, 7) if h == 0 or hq % h]
        hh = draw(st.sampled_from(opts))
        c.args[1], c.args[2] = _rand(r, kv_shape(b, hh, d), dt), _rand(r, kv_shape(b, hh, d), dt)
        return mut, ("num_q_heads", "num_kv_heads", "q", "k_cache")
    if mut == "zero_batch":
        c.args[0] = q[:0]
        c.args[1], c.args[2] = _rand(r, kv_shape(0, hkv, d), dt), _rand(r, kv_shape(0, hkv, d), dt)
        c.kw.pop("cache_seqlens", None)
        c.kw.pop("out", None)
        return mut, ("batch", "q")
    if mut == "head_dim":  # not a supported head_dim (q, k and v agree)
        dd = draw(st.sampled_from([0, 1, 8, 16, 32, 48, 80, 100, 112, 160, 192, 255, 257, 320, 512]))
        c.args[0] = _rand(r, (b, hq, dd), dt)
        c.args[1], c.args[2] = _rand(r, kv_shape(b, hkv, dd), dt), _rand(r, kv_shape(b, hkv, dd), dt)
        c.kw.pop("out", None)
        return mut, ("head_dim", "q")
    if mut in ("k_head_dim", "v_head_dim"):
        dd = draw(st.sampled_from([x for x in HEAD_DIMS if x != d] + [d + 8]))
        if mut == "k_head_dim":
            c.args[1], c.args[2] = _rand(r, kv_shape(b, hkv, dd), dt), _rand(r, kv_shape(b, hkv, dd), dt)
            return mut, ("k_cache",)
        c.args[2] = _rand(r, kv_shape(b, hkv, dd), dt)
        return mut, ("v_cache",)
    if mut in ("k_dtype", "v_dtype"):
        i = 1 if mut == "k_dtype" else 2
        c.args[i] = c.args[i].astype(draw(st.sampled_from([x for x in NP_DT.values() if x != NP_DT[dt]])))
        return mut, ("k_cache",) if i == 1 else ("v_cache",)
    if mut == "unsupported_dtype":
        i = draw(st.integers(0, 2))
        c.args[i] = c.args[i].astype(draw(st.sampled_from(UNSUPPORTED)))
        return f"{mut}:{('q', 'k_cache', 'v_cache')[i]}", NAME_GAP
    if mut == "array_type":
        which = draw(st.sampled_from(["q", "k_cache", "v_cache", "q_scalar"]))
        if which == "q_scalar":
            c.args[0] = q.reshape(-1)[0]
            return mut, ("q",)
        i = ("q", "k_cache", "v_cache").index(which)
        c.args[i] = draw(st.sampled_from([c.args[i].tolist(), tuple(c.args[i].reshape(-1).tolist()[:4]), "array"]))
        return f"{mut}:{which}", (which,)
    if mut == "missing":  # q only: None for k_cache / v_cache raises KeyError (test_gap_required_array_none)
        c.args[0] = None
        return mut, ("q",)
    if mut == "scalars":
        return _mut_scalars(draw, c)
    if mut == "lens":
        return _mut_lens(draw, c, b, n, False)
    if mut == "out":
        return _mut_out(draw, c, b, hq, d, {"q": q, "k_cache": k, "v_cache": v})
    raise AssertionError(mut)


# -- paged ------------------------------------------------------------------------------------
PAGED_MUTATIONS = ("none", "page_size", "no_pages", "pool_shape", "pool_dtype", "unsupported_dtype", "pool_ndim",
                   "heads", "head_dim", "table_type", "table_shape", "table_entry", "lens", "scalars", "out",
                   "missing")


@st.composite
def paged_cases(draw: Any, mut: str = "none") -> Case:
    r = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    b, hkv, ratio = draw(st.integers(1, 5)), draw(st.integers(1, 4)), draw(st.integers(1, 8))
    d = draw(st.sampled_from(HEAD_DIMS))
    page = draw(st.sampled_from(PAGE_SIZES))
    width = draw(st.integers(1, max(1, 256 // page)))
    cap = width * page
    dt = draw(st.sampled_from(DTS))
    layout = draw(st.sampled_from(["NHD", "HND"]))
    hq = hkv * ratio
    lens = _lens(draw, r, b, cap, True)
    used = [-(-int(x) // page) for x in lens]
    sharing = draw(st.sampled_from(["distinct", "distinct", "prefix", "same"]))
    spare = draw(st.integers(0, 3))
    if sharing == "same":  # every request reads the same pages
        num_pages = max(used) + spare + 1
        perm = r.permutation(num_pages)
        rows = [list(perm[:u]) for u in used]
    elif sharing == "prefix":  # a shared prompt, then pages of their own
        pre = min(used) if draw(st.booleans()) else min(used) // 2
        own = [u - pre for u in used]
        num_pages = pre + sum(own) + spare + 1
        perm = r.permutation(num_pages)
        rows, nxt = [], pre
        for o in own:
            rows.append(list(perm[:pre]) + list(perm[nxt:nxt + o]))
            nxt += o
    else:
        num_pages = sum(used) + spare + 1
        perm, rows, nxt = r.permutation(num_pages), [], 0
        for u in used:
            rows.append(list(perm[nxt:nxt + u]))
            nxt += u
    garbage = draw(st.sampled_from(["zero", "random", "huge"]))
    table = np.zeros((b, width), np.int64)
    for i, row in enumerate(rows):
        table[i, :len(row)] = row
        rest = width - len(row)
        if garbage == "random":
            table[i, len(row):] = r.integers(-5, 3 * num_pages + 5, size=rest)
        elif garbage == "huge":
            table[i, len(row):] = r.choice([-(2**31), 2**31 - 1, -1, num_pages], size=rest)
    table = _as_view(table.astype(draw(st.sampled_from([np.int32, np.int32, np.int64]))),
                     draw(st.sampled_from(["c", "f", "sliced", "neg"])), r)
    pshape = (num_pages, page, hkv, d) if layout == "NHD" else (num_pages, hkv, page, d)
    q = _as_view(_rand(r, (b, hq, d), dt), draw(st.sampled_from(VIEWS)), r)
    kp = _as_view(_rand(r, pshape, dt), draw(st.sampled_from(VIEWS)), r)
    vp = _as_view(_rand(r, pshape, dt), draw(st.sampled_from(VIEWS)), r)
    kw: dict[str, Any] = {"kv_layout": layout, "softmax_scale": _scale(draw, d), "return_lse": draw(st.booleans()),
                          "num_splits": _splits(draw, cap)}
    out_kind = draw(st.sampled_from(["none", "none", "c", "offset"]))
    if out_kind != "none":
        kw["out"] = _canonical_out((b, hq, d), NP_DT[dt], r, out_kind == "offset")
    c = Case("paged_decode_attention", [q, kp, vp, table, lens], kw, dt, layout, checks=draw(st.booleans()),
             meta={"arg_pos": {"q": 0, "k_pages": 1, "v_pages": 2, "block_table": 3, "cache_seqlens": 4},
                   "num_pages": num_pages, "page": page, "width": width})
    if mut == "none":
        return c
    c.mutation, c.names = _paged_mutation(draw, c, mut, r, b, hq, hkv, d, page, num_pages, width)
    return c


def _paged_mutation(draw: Any, c: Case, mut: str, r: np.random.Generator, b: int, hq: int, hkv: int, d: int,
                    page: int, num_pages: int, width: int) -> tuple[str, tuple[str, ...]]:
    q, kp, vp, table, lens = c.args
    dt, layout = c.dt, c.layout

    def pool(pages: int = num_pages, ps: int = page, hh: int = hkv, dd: int = d) -> np.ndarray:
        return _rand(r, (pages, ps, hh, dd) if layout == "NHD" else (pages, hh, ps, dd), dt)

    if mut == "page_size":
        ps = draw(st.sampled_from([3, 5, 12, 24, 48, 100, 384, 512]))
        c.args[1], c.args[2] = pool(ps=ps), pool(ps=ps)
        return mut, ("page_size", "k_pages")
    if mut == "no_pages":
        c.args[1], c.args[2] = pool(pages=0), pool(pages=0)
        return mut, ("k_pages",)
    if mut == "pool_shape":
        c.args[2] = pool(pages=num_pages + 1)
        return mut, ("v_pages",)
    if mut == "pool_dtype":
        i = draw(st.sampled_from([1, 2]))
        c.args[i] = c.args[i].astype(draw(st.sampled_from([x for x in NP_DT.values() if x != NP_DT[dt]])))
        return mut, ("k_pages",) if i == 1 else ("v_pages",)
    if mut == "unsupported_dtype":
        i = draw(st.sampled_from([0, 1, 2]))
        c.args[i] = c.args[i].astype(draw(st.sampled_from(UNSUPPORTED)))
        return f"{mut}:{('q', 'k_pages', 'v_pages')[i]}", NAME_GAP
    if mut == "pool_ndim":
        i = draw(st.sampled_from([1, 2]))
        c.args[i] = draw(st.sampled_from([c.args[i][0], c.args[i][None]]))
        return mut, ("k_pages",) if i == 1 else ("v_pages",)
    if mut == "heads":
        opts = [h for h in range(0, 7) if h == 0 or hq % h]
        hh = draw(st.sampled_from(opts))
        c.args[1], c.args[2] = pool(hh=hh), pool(hh=hh)
        return mut, ("num_q_heads", "num_kv_heads", "q", "k_pages")
    if mut == "head_dim":
        dd = draw(st.sampled_from([x for x in HEAD_DIMS if x != d] + [d + 8, 80]))
        if draw(st.booleans()):
            c.args[1], c.args[2] = pool(dd=dd), pool(dd=dd)
            return mut + ":k", ("k_pages",)
        c.args[0] = _rand(r, (b, hq, dd), dt)
        c.args[1], c.args[2] = pool(dd=dd), pool(dd=dd)
        c.kw.pop("out", None)
        if dd in HEAD_DIMS:  # a consistent call with another head_dim: valid
            return "none:other_head_dim", ()
        return mut + ":q", ("head_dim", "q")
    if mut == "table_type":
        c.args[3] = draw(st.sampled_from([np.asarray(table).astype(np.float32), np.asarray(table).astype(np.bool_),
                                          np.asarray(table).tolist(), None, np.asarray(table).astype(np.float64)]))
        return mut, ("block_table",)
    if mut == "table_shape":
        t = np.asarray(table)
        c.args[3] = draw(st.sampled_from([t[0], t[None], np.concatenate([t, t[:1]]), t[:0] if b > 0 else t[None]]))
        return mut, ("block_table",)
    if mut == "table_entry":  # a page a request uses lies outside the pool
        t = np.asarray(table).astype(np.int64).copy()
        ln = np.asarray(lens, dtype=np.int64).copy()
        i = draw(st.integers(0, b - 1))
        if ln[i] == 0:
            ln[i] = draw(st.integers(1, width * page))
            c.args[4] = ln.astype(np.int32)
        j = draw(st.integers(0, -(-int(ln[i]) // page) - 1))
        t[i, j] = draw(st.sampled_from([num_pages, num_pages + 7, -1, -(2**31), 2**31 - 1]))
        c.args[3] = t.astype(np.int32)
        return mut, ("block_table",)
    if mut == "lens":
        return _mut_lens(draw, c, b, width * page, True)
    if mut == "scalars":
        return _mut_scalars(draw, c)
    if mut == "out":
        return _mut_out(draw, c, b, hq, d, {"q": q, "k_pages": kp, "v_pages": vp, "block_table": table})
    if mut == "missing":  # q only: None for k_pages / v_pages raises KeyError (test_gap_required_array_none)
        c.args[0] = None
        return mut, ("q",)
    raise AssertionError(mut)


# ---- the property ---------------------------------------------------------------------------
def _reference(c: Case) -> tuple[np.ndarray, np.ndarray]:
    scale = c.kw.get("softmax_scale")
    if c.fn == "paged_decode_attention":
        q, kp, vp, table, lens = c.args
        return paged_attention_reference(q, kp, vp, table, lens, scale, c.layout)
    q, k, v = c.args
    return attention_reference(q, k, v, c.kw.get("cache_seqlens"), scale, c.layout)


def check_case(c: Case) -> str:
    """Run one case; returns "ok", "rejected" or "gpu-only"."""
    snapshot = [_bits(a) for a in c.args] + [_bits(v) for k, v in c.kw.items() if k != "out"]
    fn = getattr(fdpp, c.fn)
    prev = api.checks_enabled()
    fdpp.set_checks(c.checks)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the one-time "no GPU: emulator" warning
            res = fn(*c.args, **c.kw)
    except (ValueError, TypeError) as e:
        msg = f"{type(e).__name__}: {e}"
        assert c.mutation and not c.mutation.startswith("none"), \
            f"a valid call was rejected: {msg}\n  {c.describe()}"
        if c.names != NAME_GAP:
            assert any(nm in str(e) for nm in c.names), \
                f"the error does not name {c.names}: {msg}\n  {c.describe()}"
        return "rejected"
    except RuntimeError as e:
        passes_checks = not c.mutation or c.mutation.startswith("none") or c.mutation == "out:readonly"
        if c.fn == "decode_attention_nosplit" and "needs a GPU" in str(e) and passes_checks:
            return "gpu-only"
        raise AssertionError(f"{type(e).__name__} (not ValueError/TypeError): {e}\n  {c.describe()}") from e
    except Exception as e:  # noqa: BLE001 - the property: no other exception, ever
        raise AssertionError(f"{type(e).__name__} (not ValueError/TypeError): {e}\n  {c.describe()}") from e
    finally:
        fdpp.set_checks(prev)
    after = [_bits(a) for a in c.args] + [_bits(v) for k, v in c.kw.items() if k != "out"]
    for i, (x, y) in enumerate(zip(snapshot, after, strict=True)):
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y), f"input {i} was modified\n  {c.describe()}"
    assert not c.mutation or c.mutation.startswith("none"), \
        f"an invalid call ({c.mutation}: should name {c.names}) was accepted\n  {c.describe()}"
    out, lse = res if c.kw.get("return_lse") else (res, None)
    if c.kw.get("out") is not None:
        assert out is c.kw["out"], "the result is not the out array"
    q = c.args[0]
    assert isinstance(out, np.ndarray) and out.shape == q.shape and out.dtype == q.dtype, (type(out), c.describe())
    ref, ref_lse = _reference(c)
    try:
        assert_close(out, ref, c.dt)
        if lse is not None:
            assert lse.dtype == np.float32 and lse.shape == q.shape[:2]
            np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
            fin = np.isfinite(ref_lse)
            np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-4, atol=1e-4)
    except AssertionError as e:
        raise AssertionError(f"{e}\n  {c.describe()}") from None
    return "ok"


def _run_property(strategy: Any, n: int, valid: bool) -> None:
    outcomes: set[str] = set()

    @_settings(n)
    @hypothesis.given(strategy)
    def run(c):
        outcomes.add(check_case(c))

    run()
    # the strategy is not degenerate: valid calls ran, and each mutation was rejected
    assert outcomes & ({"ok", "gpu-only"} if valid else {"rejected"}), outcomes


# One hypothesis run per mutation kind (a single run over all of them would draw the first few
# kinds most of the time): many examples of valid calls, fewer of each mutation.
@pytest.mark.parametrize("mut", CONTIG_MUTATIONS)
def test_decode_attention_property(mut):
    _run_property(contiguous_cases(mut), 400 if mut == "none" else 40, mut == "none")


@pytest.mark.parametrize("mut", PAGED_MUTATIONS)
def test_paged_decode_attention_property(mut):
    _run_property(paged_cases(mut), 400 if mut == "none" else 40, mut == "none")


# ---- flat_gemm ------------------------------------------------------------------------------
@st.composite
def gemm_cases(draw: Any) -> Case:
    r = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    m, n, k = draw(st.integers(1, 64)), draw(st.integers(1, 96)), 8 * draw(st.integers(1, 32))
    dt = draw(st.sampled_from(["fp16", "bf16"]))
    npdt = NP_DT[dt]
    x = _as_view(_rand(r, (m, k), dt, 0.25), draw(st.sampled_from(VIEWS)), r)
    w = _as_view(_rand(r, (n, k), dt, 0.25), draw(st.sampled_from(VIEWS)), r)
    kw: dict[str, Any] = {}
    if draw(st.booleans()):
        kw["bias"] = _as_view(_rand(r, (n,), dt), draw(st.sampled_from(["c", "neg", "step", "readonly"])), r)
    if draw(st.booleans()):
        kw["out"] = _canonical_out((m, n), npdt, r, draw(st.booleans()))
    c = Case("flat_gemm", [x, w], kw, dt, meta={"arg_pos": {"x": 0, "w": 1}})
    mut = draw(st.sampled_from(["none", "none", "m", "k", "n", "ndim", "kmismatch", "dtype", "wdtype", "bias",
                                "out", "type", "missing"]))
    if mut == "none":
        return c
    c.mutation = mut
    if mut == "m":
        mm = draw(st.sampled_from([0, 65, 100]))
        c.args[0] = _rand(r, (mm, k), dt)
        c.kw.pop("out", None)
        c.names = ("x", "M")
    elif mut == "k":
        kk = draw(st.sampled_from([0, 1, 4, 12, 20, 100]))
        c.args = [_rand(r, (m, kk), dt), _rand(r, (n, kk), dt)]
        c.names = ("K",)
    elif mut == "n":
        c.args[1] = _rand(r, (0, k), dt)
        c.kw.pop("bias", None)
        c.kw.pop("out", None)
        c.names = ("w", "N")
    elif mut == "ndim":
        i = draw(st.integers(0, 1))
        c.args[i] = draw(st.sampled_from([c.args[i][None], c.args[i].reshape(-1)]))
        c.names = (("x", "w")[i],)
    elif mut == "kmismatch":
        c.args[1] = _rand(r, (n, k + 8), dt)
        c.names = ("w", "x")
    elif mut == "dtype":  # both x and w in a dtype flat_gemm does not take
        ndt = draw(st.sampled_from([np.float32, np.float64, np.int8]))
        c.args = [a.astype(ndt) for a in c.args]
        c.kw = {}
        c.names = ("x",)
    elif mut == "wdtype":
        c.args[1] = c.args[1].astype(draw(st.sampled_from([np.float32, np.float64, NP_DT["bf16" if dt == "fp16" else "fp16"]])))
        c.names = ("w",)
    elif mut == "bias":
        c.kw["bias"] = draw(st.sampled_from([np.zeros(n + 1, npdt), np.zeros((1, n), npdt), np.zeros(n, np.float32),
                                             np.zeros(n, np.float64), [0.0] * n]))
        c.names = ("bias",)
    elif mut == "out":
        opts = [np.zeros((m, n + 1), npdt), np.zeros((m, n), np.float32), np.zeros((m, n), npdt).tolist()]
        if n > 1 and m > 1:
            opts.append(np.zeros((n, m), npdt).T)
        o = draw(st.sampled_from(opts))
        c.kw["out"] = o
        c.names = ("out",)
    elif mut == "type":
        i = draw(st.integers(0, 1))
        c.args[i] = c.args[i].tolist()
        c.names = (("x", "w")[i],)
    else:  # x only: w=None raises KeyError (test_gap_required_array_none)
        c.args[0] = None
        c.names = ("x",)
    return c


@_settings(400)
@hypothesis.given(gemm_cases())
def test_flat_gemm_property(c):
    snapshot = [_bits(a) for a in c.args] + [_bits(c.kw.get("bias"))]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            y = fdpp.flat_gemm(*c.args, **c.kw)
    except (ValueError, TypeError) as e:
        assert c.mutation, f"a valid call was rejected: {type(e).__name__}: {e}\n  {c.describe()}"
        assert any(nm in str(e) for nm in c.names), f"the error does not name {c.names}: {e}\n  {c.describe()}"
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{type(e).__name__} (not ValueError/TypeError): {e}\n  {c.describe()}") from e
    assert not c.mutation, f"an invalid call ({c.mutation}) was accepted\n  {c.describe()}"
    for a, s in zip([*c.args, c.kw.get("bias")], snapshot, strict=True):
        if isinstance(a, np.ndarray):
            assert np.array_equal(_bits(a), s), "an input was modified"
    x, w = c.args
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    if c.kw.get("bias") is not None:
        ref = ref + np.asarray(c.kw["bias"], np.float64)
    if c.kw.get("out") is not None:
        assert y is c.kw["out"]
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert_close(y, ref, c.dt)


# ---- PagedKVCache (numpy backend): a state machine against a plain Python model -------------
H_C, D_C = 2, 8


class CacheMachine(RuleBasedStateMachine):
    """Random allocate / fork / free / set_batch / reserve+append / extend_reserve+extend sequences.

    Model: per live sequence, per layer, the list of K and V rows written (plain NumPy rows). After
    every step: each sequence read back through its pages (and, for the active batch, through the
    block table and seqlens) equals the model bit for bit; refcounts equal the number of live
    sequences holding each page; free pages + used pages = num_pages. A failing reservation
    (OutOfPagesError, or ValueError for max_pages_per_seq) changes nothing at all.
    """

    seqs = Bundle("seqs")

    @initialize(ps=st.sampled_from([1, 2, 4, 16]), pages=st.integers(2, 14), layers=st.integers(1, 2),
                dt=st.sampled_from(DTS), layout=st.sampled_from(["NHD", "HND"]),
                mp=st.one_of(st.none(), st.integers(1, 6)), seed=st.integers(0, 2**31))
    def init_cache(self, ps, pages, layers, dt, layout, mp, seed):
        self.cache = PagedKVCache(layers, pages, ps, H_C, D_C, dtype=dt, kv_layout=layout, max_batch=4,
                                  max_pages_per_seq=mp, backend="numpy")
        self.rng = np.random.default_rng(seed)
        self.dt = NP_DT[dt]
        self.model: dict[int, list[tuple[list[np.ndarray], list[np.ndarray]]]] = {}
        self.batch: list[int] = []
        self.errors = 0

    # -- helpers
    def _rows(self, t: int) -> np.ndarray:
        return self.rng.standard_normal((t, H_C, D_C), dtype=np.float32).astype(self.dt)

    def _state(self) -> tuple:
        c = self.cache
        return (c.num_free_pages, {s: (c.pages(s), c.length(s)) for s in self.model},
                c._refcnt.copy(), c.batch, _bits(c.to_numpy(c.block_table)), _bits(c.to_numpy(c.seqlens)),
                _bits(c._k), _bits(c._v), list(c._free))

    def _same(self, before: tuple, after: tuple) -> None:
        for x, y in zip(before, after, strict=True):
            if isinstance(x, np.ndarray):
                assert np.array_equal(x, y)
            else:
                assert x == y

    def _try(self, f: Any) -> bool:
        before = self._state()
        try:
            f()
        except OutOfPagesError as e:
            assert e.needed > e.free >= 0
        except ValueError as e:
            assert "max_pages_per_seq" in str(e), e
        else:
            return True
        self._same(before, self._state())
        self.errors += 1
        return False

    # -- rules
    @rule(target=seqs)
    def allocate(self):
        s = self.cache.allocate()
        assert s not in self.model and self.cache.length(s) == 0 and self.cache.pages(s) == ()
        self.model[s] = [([], []) for _ in range(self.cache.num_layers)]
        return s

    @rule(target=seqs, s=seqs)
    def fork(self, s):
        if s not in self.model:
            return hypothesis.stateful.multiple()
        child = self.cache.fork(s)
        self.model[child] = [(list(k), list(v)) for k, v in self.model[s]]
        return child

    @rule(s=consumes(seqs))
    def free(self, s):
        if s not in self.model:
            return
        if s in self.batch:
            with pytest.raises(ValueError, match="active batch"):
                self.cache.free(s)
            return
        self.cache.free(s)
        del self.model[s]
        with pytest.raises(ValueError):
            self.cache.length(s)

    @rule(data=st.data())
    def set_batch(self, data):
        live = sorted(self.model)
        if not live:
            return
        ids = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=min(4, len(live))))
        self.cache.set_batch(ids)
        self.batch = ids
        assert self.cache.batch == tuple(ids)

    @precondition(lambda self: self.batch)
    @rule(t=st.integers(1, 3))
    def decode_step(self, t):
        """reserve(t), then append the last token per layer and extend the t - 1 before it."""
        c = self.cache
        if not self._try(lambda: c.reserve(t)):
            return
        for layer in range(c.num_layers):
            if t > 1:  # the reserved positions before the last one: written through extend
                for s in self.batch:
                    k, v = self._rows(t - 1), self._rows(t - 1)
                    # extend writes the LAST rows of a sequence; write them before append's slot by
                    # extending over all t positions and letting append overwrite the last one
                    kk, vv = np.concatenate([k, self._rows(1)]), np.concatenate([v, self._rows(1)])
                    c.extend(layer, s, kk, vv)
                    self.model[s][layer][0].extend(list(kk))
                    self.model[s][layer][1].extend(list(vv))
            k, v = self._rows(len(self.batch)), self._rows(len(self.batch))
            c.append(layer, k, v)
            for i, s in enumerate(self.batch):
                ks, vs = self.model[s][layer]
                if t > 1:
                    ks[-1], vs[-1] = k[i], v[i]
                else:
                    ks.append(k[i])
                    vs.append(v[i])

    @rule(s=seqs, t=st.integers(1, 40))
    def prefill(self, s, t):
        if s not in self.model:
            return
        c = self.cache
        n0 = c.length(s)
        got: list[int] = []
        if not self._try(lambda: got.append(c.extend_reserve(s, t))):
            return
        assert got == [n0] and c.length(s) == n0 + t
        for layer in range(c.num_layers):
            k, v = self._rows(t), self._rows(t)
            c.extend(layer, s, k, v)
            self.model[s][layer][0].extend(list(k))
            self.model[s][layer][1].extend(list(v))

    # -- invariants
    @invariant()
    def contents_match_the_model(self):
        c = self.cache
        ps = c.page_size
        for s, layers in self.model.items():
            n = c.length(s)
            assert n == len(layers[0][0])
            pages = np.asarray(c.pages(s), dtype=np.int64)
            assert len(pages) == -(-n // ps)
            pos = np.arange(n)
            for layer, (ks, vs) in enumerate(layers):
                for pool, want in ((c.k_pages(layer), ks), (c.v_pages(layer), vs)):
                    got = pool[pages[pos // ps], pos % ps] if c.kv_layout == "NHD" else pool[pages[pos // ps], :, pos % ps]
                    exp = np.stack(want) if want else np.zeros((0, H_C, D_C), self.dt)
                    assert np.array_equal(_bits(got), _bits(exp)), f"seq {s} layer {layer}"

    @invariant()
    def tables_match(self):
        c = self.cache
        bt, lens = c.to_numpy(c.block_table), c.to_numpy(c.seqlens)
        assert bt.shape == (len(self.batch), c.max_pages_per_seq) and lens.shape == (len(self.batch),)
        for r, s in enumerate(self.batch):
            p = c.pages(s)
            assert list(bt[r, :len(p)]) == list(p) and not bt[r, len(p):].any()
            assert lens[r] == c.length(s)
        # through the block table exactly as paged_decode_attention reads it
        if self.batch:
            from fdpp.reference import gather_pages

            for layer in range(c.num_layers):
                kc = gather_pages(c.k_pages(layer), bt, lens, c.kv_layout)
                for r, s in enumerate(self.batch):
                    n = int(lens[r])
                    got = kc[r, :n] if c.kv_layout == "NHD" else kc[r, :, :n].transpose(1, 0, 2)
                    ks = self.model[s][layer][0]
                    exp = np.stack(ks) if ks else np.zeros((0, H_C, D_C), self.dt)
                    assert np.array_equal(_bits(got), _bits(exp))

    @invariant()
    def refcounts_and_free_pages(self):
        c = self.cache
        holders = np.zeros(c.num_pages, dtype=np.int64)
        for s in self.model:
            p = c.pages(s)
            assert len(set(p)) == len(p), f"seq {s} holds a page twice: {p}"
            holders[list(p)] += 1
        for p in range(c.num_pages):
            assert c.refcount(p) == holders[p], (p, c.refcount(p), holders[p])
        used = int((holders > 0).sum())
        assert c.num_free_pages + used == c.num_pages
        assert len(set(c._free)) == len(c._free) and not (set(c._free) & set(np.flatnonzero(holders).tolist()))


CacheMachine.TestCase.settings = _settings(150, stateful_step_count=40)
test_paged_kv_cache_state_machine = CacheMachine.TestCase


# ---- gaps the properties found, fixed since: each pins its fix ----------------------------------
def _small(rng, dt=np.float16):
    q = rng.standard_normal((2, 4, 64)).astype(dt)
    k = rng.standard_normal((2, 10, 2, 64)).astype(dt)
    return q, k


def _quiet(f, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return f(*a, **kw)


@pytest.mark.parametrize("which", ["k_cache", "v_cache", "k_pages", "v_pages", "w"])
def test_gap_required_array_none_raises_typeerror(rng, which):
    q, k = _small(rng)
    kp = rng.standard_normal((4, 16, 2, 64)).astype(np.float16)
    table, lens = np.arange(4, dtype=np.int32).reshape(2, 2), np.array([20, 3], np.int32)
    calls = {
        "k_cache": lambda: _quiet(fdpp.decode_attention, q, None, k),
        "v_cache": lambda: _quiet(fdpp.decode_attention, q, k, None),
        "k_pages": lambda: _quiet(fdpp.paged_decode_attention, q, None, kp, table, lens),
        "v_pages": lambda: _quiet(fdpp.paged_decode_attention, q, kp, None, table, lens),
        "w": lambda: _quiet(fdpp.flat_gemm, q[0].astype(np.float16)[:, :16], None),
    }
    with pytest.raises(TypeError, match=which):
        calls[which]()


@pytest.mark.parametrize("which", ["q", "k_cache", "v_cache", "out"])
def test_gap_unsupported_dtype_names_the_argument(rng, which):
    q, k = _small(rng)
    args = {"q": q, "k_cache": k, "v_cache": k, "out": None}
    args[which] = (np.zeros(q.shape) if which == "out" else args[which].astype(np.float64))
    with pytest.raises(TypeError, match=which):
        _quiet(fdpp.decode_attention, args["q"], args["k_cache"], args["v_cache"], out=args["out"])


def test_gap_read_only_out_is_named(rng):
    q, k = _small(rng)
    out = np.zeros(q.shape, q.dtype)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out"):
        _quiet(fdpp.decode_attention, q, k, k, out=out)


def test_gap_out_size_one_dims_any_stride(rng):
    q, k = _small(rng)
    base = np.zeros((1, 4, 64), np.float16)
    out = np.lib.stride_tricks.as_strided(base, strides=(2, 128, 2))  # batch stride 1 element, size 1
    assert out.flags.c_contiguous
    res = _quiet(fdpp.decode_attention, q[:1], k[:1], k[:1], out=out)
    assert_close(res, attention_reference(q[:1], k[:1], k[:1])[0], "fp16")


@pytest.mark.parametrize("paged", [False, True])
def test_gap_empty_cache_on_the_emulator(rng, paged):
    q, k = _small(rng)
    if paged:
        kp = rng.standard_normal((3, 16, 2, 64)).astype(np.float16)
        out, lse = _quiet(fdpp.paged_decode_attention, q, kp, kp, np.zeros((2, 0), np.int32), np.zeros(2, np.int32),
                          return_lse=True)
    else:
        out, lse = _quiet(fdpp.decode_attention, q, k[:, :0], k[:, :0], return_lse=True)
    assert (out == 0).all() and np.isneginf(lse).all()


def test_scores_beyond_float32_give_nan_rows_never_wrong_numbers(rng):
    """Documented: scores are computed in float32; a (request, head) whose scaled scores overflow it
    (here softmax_scale = 1e38) returns NaN for that row, never a finite wrong answer. Rows that
    stay in range match the float64 reference."""
    from fdpp.reference import attention_reference

    q, k = _small(rng)
    q[0] *= 0  # request 0: every score is 0 whatever the scale: in range
    try:
        out = _quiet(fdpp.decode_attention, q, k, k, softmax_scale=1e38)
    except ValueError as e:
        assert "softmax_scale" in str(e)
        return
    ref, _ = attention_reference(q, k, k, softmax_scale=1e38)
    o = out.astype(np.float64)
    for b, h in np.ndindex(o.shape[:2]):
        row = o[b, h]
        assert np.isnan(row).all() or np.allclose(row, ref[b, h], rtol=2e-2, atol=2e-2), (b, h, row[:4])
    assert np.isfinite(o[0]).all() and np.isnan(o[1]).any()
