"""README.md's ```python examples, run as written on the NumPy backend (no GPU).

Each block is found by its marker (its first code line, comment stripped) in SPECS: run whole, run in
part (``lines``: exact lines kept, ``subs``: exact text replaced; each must still be in the block), or
skipped with a reason (after a syntax check and a check that its fdpp names exist); ``xfail``: a README
example known wrong (strict). A block in the README but not in SPECS, or the reverse, fails
test_every_block_is_listed. FDPP_README=<path> points the test at another copy (to check it can fail).
"""

import importlib
import math
import os
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
from paged_util import ragged_table

import fdpp
from fdpp.reference import assert_close

pytestmark = pytest.mark.filterwarnings("ignore:fdpp. no GPU found:RuntimeWarning")
README = Path(os.environ.get("FDPP_README", Path(__file__).resolve().parents[1] / "README.md"))
B, HQ, HKV, D, N, PAGE = 2, 8, 2, 128, 200, 16


def _blocks() -> dict[str, str]:
    """{marker: dedented code} of every ```python block (indented ones, inside list items, too)."""
    blocks: dict[str, str] = {}
    for body in re.findall(r"^[ \t]*```python[ \t]*\n(.*?)^[ \t]*```", README.read_text(), re.M | re.S):
        code = textwrap.dedent(body)
        first = next(ln for ln in code.splitlines() if ln.strip() and not ln.lstrip().startswith("#"))
        marker = first.split("#")[0].strip()
        assert marker not in blocks, f"two README python blocks start with {marker!r}: give one another marker"
        blocks[marker] = code
    return blocks


def _check_names(code):
    """Every fdpp.a.b / `from fdpp.a import b` name the block uses exists (run or skipped: renames show)."""
    names = re.findall(r"\bfdpp((?:\.\w+)+)", code)
    names += [f"{m}.{n}" for m, n in re.findall(r"from fdpp((?:\.\w+)+) import (\w+)", code)]
    for name in names:
        obj = fdpp
        for part in name.strip(".").split("."):
            obj = getattr(obj, part, None) or importlib.import_module(f"{obj.__name__}.{part}")


