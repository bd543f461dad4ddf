"""fdpp.models on the CPU: the NumPy front end of the Llama decode step at the tiny preset.

The reference here is written independently of fdpp.models.llama: float64 NumPy, the weights
read from the model's ``weights`` dict and the random context read back from its cache before
the first step; RoPE and RMSNorm are checked against their textbook formulas.
"""

import math

import numpy as np
import pytest

from fdpp.bench_e2e import GROUPS
from fdpp.models import MODELS, ModelPreset, get_model
from fdpp.models import _backends as be
from fdpp.models.llama import OP_GROUPS, LlamaDecoder, memory_estimate, model_dims

pytestmark = pytest.mark.filterwarnings("ignore:fdpp. no GPU found:RuntimeWarning")


def f64(a):
    return np.asarray(a, dtype=np.float64)


# ---- an independent float64 model ------------------------------------------------------------
def ref_rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def ref_rope(x, pos, theta):
    """x [..., H, D] at positions pos [...] (rotate-half pairs (i, i + D/2))."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.asarray(pos, dtype=np.float64)[..., None, None] * inv
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


class RefModel:
    """float64 decode steps of the same model; holds its own copy of the KV context."""

    def __init__(self, m: LlamaDecoder):
        self.w = {k: f64(v) for k, v in m.weights.items()}
        self.p, self.dims = m.preset, m.dims
        self.kv = [[(f64(k), f64(v)) for k, v in m.kv_numpy(layer)] for layer in range(m.dims["layers"])]

    def step(self, ids):
        w, dm, p = self.w, self.dims, self.p
        hq, hkv, d = dm["hq"], dm["hkv"], dm["d"]
        x = w["embed"][np.asarray(ids)]
        new_kv = []
        for layer in range(dm["layers"]):
            pre = f"layers.{layer}."
            h = ref_rmsnorm(x, w[pre + "attn_norm"], p.rms_eps)
            qkv = h @ w[pre + "wqkv"].T + w.get(pre + "bqkv", 0.0)
            q = qkv[:, :hq * d].reshape(-1, hq, d)
            k = qkv[:, hq * d:(hq + hkv) * d].reshape(-1, hkv, d)
            v = qkv[:, (hq + hkv) * d:].reshape(-1, hkv, d)
            outs, layer_new = [], []
            for b in range(len(ids)):
                kc, vc = self.kv[layer][b]
                pos = kc.shape[0]
                qb, kb = ref_rope(q[b], pos, p.rope_theta), ref_rope(k[b], pos, p.rope_theta)
                kc, vc = np.concatenate([kc, kb[None]]), np.concatenate([vc, v[b][None]])
                self.kv[layer][b] = (kc, vc)
                layer_new.append((kb, v[b]))
                g = hq // hkv
                kk, vv = np.repeat(kc, g, axis=1), np.repeat(vc, g, axis=1)  # [N, Hq, D]
                sc = np.einsum("hd,nhd->hn", qb, kk) / math.sqrt(d)
                pr = np.exp(sc - sc.max(-1, keepdims=True))
                pr /= pr.sum(-1, keepdims=True)
                outs.append(np.einsum("hn,nhd->hd", pr, vv).reshape(-1))
            new_kv.append(layer_new)
            x = x + np.stack(outs) @ w[pre + "wo"].T
            h = ref_rmsnorm(x, w[pre + "mlp_norm"], p.rms_eps)
            gu = h @ w[pre + "w_gate_up"].T
            gate, up = gu[:, :dm["inter"]], gu[:, dm["inter"]:]
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w[pre + "w_down"].T
        h = ref_rmsnorm(x, w["final_norm"], p.rms_eps)
        return h @ w["lm_head"].T, new_kv


def _close(got, want, tol):
    got, want = f64(got), f64(want)
    err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    assert err < tol, f"max error {err:.3g} (relative to max |ref| {np.abs(want).max():.3g}) >= {tol}"


# ---- presets -----------------------------------------------------------------------------
def test_presets_keep_their_shapes():
    m = get_model("llama3-8b")
    assert (m.num_q_heads, m.num_kv_heads, m.head_dim, m.hidden, m.intermediate) == (32, 8, 128, 4096, 14336)
    assert m.linear_shapes() == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                                 "down": (4096, 14336)}
    assert MODELS["llama3-70b"].heads(8) == (8, 1, 128)
    assert (m.rope_theta, MODELS["llama2-7b"].rope_theta, MODELS["qwen2.5-7b"].rope_theta) == (5e5, 1e4, 1e6)
    assert MODELS["qwen2.5-7b"].qkv_bias and not m.qkv_bias
    with pytest.raises(ValueError, match="unknown model"):
        get_model("nope")


def test_tp_share_and_memory_estimate():
    d = model_dims(get_model("llama3-70b"), tp=8)
    assert (d["hq"], d["hkv"], d["d"], d["inter"], d["lm_rows"], d["layers"]) == (8, 1, 128, 3584, 16032, 80)
    est = memory_estimate("llama3-8b", 1, 131072)
    assert est["kv"] == 2 * 2 * 32 * 131072 * 8 * 128  # 16 GiB of fp16 K and V
    assert 15.5e9 < est["weights"] < 16.5e9  # ~8.0B parameters (untied LM head)
    with pytest.raises(ValueError, match="vocab"):
        model_dims(get_model("tiny"), tp=2, vocab=511)


# ---- the generator ----------------------------------------------------------------------------
def test_random_streams_are_chunk_invariant_and_scaled():
    ops = be.make_ops("numpy", "fp16")
    whole = ops.random((4000,), 3, "w", 0.5)
    part = ops.random((1000,), 3, "w", 0.5, offset=2500)
    np.testing.assert_array_equal(whole[2500:3500], part)
    assert abs(float(np.std(f64(whole))) - 0.5) < 0.03
    assert abs(float(np.mean(f64(whole)))) < 0.03
    assert not np.array_equal(whole, ops.random((4000,), 4, "w", 0.5))
    assert not np.array_equal(whole, ops.random((4000,), 3, "w2", 0.5))
    # the values are a function of the index: small chunks in the generator give the same bits
    old = be.CHUNK
    try:
        be.CHUNK = 7
        np.testing.assert_array_equal(ops.random((4000,), 3, "w", 0.5), whole)
    finally:
        be.CHUNK = old


def test_weights_follow_the_seed():
    a, b = LlamaDecoder("tiny", 1, 8, backend="numpy"), LlamaDecoder("tiny", 1, 8, backend="numpy")
    c = LlamaDecoder("tiny", 1, 8, backend="numpy", seed=1)
    assert a.weights.keys() == b.weights.keys()
    for k in a.weights:
        np.testing.assert_array_equal(a.weights[k], b.weights[k])
    assert all(not np.array_equal(a.weights[k], c.weights[k]) for k in a.weights)
    w = a.weights
    assert w["embed"].shape == (512, 256) and w["embed"].dtype == np.float16
    assert w["layers.1.wqkv"].shape == ((4 + 2 * 2) * 64, 256)
    assert w["layers.0.wo"].shape == (256, 256)
    assert w["layers.0.w_gate_up"].shape == (1024, 256) and w["layers.0.w_down"].shape == (256, 512)
    assert w["lm_head"].shape == (512, 256)
    assert 0.8 < float(np.mean(f64(w["final_norm"]))) < 1.2


# ---- ops against formulas ------------------------------------------------------------------
def test_rmsnorm_matches_formula(rng):
    ops = be.make_ops("numpy", "fp16")
    x = (rng.standard_normal((3, 256)) * 3).astype(np.float16)
    w = rng.uniform(0.5, 1.5, 256).astype(np.float16)
    out = np.zeros_like(x)
    ops.rmsnorm(x, w, 1e-5, out)
    want = f64(x) / np.sqrt(np.mean(f64(x) ** 2, axis=-1, keepdims=True) + 1e-5) * f64(w)
    np.testing.assert_allclose(f64(out), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("theta", [1e4, 5e5])
def test_rope_matches_formula(rng, theta):
    ops = be.make_ops("numpy", "fp16")
    b, hq, hkv, d = 3, 4, 2, 64
    qkv = rng.standard_normal((b, (hq + 2 * hkv) * d)).astype(np.float16)
    lens = np.array([1, 77, 4000], dtype=np.int32)  # positions 0, 76, 3999
    cos, sin = be.rope_tables(4096, d, theta)
    q, k, v = (np.zeros((b, h, d), np.float16) for h in (hq, hkv, hkv))
    ops.rope_qkv(qkv, cos, sin, lens, q, k, v)
    x = f64(qkv).reshape(b, hq + 2 * hkv, d)
    pos = lens - 1
    for i in range(b):
        # the direct formula: pairs (j, j + D/2) rotated by pos * theta^(-2j/D)
        for j in range(d // 2):
            a = pos[i] * theta ** (-2 * j / d)
            c, s = math.cos(a), math.sin(a)
            want_q = x[i, :hq, j] * c - x[i, :hq, j + d // 2] * s
            want_q2 = x[i, :hq, j + d // 2] * c + x[i, :hq, j] * s
            np.testing.assert_allclose(f64(q[i, :, j]), want_q, rtol=2e-3, atol=2e-3)
            np.testing.assert_allclose(f64(q[i, :, j + d // 2]), want_q2, rtol=2e-3, atol=2e-3)
            want_k = x[i, hq:hq + hkv, j] * c - x[i, hq:hq + hkv, j + d // 2] * s
            np.testing.assert_allclose(f64(k[i, :, j]), want_k, rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(v, qkv.reshape(b, -1, d)[:, hq + hkv:])
    np.testing.assert_allclose(f64(q[0]), x[0, :hq], rtol=0, atol=0)  # position 0: no rotation


def test_silu_mul_matches_formula(rng):
    ops = be.make_ops("numpy", "bf16")
    gu = rng.standard_normal((2, 64)).astype(be.DTYPES["bf16"].np_dtype)
    out = np.zeros((2, 32), gu.dtype)
    ops.silu_mul(gu, out)
    g, u = f64(gu[:, :32]), f64(gu[:, 32:])
    np.testing.assert_allclose(f64(out), g / (1 + np.exp(-g)) * u, rtol=1e-2, atol=1e-2)


# ---- the decode step against the float64 model ------------------------------------------------
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("cache,layout", [("paged", "NHD"), ("paged", "HND"), ("contiguous", "NHD")])
def test_decode_steps_match_float64_model(cache, layout, fuse):
    m = LlamaDecoder("tiny", 3, 80, backend="numpy", cache=cache, kv_layout=layout, page_size=16, fuse_norms=fuse)
    m.prefill_random([5, 33, 0])
    ref = RefModel(m)
    for step, ids in enumerate(([1, 200, 511], [7, 7, 0])):
        got = m.step(ids)
        want, new_kv = ref.step(ids)
        assert got.shape == (3, 512) and got.dtype == np.float16
        _close(got, want, 4e-3)
        assert float(np.std(want)) > 0.3  # the logits are not trivially small
        np.testing.assert_array_equal(m.lengths, [6 + step, 34 + step, 1 + step])
        for layer in range(2):  # the appended K/V: RoPE'd k and the raw v, at the new position
            for b, (kc, vc) in enumerate(m.kv_numpy(layer)):
                _close(kc[-1], new_kv[layer][b][0], 1e-2)
                _close(vc[-1], new_kv[layer][b][1], 1e-2)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_bf16_and_qkv_bias_step_matches_float64_model(fuse):
    preset = ModelPreset("tiny-bias", 4, 1, 64, 128, 256, 1, 64, 1e6, 1e-6, qkv_bias=True)
    m = LlamaDecoder(preset, 2, 32, backend="numpy", dtype="bf16", seed=5, fuse_norms=fuse)
    m.prefill_random(9)
    assert "layers.0.bqkv" in m.weights
    ref = RefModel(m)
    got = m.step([3, 4])
    _close(got, ref.step([3, 4])[0], 3e-2)


def test_same_seed_same_logits_and_context():
    a = LlamaDecoder("tiny", 2, 40, backend="numpy", seed=11)
    b = LlamaDecoder("tiny", 2, 40, backend="numpy", seed=11, page_size=4)
    a.prefill_random([20, 3])
    b.prefill_random([20, 3])
    for (ka, va), (kb, vb) in zip(a.kv_numpy(1), b.kv_numpy(1), strict=True):
        np.testing.assert_array_equal(ka, kb)
        np.testing.assert_array_equal(va, vb)
    _close(b.step([1, 2]), a.step([1, 2]), 4e-3)  # pages of 4 vs 16 tokens: the split plans may differ
    c = LlamaDecoder("tiny", 2, 40, backend="numpy", seed=12)
    c.prefill_random([20, 3])
    assert not np.array_equal(c.step([1, 2]), a.step([1, 2]))


def test_program_lists_every_op():
    m = LlamaDecoder("tiny", 1, 8, backend="numpy", fuse_norms=False)
    names = [n for n, _ in m.program]
    assert names[:3] == ["embed", "attn_norm", "qkv"] and names[-2:] == ["residual_final_norm", "lm_head"]
    assert names.count("attention") == 2 and names.count("qkv") == 2 and names.count("attn_norm") == 1
    assert names.count("residual_mlp_norm") == 2 and names.count("residual_attn_norm") == 1
    assert set(names) <= set(OP_GROUPS) and set(OP_GROUPS.values()) == set(GROUPS)


def test_fused_program_has_no_norm_kernels():
    """fuse_norms=True: the norms ride in the GEMM prologues, the residual adds in the o /
    down epilogues; the norm weights are folded into the GEMM weights, the model's own weights
    are left as made."""
    m = LlamaDecoder("tiny", 1, 8, backend="numpy", fuse_norms=True)
    names = [n for n, _ in m.program]
    per_layer = ["qkv", "rope_append", "attention", "o_proj", "gate_up", "silu_mul", "down"]
    assert names == ["embed", *per_layer * m.dims["layers"], "lm_head"]
    assert set(names) <= set(OP_GROUPS)
    u = LlamaDecoder("tiny", 1, 8, backend="numpy")
    assert not u.fuse_norms and u.gemm_weights["lm_head"] is u.weights["lm_head"]  # the default: unfused
    for name in ("layers.0.wqkv", "layers.1.w_gate_up", "lm_head"):
        np.testing.assert_array_equal(m.weights[name], u.weights[name])
    norm = m.weights["layers.1.mlp_norm"].astype(np.float32)
    want = (m.weights["layers.1.w_gate_up"].astype(np.float32) * norm).astype(np.float16)
    np.testing.assert_array_equal(m.gemm_weights["layers.1.w_gate_up"], want)
    assert m.gemm_weights["layers.0.wo"] is m.weights["layers.0.wo"]  # no norm in front: not copied


def test_argument_errors():
    with pytest.raises(ValueError, match="batch"):
        LlamaDecoder("tiny", 65, 8, backend="numpy")
    with pytest.raises(ValueError, match="contiguous"):
        LlamaDecoder("tiny", 1, 8, backend="numpy", nosplit=True, cache="paged")
    with pytest.raises(ValueError, match="kv_format"):
        LlamaDecoder("tiny", 1, 8, backend="numpy", cache="contiguous", kv_format="fp8")
    with pytest.raises(ValueError, match="dtype"):
        LlamaDecoder("tiny", 1, 8, backend="numpy", dtype="fp32")
    with pytest.raises(ValueError, match="backend"):
        LlamaDecoder("tiny", 1, 8, backend="jax")
    m = LlamaDecoder("tiny", 1, 4, backend="numpy")
    with pytest.raises(ValueError, match="lengths"):
        m.prefill_random(4)
    m.prefill_random(3)
    with pytest.raises(ValueError, match="empty cache"):
        m.prefill_random(1)
    with pytest.raises(ValueError, match="token ids"):
        m.step([512])
    m.step([1])
    with pytest.raises(ValueError, match="max_seqlen"):
        m.step([1])
    with pytest.raises(ValueError, match="GPU"):
        m.capture()


def test_shared_weights():
    a = LlamaDecoder("tiny", 2, 16, backend="numpy")
    b = LlamaDecoder("tiny", 1, 64, backend="numpy", cache="contiguous", weights=a.weights)
    assert b.weights["lm_head"] is a.weights["lm_head"]
    assert set(a.weights) == set(LlamaDecoder.weight_shapes(a.preset, a.dims))
    a.prefill_random(5)
    b.prefill_random(5)
    _close(b.step([9]), a.step([9, 9])[:1], 4e-3)  # same model (the split plans differ with N_max)
    bad = dict(a.weights, lm_head=a.weights["lm_head"][:10])
    with pytest.raises(ValueError, match="lm_head"):
        LlamaDecoder("tiny", 1, 8, backend="numpy", weights=bad)
    with pytest.raises(ValueError, match="keys"):
        LlamaDecoder("tiny", 1, 8, backend="numpy", num_layers=1, weights=a.weights)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_model_op_kernels_compile_without_spills(arch):
    """Every kernel of kernels_cu/model_ops.cu (the CuPy and torch front ends' elementwise ops) for
    every model dtype: compiled by NVRTC, no spills, no stack frame."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fdpp import registry

    cfgs = [be.ModelOpKernel(n, dt) for n in be.MODEL_OPS for dt in ("fp16", "bf16", "fp32")]
    reps = registry.compile_offline(cfgs, arch)
    assert set(reps) == {c.key for c in cfgs}
    for r in reps.values():
        assert r.spill_stores == r.spill_loads == r.stack_bytes == 0, r
    import re

    (cache,) = re.findall(r"constexpr int RMS_CACHE = (\d+);", registry.kernel_source("model_ops.cu"))
    assert int(cache) == be.RMS_CACHE  # the launch's thread count assumes the kernel's register cache


# ---- FP8 weights (W8A16) ----------------------------------------------------------------------
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_fp8_weight_step_matches_float64_model_of_the_dequantised_weights(fuse):
    from fdpp.quant import fp8_decode_bits

    m = LlamaDecoder("tiny", 2, 40, backend="numpy", seed=3, weight_format="fp8_e4m3", fuse_norms=fuse)
    assert sorted({n.rsplit(".", 1)[-1] for n in m.fp8_weights}) == ["w_down", "w_gate_up", "wo", "wqkv"]
    assert len(m.fp8_weights) == 4 * m.dims["layers"] and "lm_head" not in m.fp8_weights
    deq = dict(m.weights)
    for name, (codes, scale) in m.fp8_weights.items():
        assert codes.shape == m.weights[name].shape and scale.shape == (codes.shape[0],)
        deq[name] = (fp8_decode_bits(codes.view(np.uint8), "fp8_e4m3") * scale[:, None]).astype(np.float16)
    if fuse:  # the codes hold the folded weights: the same model with unit norms in front of them
        for layer in range(m.dims["layers"]):
            for nm in ("attn_norm", "mlp_norm"):
                deq[f"layers.{layer}.{nm}"] = np.ones_like(m.weights[f"layers.{layer}.{nm}"])
        deq["lm_head"] = m.gemm_weights["lm_head"]
        deq["final_norm"] = np.ones_like(m.weights["final_norm"])
    d = LlamaDecoder("tiny", 2, 40, backend="numpy", seed=3, weights=deq, fuse_norms=False)
    plain = LlamaDecoder("tiny", 2, 40, backend="numpy", seed=3)
    for x in (m, d, plain):
        x.prefill_random([17, 4])
    ref = RefModel(d)
    got = m.step([5, 9])
    _close(got, ref.step([5, 9])[0], 4e-3)
    err = np.abs(f64(got) - f64(plain.step([5, 9]))).max() / np.abs(f64(got)).max()
    assert 1e-3 < err < 0.2  # the FP8 weights change the logits, by the quantisation error only


def test_fp8_weight_argument_errors():
    with pytest.raises(ValueError, match="weight_format"):
        LlamaDecoder("tiny", 1, 8, backend="numpy", weight_format="int4")
    with pytest.raises(ValueError, match="fp16 activations"):
        LlamaDecoder("tiny", 1, 8, backend="numpy", dtype="bf16", weight_format="fp8_e4m3")


@pytest.mark.parametrize("kw, exc, words", [
    ({"nosplit": "no"}, TypeError, "nosplit must be a bool"),
    ({"fuse_norms": "no"}, TypeError, "fuse_norms must be a bool"),
    ({"fuse_rope_append": "False"}, TypeError, "fuse_rope_append must be a bool"),
    ({"cache": ""}, ValueError, "cache must be one of"),
    ({"cache": False}, ValueError, "cache must be one of"),
    ({"seed": 1.9}, TypeError, "seed must be an int"),
    ({"seed": "7"}, TypeError, "seed must be an int"),
    ({"num_layers": True}, TypeError, "num_layers must be an int"),
    ({"vocab": 100.7}, TypeError, "vocab must be an int"),
    ({"tp": True}, TypeError, "tp must be an int"),
    ({"tp": 2.0}, TypeError, "tp must be an int"),
])
def test_flags_and_ints_are_typed(kw, exc, words):
    """These went through bool() / int() / `cache or ...`: a string flag turned on, a float truncated."""
    with pytest.raises(exc, match=words):
        LlamaDecoder("tiny", 2, 8, backend="numpy", **kw)


def test_step_arguments_are_typed():
    m = LlamaDecoder("tiny", 2, 8, backend="numpy")
    with pytest.raises(TypeError, match="lengths must hold integers"):
        m.prefill_random(3.9)
    with pytest.raises(TypeError, match="lengths must hold integers"):
        m.prefill_random(np.array([True, False]))
    m.prefill_random(np.array([3, 2], dtype=np.int32))
    with pytest.raises(TypeError, match="token_ids must hold integers"):
        m.step([1.9, 2.7])
    with pytest.raises(TypeError, match="copy must be a bool"):
        m.step([1, 2], copy="")
    assert m.step(np.array([1, 2], dtype=np.uint8), copy=np.False_) is m.logits


@pytest.mark.parametrize("kw, exc, words", [
    ({"cache": "Contiguous"}, ValueError, "cache must be one of"),
    ({"batch": 2.5}, TypeError, "batch must be an int"),
    ({"page_size": 0}, ValueError, r"page_size must be in \[1, "),
    ({"max_seqlen": 0}, ValueError, r"max_seqlen must be in \[1, "),
])
def test_memory_estimate_checks_its_arguments(kw, exc, words):
    args = {"batch": 2, "max_seqlen": 37, **kw}
    with pytest.raises(exc, match=words):
        memory_estimate("tiny", **args)
    assert memory_estimate("tiny", 2, 37, cache="contiguous")["kv"] < memory_estimate("tiny", 2, 37)["kv"]