def _ref(q, k, v, lens=None):
    """Float64 attention, NHD k/v [B, N, Hkv, D]: softmax(q k^T / sqrt(D)) v and lse per (b, head)."""
    b, hq, d = q.shape
    g = hq // k.shape[2]
    out, lse = np.zeros((b, hq, d)), np.full((b, hq), -np.inf)
    for i in range(b):
        n = k.shape[1] if lens is None else int(lens[i])
        for h in range(hq):
            s = k[i, :n, h // g].astype(np.float64) @ q[i, h].astype(np.float64) / math.sqrt(d)
            p = np.exp(s - s.max())
            out[i, h], lse[i, h] = p @ v[i, :n, h // g].astype(np.float64) / p.sum(), s.max() + np.log(p.sum())
    return out, lse


def _f16(rng, *shape):
    return rng.standard_normal(shape).astype(np.float16)


def _paged(rng, k, v, page=PAGE):
    """Pools [pages, page, Hkv, D] holding contiguous k/v [B, N, Hkv, D] through a shuffled block table."""
    table, num_pages = ragged_table(rng, [k.shape[1]] * k.shape[0], page)
    kp = np.zeros((num_pages, page, *k.shape[2:]), k.dtype)
    vp = np.zeros_like(kp)
    for i in range(k.shape[0]):
        for j, p in enumerate(table[i]):
            n = min(page, k.shape[1] - j * page)
            kp[p, :n], vp[p, :n] = k[i, j * page:j * page + n], v[i, j * page:j * page + n]
    return kp, vp, table


# ---- per block: the namespace it needs, and what its README comments promise ----------------
def use_setup(rng, hq=HQ, hkv=HKV):  # the plan block's too (32 and 8 heads there)
    q, k, v = _f16(rng, B, hq, D), _f16(rng, B, N, hkv, D), _f16(rng, B, N, hkv, D)
    kp, vp, table = _paged(rng, k, v)
    return dict(q=q, k_cache=k, v_cache=v, k=k, v=v, lens=np.array([N, 37], np.int32), k_pages=kp, v_pages=vp,
                block_table=table, cache_seqlens=np.array([150, N], np.int32), batch=B, max_pages_per_seq=len(table[0]))


def paged_check(ns):  # out: the last (paged) call's
    assert ns["out"].shape == ns["q"].shape and ns["out"].dtype == np.float16
    assert_close(ns["out"], _ref(ns["q"], ns["k"], ns["v"], ns["cache_seqlens"])[0], "fp16")


def use_check(ns):
    assert ns["lse"].shape == (B, HQ) and ns["lse"].dtype == np.float32
    assert_close(ns["lse"], _ref(ns["q"], ns["k"], ns["v"], ns["lens"])[1], "fp32")
    paged_check(ns)


def cache_setup(rng, lengths=(40, 23)):  # prompts of different lengths, one [32, T, Hkv, D] each
    return dict(batch=B, k_prompts=[_f16(rng, 32, t, 8, D) for t in lengths],
                v_prompts=[_f16(rng, 32, t, 8, D) for t in lengths], k_new=_f16(rng, B, 8, D), v_new=_f16(rng, B, 8, D),
                q=_f16(rng, B, 16, D))


def cache_check(ns):
    for i in range(B):
        k, v = (np.concatenate([ns[f"{x}_prompts"][i][31], ns[f"{x}_new"][i, None]])[None] for x in "kv")
        assert_close(ns["o"][i:i + 1], _ref(ns["q"][i:i + 1], k, v)[0], "fp16")
    assert ns["cache"].pages(ns["child"]) == ns["cache"].pages(ns["seqs"][0])


def rope_setup(rng, t=21):
    cache = fdpp.PagedKVCache(2, 16, PAGE, HKV, D, backend="numpy")
    cache.set_batch([cache.allocate() for _ in range(B)])
    cache.reserve(t)
    cache.reserve(1)
    ang = np.arange(64)[:, None] * 10000.0 ** (-np.arange(D // 2) / (D // 2))
    return dict(cache=cache, layer=1, qkv=_f16(rng, B, (HQ + 2 * HKV) * D), cos=np.cos(ang).astype(np.float32),
                sin=np.sin(ang).astype(np.float32), q=np.zeros((B, HQ, D), np.float16), pos=t)


def rope_check(ns):
    x = ns["qkv"].reshape(B, HQ + 2 * HKV, D).astype(np.float64)
    c, s = ns["cos"][ns["pos"]].astype(np.float64), ns["sin"][ns["pos"]].astype(np.float64)
    lo, hi = x[..., :D // 2], x[..., D // 2:]
    rot = np.concatenate([lo * c - hi * s, hi * c + lo * s], -1)
    assert_close(ns["q"], rot[:, :HQ], "fp16")
    cache = ns["cache"]
    slot = [(cache.pages(seq)[ns["pos"] // PAGE], ns["pos"] % PAGE) for seq in cache.batch]
    assert_close(np.stack([cache.k_pages(1)[p, j] for p, j in slot]), rot[:, HQ:HQ + HKV], "fp16")
    np.testing.assert_array_equal(np.stack([cache.v_pages(1)[p, j] for p, j in slot]), x[:, HQ + HKV:])
    assert ns["o"].shape == (B, HQ, D)


def fp8_setup(rng):
    k, v = _f16(rng, B, N, HKV, D), _f16(rng, B, N, HKV, D)
    qkv = fdpp.quantize_kv(k, v, "fp8_e4m3")
    kp, vp, table = _paged(rng, qkv.k.view(np.uint8), qkv.v.view(np.uint8))
    return dict(q=_f16(rng, B, HQ, D), k_fp8=qkv.k, v_fp8=qkv.v, k_scale=qkv.k_descale, v_scale=qkv.v_descale,
                k_pages_u8=kp, v_pages_u8=vp, block_table=table, lens=np.array([N, 99], np.int32),
                ks=float(qkv.k_descale.max()), vs=float(qkv.v_descale.max()))


def fp8_check(ns):
    kd = ns["k_fp8"].astype(np.float32) * ns["k_scale"][:, None, :, None]
    vd = ns["v_fp8"].astype(np.float32) * ns["v_scale"][:, None, :, None]
    assert_close(fdpp.decode_attention(ns["q"], ns["k_fp8"], ns["v_fp8"], k_descale=ns["k_scale"],
                                       v_descale=ns["v_scale"]), _ref(ns["q"], kd, vd)[0], "fp16")
    kd, vd = ns["k_fp8"].astype(np.float32) * ns["ks"], ns["v_fp8"].astype(np.float32) * ns["vs"]
    assert_close(ns["out"], _ref(ns["q"], kd, vd, ns["lens"])[0], "fp16")  # the paged call's


def quant_setup(rng):
    return dict(k=_f16(rng, B, N, 8, 128), v=_f16(rng, B, N, 8, 128), q=_f16(rng, B, HQ * 4, 128), B=B, Hq=HQ * 4,
                Hkv=8, D=128, N=N)


def quant_check(ns):
    assert ns["k8"].shape == (B, N, 8, 128) and ns["k8"].dtype.itemsize == 1
    assert ns["kd"].shape == ns["vd"].shape == (B, 8) and ns["kd"].dtype == np.float32
    assert ns["q4"].k.shape == (B, N, 8, 64) and ns["q4"].k.dtype == np.uint8
    assert ns["k_deq"].shape == (B, N, 8, 128) and ns["k_deq"].dtype == np.float32
    assert ns["cache"].k_pages(0).shape == (4096, 16, 8, 128) and ns["cache"].k_pages(0).dtype.itemsize == 1


def int4_check(ns):  # hadamard's too: then q is rotated ("V, out unrotated"), else plan is the int4 plan
    q, h = ns["q"], ns.get("H")
    if h is not None:
        assert h.dtype == np.float32 and np.allclose(h @ h.T, np.eye(128), atol=1e-6)
        q = (q.astype(np.float32) @ h).astype(np.float16)
    else:
        assert ns["plan"].kv_dtype == "int4"
    assert_close(ns["out"], _ref(q, *fdpp.dequantize_kv(ns["q4"]))[0], "fp16")


def merge_setup(rng):
    return dict(q=_f16(rng, B, HQ, D), k_prefix=_f16(rng, B, 64, HKV, D), v_prefix=_f16(rng, B, 64, HKV, D),
                k_own=_f16(rng, B, 30, HKV, D), v_own=_f16(rng, B, 30, HKV, D), own_lens=np.array([30, 7], np.int32))


def merge_check(ns):
    for i, n in enumerate(ns["own_lens"]):
        k = np.concatenate([ns["k_prefix"][i], ns["k_own"][i, :n]])[None]
        v = np.concatenate([ns["v_prefix"][i], ns["v_own"][i, :n]])[None]
        ref, ref_lse = _ref(ns["q"][i:i + 1], k, v)
        for out, lse in ((ns["out"], ns["lse"]), (ns["o_prefix"], ns["lse_prefix"])):  # new and in place
            assert_close(out[i:i + 1], ref, "fp16")
            assert_close(lse[i:i + 1], ref_lse, "fp32")
    assert ns["lse"].shape == (B, HQ) and ns["lse"].dtype == np.float32


def llama_check(ns):
    assert ns["logits"].shape == (1, ns["m"].dims["vocab"]) and np.isfinite(ns["logits"].astype(np.float32)).all()


def gemm_check(ns):
    assert ns["codes"].shape == (96, 64) and ns["codes"].dtype.itemsize == 1
    assert ns["w_scale"].shape == (96,) and ns["w_scale"].dtype == np.float32
    w = ns["codes"].astype(np.float32) * ns["w_scale"][:, None]
    assert_close(ns["y"], ns["x"].astype(np.float64) @ w.T + ns["b"], "fp16")


GPU = "needs a CUDA GPU"
SPECS = {
    "import fdpp": dict(id="use", setup=use_setup, check=use_check),
    "import cupy as cp": dict(id="cupy", skip=f"{GPU}: CuPy arrays"),
    "import torch": dict(id="torch", skip=f"{GPU}: torch CUDA tensors"),
    "plan = fdpp.DecodePlan(batch, 32, 8, 128, max_pages_per_seq * 16, dtype=\"fp16\", page_size=16)":
        dict(id="plan", setup=lambda rng: use_setup(rng, 32, 8), check=paged_check),
    "cache = fdpp.PagedKVCache(num_layers=32, num_pages=4096, page_size=16, num_kv_heads=8, head_dim=128,":
        # no GPU: the default backend is "numpy"
        dict(id="paged_cache", setup=cache_setup, check=cache_check),
    "cache.append_rope(layer, qkv, cos, sin, q)": dict(id="append_rope", setup=rope_setup, check=rope_check),
    "out = fdpp.decode_attention(q, k_fp8, v_fp8, k_descale=k_scale, v_descale=v_scale)":
        dict(id="fp8", setup=fp8_setup, check=fp8_check),
    "qkv = fdpp.quantize_kv(k, v, \"fp8_e4m3\")": dict(id="quantize_kv", setup=quant_setup, check=quant_check),
    "q4 = fdpp.quantize_kv(k, v, \"int4\", group_size=64)": dict(id="int4", setup=quant_setup, check=int4_check),
    "H = fdpp.hadamard(128, like=q)": dict(  # the torch spelling; the CuPy one its comment gives is NumPy's
        id="hadamard", setup=quant_setup, check=int4_check,
        subs={"(k.float() @ H).half()": "(k.astype(np.float32) @ H).astype(np.float16)",
              "(q.float() @ H).half()": "(q.astype(np.float32) @ H).astype(np.float16)"}),
    "o_prefix, lse_prefix = fdpp.decode_attention(q, k_prefix, v_prefix, return_lse=True)":
        dict(id="merge", setup=merge_setup, check=merge_check),
    "from fdpp.models.llama import LlamaDecoder": dict(  # m.capture() / step(): CUDA graphs; 8B weights
        id="llama", check=llama_check, lines=["from fdpp.models.llama import LlamaDecoder", "m.prefill_random(65535)",
                                              'm = LlamaDecoder("llama3-8b", batch=1, max_seqlen=65537, backend="torch")',
                                              "logits = m.step([42])"],
        subs={'"llama3-8b"': '"tiny"', 'backend="torch"': 'backend="numpy"', "65537": "301", "65535": "300"}),
    "import fdpp.integrations.hf": dict(id="hf", skip="needs transformers and a model checkpoint (from_pretrained(path))"),
    "import os, torch, torch.distributed as dist, fdpp": dict(id="context_parallel", skip=f"{GPU} per rank: torchrun + NCCL"),
    "codes, w_scale = fdpp.quantize_weight(w)": dict(
        id="fp8_weights", setup=lambda rng: dict(w=_f16(rng, 96, 64), x=_f16(rng, 3, 64), b=_f16(rng, 96)), check=gemm_check),
}


def test_every_block_is_listed():
    found = list(_blocks())
    assert sorted(found) == sorted(SPECS), (f"README python blocks not in SPECS: {sorted(set(found) - set(SPECS))}; "
                                            f"SPECS entries not in the README: {sorted(set(SPECS) - set(found))}")


@pytest.mark.parametrize("marker", [pytest.param(m, id=s["id"], marks=[pytest.mark.xfail(strict=True, reason=s["xfail"])]
                                                 if "xfail" in s else []) for m, s in SPECS.items()])
def test_readme_block(marker, rng, monkeypatch):
    spec, blocks = SPECS[marker], _blocks()
    assert marker in blocks, f"README has no python block starting {marker!r} (test_every_block_is_listed)"
    code = blocks[marker]
    compile(code, "README.md", "exec")
    _check_names(code)
    if "skip" in spec:
        pytest.skip(spec["skip"])
    monkeypatch.setattr(fdpp.api, "gpu_available", lambda: False)  # NumPy paths, default backend "numpy"
    if "lines" in spec:  # only these lines (exact text before any comment), in the block's order
        keep = [ln for ln in code.splitlines() if ln.split("#")[0].strip() in spec["lines"]]
        missing = set(spec["lines"]) - {ln.split("#")[0].strip() for ln in keep}
        assert not missing, f"lines no longer in the README block {marker!r}: {sorted(missing)}"
        code = "\n".join(keep)
    for old, new in spec.get("subs", {}).items():
        assert old in code, f"{old!r} is no longer in the README block {marker!r}"
        code = code.replace(old, new)
    ns = {"fdpp": fdpp, "np": np, **(spec["setup"](rng) if "setup" in spec else {})}
    exec(compile(code, f"README.md block {marker!r}", "exec"), ns)
    spec["check"](ns)
