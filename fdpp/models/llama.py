"""A decode step of a Llama-family model (Llama 2/3, Mistral, Qwen2.5) on fdpp's public API.

Per step, for a batch of B sequences (one new token each)::

    x = embed[token_ids]                                   # [B, hidden]
    for each layer:
        h = rmsnorm(x, attn_norm)
        qkv = flat_gemm(h, wqkv (+ bqkv))                  # [B, (Hq + 2 Hkv) D]
        q, k, v = rope(qkv, pos = seqlens - 1)             # RoPE on q and the new k, and
        cache.append(layer, k, v)                          # the append: one launch (fuse_rope_append)
        o = paged_decode_attention(q, cache...)            # [B, Hq, D]
        x += flat_gemm(o, wo)
        h = rmsnorm(x, mlp_norm)
        a = silu(gate) * up,  [gate | up] = flat_gemm(h, w_gate_up)
        x += flat_gemm(a, w_down)
    logits = flat_gemm(rmsnorm(x, final_norm), lm_head)    # [B, vocab / tp]

``fuse_norms=True`` (opt-in): no norm or residual kernel at all. Each RMSNorm runs as the
next GEMM's prologue (``flat_gemm(x, fold_rmsnorm(w, norm), rms_eps=eps)``: the norm's weight
folded into the GEMM's weight columns once, at construction) and each residual add as the o / down
projection's epilogue (``flat_gemm(a, w, residual=x, out=x)``), so a layer is qkv,
rope_append, attention, o_proj, gate_up, silu_mul, down: 65 launches fewer per llama3-8b step than
the unfused program. The values match the unfused program to rounding (the normed row is not
rounded to the model dtype before the GEMM, and the projection is not rounded before the add).
It is not the default because it measured slower on the H200 (runs W1 / W2, results/device_runW1/):
every CTA of a fused GEMM reads x's rows for the RMS before its first weight tiles are consumed, and
where the table picks cuBLAS (gate_up, qkv at M >= 2) the fused call runs fdpp's kernel instead;
the llama3-8b step took 5.056 against 4.949 ms at B = 1, 4k (16k: 5.387 against 5.451) and 6.657
against 5.961 at B = 8, 4k. ``fuse_norms=False`` (the default): the unfused program, where each residual add runs fused with the RMSNorm
after it (``add_rmsnorm``: one kernel, the same values as the two ops), so a step has one lone
RMSNorm (layer 0's attn_norm) and no lone add.

Random weights are made on the device from a counter-based hash (:mod:`fdpp.models._backends`):
the same ``seed`` gives bit-identical weights and KV contexts on the NumPy, torch and CuPy front
ends. Every op writes a preallocated buffer, so a step allocates nothing of its own and the whole
step can be captured in one CUDA graph (:meth:`LlamaDecoder.capture`).

Tensor parallelism (``tp``): one GPU's share of the heads and of the MLP and LM-head columns
(:meth:`fdpp.models.ModelPreset.heads` / ``linear_shapes``), without the all-reduces; the embedding
table stays whole (its gather costs nothing next to the GEMMs).

Growing context under CUDA graphs: a step's kernels read the sequence lengths (and the block
table) from device memory. The host advances the cache *before* each replay (paged:
``PagedKVCache.reserve(1)``, which allocates pages on the host and rewrites the device tables in
place on the current stream; contiguous: the device lengths are rewritten in place), and the
captured kernels then see the new length: RoPE positions, the KV append slot and the attention
length all follow. One capture serves every later step of the same batch, up to ``max_seqlen``.
The attention plan (number of splits) is chosen at capture for N_max = ``max_seqlen``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import fdpp
from fdpp.cache import _check_int
from fdpp.dtypes import DTYPES
from fdpp.models._backends import make_ops, rope_tables
from fdpp.models.presets import ModelPreset, get_model

CACHE_KINDS = ("paged", "contiguous")
#: The projections ``weight_format="fp8_e4m3"`` quantizes (per layer; the LM head stays 16-bit).
FP8_PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")
MAX_BATCH = 64  # flat_gemm's M limit
#: Op names of a step, in order (``LlamaDecoder.program``); per layer the middle block repeats.
OP_GROUPS = {
    "embed": "embed", "attn_norm": "norms", "residual_mlp_norm": "residual_norm",
    "residual_attn_norm": "residual_norm", "residual_final_norm": "residual_norm",
    "qkv": "qkv", "rope": "rope", "kv_append": "kv_append", "rope_append": "rope_append",
    "attention": "attention", "o_proj": "o_proj",
    "gate_up": "gate_up", "silu_mul": "silu_mul", "down": "down",
    "lm_head": "lm_head",
}


def _host_ints(name: str, x: Any) -> np.ndarray:
    """A host int or sequence of ints as an int64 array; floats and bools are a TypeError."""
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got {a.dtype}")
    return a.astype(np.int64)


def resolve_preset(preset: str | ModelPreset) -> ModelPreset:
    return preset if isinstance(preset, ModelPreset) else get_model(preset)


def model_dims(preset: ModelPreset, tp: int = 1, vocab: int | None = None,
               num_layers: int | None = None) -> dict[str, int]:
    """Per-GPU sizes of a decode step: q/kv heads, head_dim, hidden, intermediate (per GPU),
    layers, vocab (whole) and lm-head rows (vocab / tp)."""
    tp = _check_int("tp", tp)
    hq, hkv, d = preset.heads(tp)
    if preset.intermediate % tp:
        raise ValueError(f"tp={tp} must divide intermediate={preset.intermediate}")
    v = preset.vocab if vocab is None else _check_int("vocab", vocab)
    if v < 1 or v % tp:
        raise ValueError(f"vocab must be a positive multiple of tp={tp}, got {v}")
    n_layers = preset.num_layers if num_layers is None else _check_int("num_layers", num_layers)
    if n_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {n_layers}")
    return dict(hq=hq, hkv=hkv, d=d, hidden=preset.hidden, inter=preset.intermediate // tp,
                layers=n_layers, vocab=v, lm_rows=v // tp)


def memory_estimate(preset: str | ModelPreset, batch: int, max_seqlen: int, *, tp: int = 1,
                    dtype: str = "fp16", vocab: int | None = None, num_layers: int | None = None,
                    page_size: int = 16, cache: str = "paged") -> dict[str, int]:
    """Bytes a :class:`LlamaDecoder` of these arguments allocates: ``weights`` and ``kv`` (native
    KV formats; a quantized format needs less)."""
    p = resolve_preset(preset)
    if cache not in CACHE_KINDS:
        raise ValueError(f"cache must be one of {CACHE_KINDS}, got {cache!r}")
    for name, x in (("batch", batch), ("max_seqlen", max_seqlen), ("page_size", page_size)):
        _check_int(name, x)
    m = model_dims(p, tp, vocab, num_layers)
    isz = DTYPES[dtype].itemsize
    h, i, d = m["hidden"], m["inter"], m["d"]
    per_layer = (2 * h + (m["hq"] + 2 * m["hkv"]) * d * (h + 1) + h * m["hq"] * d + 3 * i * h)
    weights = isz * (m["vocab"] * h + m["layers"] * per_layer + h + m["lm_rows"] * h)
    tokens = max_seqlen if cache == "contiguous" else -(-max_seqlen // page_size) * page_size
    kv = 2 * isz * m["layers"] * batch * tokens * m["hkv"] * d
    return {"weights": weights, "kv": kv}


class LlamaDecoder:
    """Decode steps of a Llama-family model with random weights, through fdpp kernels.

    Parameters
    ----------
    preset : str or ModelPreset
        A name of :data:`fdpp.models.MODELS` ("llama3-8b", "llama2-7b", "qwen2.5-7b",
        "llama3-70b", "tiny", ...).
    batch : int
        Sequences decoded together, 1..64 (the rows of every GEMM).
    max_seqlen : int
        Most tokens a sequence may hold (context + decoded); sizes the cache and the RoPE table.
    tp : int
        Tensor-parallel degree: this is one GPU's share (e.g. llama3-70b with ``tp=8``).
    dtype : {"fp16", "bf16"}
        Weights, activations and (native) KV. The CuPy front end takes fp16 only.
    kv_format : str, optional
        Passed through to :class:`fdpp.PagedKVCache` (``kv_format=``) when given (FP8 / INT4 KV
        caches); None: the native format of ``dtype``.
    page_size : int
        Tokens per page of the paged cache.
    backend : {"torch", "cupy", "numpy"}
        Array type of every buffer and the front end of the elementwise ops. "numpy" runs the fdpp
        functions' NumPy paths (the split-KV emulator without a GPU).
    cache : {"paged", "contiguous"}, optional
        KV cache: one :class:`fdpp.PagedKVCache` for all layers (default), or contiguous
        ``[layers, B, max_seqlen, Hkv, D]`` K and V arrays (NHD), what ``nosplit`` needs.
    nosplit : bool
        Attention through :func:`fdpp.decode_attention_nosplit` (contiguous cache, one CTA per
        query head; GPU only): the seed's no-split baseline. Otherwise paged caches use
        :func:`fdpp.paged_decode_attention` and contiguous ones :func:`fdpp.decode_attention`.
    seed : int
        Seed of the weights and of :meth:`prefill_random`'s context.
    vocab : int, optional
        Vocabulary size (default the preset's); a small one keeps test models small.
    num_layers : int, optional
        Layers (default the preset's): e.g. a 2-layer model of llama3-8b's shapes.
    kv_layout : {"NHD", "HND"}
        Page layout of the paged cache.
    device : int, optional
        CUDA device (torch / cupy).
    weights : dict, optional
        The :attr:`weights` of another decoder of the same preset, dims, dtype and front end, shared
        instead of made (benchmarks build one decoder per context length on one set of weights).
    fuse_norms : bool
        True: RMSNorms in the GEMM prologues and residual adds in the o / down epilogues (see the
        module docstring; the folded weights are this decoder's own copies; measured slower so far).
        False (default): the norm kernels (``add_rmsnorm``).
    weight_format : {None, "fp8_e4m3"}
        "fp8_e4m3": the layers' projections (wqkv, wo, w_gate_up, w_down) run on FP8 weights
        (W8A16: :func:`fdpp.quantize_weight` of :attr:`weights`, a scale per output row; held in
        :attr:`fp8_weights`; fp16 models on sm_90 GPUs). Embedding, norms, biases and the LM head
        stay in the model dtype. None: every weight in the model dtype.
    fuse_rope_append : bool
        True (default): RoPE and the KV append are one launch per layer ("rope_append":
        :meth:`fdpp.PagedKVCache.append_rope`, or the contiguous cache's ``rope_qkv_append``), the
        values of the two unfused ops ("rope", "kv_append"; False) bit for bit. A paged cache whose
        head_dim is not a multiple of 16 keeps the two ops.

    Attributes
    ----------
    weights : dict[str, array]
        ``embed`` [vocab, hidden]; ``layers.{l}.attn_norm`` / ``mlp_norm`` [hidden];
        ``layers.{l}.wqkv`` [(Hq + 2 Hkv) D, hidden] (rows: q heads, k heads, v heads) and
        ``bqkv`` [(Hq + 2 Hkv) D] when the preset has q/k/v biases; ``layers.{l}.wo``
        [hidden, Hq D]; ``layers.{l}.w_gate_up`` [2 I, hidden] (rows 0..I-1 gate, I..2I-1 up);
        ``layers.{l}.w_down`` [hidden, I]; ``final_norm`` [hidden]; ``lm_head`` [vocab / tp, hidden].
        torch ``Linear`` layout (y = x W^T); the model dtype.
    fp8_weights : dict[str, tuple[array, array]]
        With ``weight_format="fp8_e4m3"``: ``layers.{l}.wqkv`` (etc.) -> (codes, w_scale) of
        :func:`fdpp.quantize_weight`, what the step's GEMMs read; empty otherwise.
    rope_cos, rope_sin : float32 arrays [max_seqlen, D / 2]
    logits : array [B, vocab / tp]
        The output buffer of a step (model dtype).
    program : list of (name, callable)
        The step's ops in order (names in :data:`OP_GROUPS`); running them all is one forward
        pass of the tokens in the input buffer at the lengths on the device (the cache must have
        been advanced first). Used by the benchmark's per-op breakdown.
    """

    def __init__(self, preset: str | ModelPreset, batch: int, max_seqlen: int, *, tp: int = 1,
                 dtype: str = "fp16", kv_format: str | None = None, page_size: int = 16,
                 backend: str = "torch", cache: str | None = None, nosplit: bool = False, seed: int = 0,
                 vocab: int | None = None, num_layers: int | None = None, kv_layout: str = "NHD",
                 device: int | None = None, weights: dict[str, Any] | None = None,
                 weight_format: str | None = None, fuse_norms: bool = False, fuse_rope_append: bool = True):
        self.preset = resolve_preset(preset)
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or not 1 <= batch <= MAX_BATCH:
            raise ValueError(f"batch must be an int in 1..{MAX_BATCH}, got {batch!r}")
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, np.integer)) or max_seqlen < 2:
            raise ValueError(f"max_seqlen must be an int >= 2, got {max_seqlen!r}")
        for name, flag in (("nosplit", nosplit), ("fuse_norms", fuse_norms), ("fuse_rope_append", fuse_rope_append)):
            fdpp.api.check_flag(name, flag)
        seed = _check_int("seed", seed, 0, (1 << 63) - 1)
        if cache is None:
            cache = "contiguous" if nosplit else "paged"
        if cache not in CACHE_KINDS:
            raise ValueError(f"cache must be one of {CACHE_KINDS}, got {cache!r}")
        if nosplit and cache != "contiguous":
            raise ValueError("nosplit=True runs fdpp.decode_attention_nosplit, which reads a contiguous "
                             "cache: use cache='contiguous' (the default with nosplit)")
        if kv_format is not None and cache != "paged":
            raise ValueError(f"kv_format={kv_format!r} is a PagedKVCache format: use cache='paged'")
        self.dims = model_dims(self.preset, tp, vocab, num_layers)
        if self.dims["d"] % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.dims['d']}")
        if dtype not in ("fp16", "bf16"):
            raise ValueError(f"dtype must be 'fp16' or 'bf16' (what flat_gemm takes), got {dtype!r}")
        if weight_format not in (None, "fp8_e4m3"):
            raise ValueError(f"weight_format must be None or 'fp8_e4m3', got {weight_format!r}")
        if weight_format is not None and dtype != "fp16":
            raise ValueError(f"weight_format={weight_format!r} (W8A16) takes fp16 activations: use dtype='fp16'")
        self.tp, self.batch, self.max_seqlen = tp, int(batch), int(max_seqlen)
        self.dtype, self.kv_format, self.page_size = dtype, kv_format, page_size
        self.backend, self.cache_kind, self.nosplit, self.seed = backend, cache, bool(nosplit), int(seed)
        self.kv_layout = kv_layout
        self.ops = make_ops(backend, dtype, device)
        self._graph_streams: list[Any] = []
        if weights is None:
            self._make_weights()
        else:
            self._use_weights(weights)
        self.fuse_norms = bool(fuse_norms)
        self.fuse_rope_append = bool(fuse_rope_append) and (cache == "contiguous" or self.dims["d"] % 16 == 0)
        # the GEMMs' weights: the norms folded into the columns of the projections after them (fused)
        self.gemm_weights = dict(self.weights)
        if self.fuse_norms:
            for name, norm in self._norm_of().items():
                self.gemm_weights[name] = fdpp.fold_rmsnorm(self.weights[name], self.weights[norm])
        self.weight_format = weight_format
        self.fp8_weights: dict[str, tuple[Any, Any]] = {}
        if weight_format is not None:
            for name, w in self.gemm_weights.items():
                if name.rsplit(".", 1)[-1] in FP8_PROJECTIONS:
                    self.fp8_weights[name] = fdpp.quantize_weight(w, weight_format)
        cos, sin = rope_tables(self.max_seqlen, self.dims["d"], self.preset.rope_theta)
        self.rope_cos, self.rope_sin = self.ops.from_numpy(cos), self.ops.from_numpy(sin)
        self._make_cache()
        self._make_buffers()
        self.program = self._build_program()

    # ---- construction ------------------------------------------------------------------------
    def _norm_of(self) -> dict[str, str]:
        """GEMM weight -> the RMSNorm weight in front of it."""
        out = {"lm_head": "final_norm"}
        for layer in range(self.dims["layers"]):
            p = f"layers.{layer}."
            out.update({p + "wqkv": p + "attn_norm", p + "w_gate_up": p + "mlp_norm"})
        return out

    def _make_weights(self) -> None:
        m, ops, s = self.dims, self.ops, self.seed
        h, d = m["hidden"], m["d"]
        nqkv = (m["hq"] + 2 * m["hkv"]) * d
        w: dict[str, Any] = {"embed": ops.random((m["vocab"], h), s, "embed", 1.0)}
        for layer in range(m["layers"]):
            p = f"layers.{layer}."
            w[p + "attn_norm"] = ops.random((h,), s, p + "attn_norm", 0.1, mean=1.0)
            w[p + "wqkv"] = ops.random((nqkv, h), s, p + "wqkv", 1 / math.sqrt(h))
            if self.preset.qkv_bias:
                w[p + "bqkv"] = ops.random((nqkv,), s, p + "bqkv", 0.1)
            w[p + "wo"] = ops.random((h, m["hq"] * d), s, p + "wo", 1 / math.sqrt(m["hq"] * d))
            w[p + "mlp_norm"] = ops.random((h,), s, p + "mlp_norm", 0.1, mean=1.0)
            w[p + "w_gate_up"] = ops.random((2 * m["inter"], h), s, p + "w_gate_up", 1 / math.sqrt(h))
            w[p + "w_down"] = ops.random((h, m["inter"]), s, p + "w_down", 1 / math.sqrt(m["inter"]))
        w["final_norm"] = ops.random((h,), s, "final_norm", 0.1, mean=1.0)
        w["lm_head"] = ops.random((m["lm_rows"], h), s, "lm_head", 1 / math.sqrt(h))
        self.weights = w

    def _use_weights(self, weights: dict[str, Any]) -> None:
        ref = LlamaDecoder.weight_shapes(self.preset, self.dims)
        if set(weights) != set(ref):
            raise ValueError(f"weights must have the keys {sorted(ref)}, got {sorted(weights)}")
        for k, shape in ref.items():
            w = weights[k]
            if tuple(w.shape) != shape or w.dtype != self.ops.dtype or not isinstance(w, type(self.ops.empty((1,)))):
                raise ValueError(f"weights[{k!r}] must be a {shape} array of the model dtype and front end, got "
                                 f"{type(w).__name__} {tuple(w.shape)} {w.dtype}")
        self.weights = dict(weights)

    @staticmethod
    def weight_shapes(preset: ModelPreset, dims: dict[str, int]) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every weight (see the class docstring)."""
        h, d, i = dims["hidden"], dims["d"], dims["inter"]
        nqkv = (dims["hq"] + 2 * dims["hkv"]) * d
        out: dict[str, tuple[int, ...]] = {"embed": (dims["vocab"], h)}
        for layer in range(dims["layers"]):
            p = f"layers.{layer}."
            out.update({p + "attn_norm": (h,), p + "wqkv": (nqkv, h), p + "wo": (h, dims["hq"] * d),
                        p + "mlp_norm": (h,), p + "w_gate_up": (2 * i, h), p + "w_down": (h, i)})
            if preset.qkv_bias:
                out[p + "bqkv"] = (nqkv,)
        out.update({"final_norm": (h,), "lm_head": (dims["lm_rows"], h)})
        return out

    def _make_cache(self) -> None:
        m, b = self.dims, self.batch
        if self.cache_kind == "paged":
            pps = -(-self.max_seqlen // self.page_size)
            extra = {} if self.kv_format is None else {"kv_format": self.kv_format}
            try:
                self.cache = fdpp.PagedKVCache(m["layers"], b * pps, self.page_size, m["hkv"], m["d"],
                                               dtype=self.dtype, kv_layout=self.kv_layout, max_batch=b,
                                               max_pages_per_seq=pps, backend=self.backend,
                                               device=self.ops.device, **extra)
            except TypeError as e:
                if self.kv_format is not None and "kv_format" in str(e):
                    raise ValueError(f"kv_format={self.kv_format!r}: this fdpp's PagedKVCache has no "
                                     f"kv_format argument ({e})") from None
                raise
            self.seqs = [self.cache.allocate() for _ in range(b)]
            self.cache.set_batch(self.seqs)
            self._lens_dev = self.cache.seqlens
            self._block_table = self.cache.block_table
            self._kv = [(self.cache.k_pages(i), self.cache.v_pages(i)) for i in range(m["layers"])]
        else:
            self.cache = None
            shape = (m["layers"], b, self.max_seqlen, m["hkv"], m["d"])
            self.k_cache, self.v_cache = self.ops.empty(shape), self.ops.empty(shape)
            self._lens_host = np.zeros(b, dtype=np.int32)
            self._lens_dev = self.ops.empty((b,), np.int32)
            self._kv = [(self.k_cache[i], self.v_cache[i]) for i in range(m["layers"])]

    def _make_buffers(self) -> None:
        m, b, e = self.dims, self.batch, self.ops.empty
        self.ids = e((b,), np.int32)
        self.x = e((b, m["hidden"]))
        self.h = e((b, m["hidden"]))
        self.qkv = e((b, (m["hq"] + 2 * m["hkv"]) * m["d"]))
        self.q = e((b, m["hq"], m["d"]))
        self.k_new = e((b, m["hkv"], m["d"]))
        self.v_new = e((b, m["hkv"], m["d"]))
        self.attn_out = e((b, m["hq"], m["d"]))
        self.proj = e((b, m["hidden"]))
        self.gate_up = e((b, 2 * m["inter"]))
        self.act = e((b, m["inter"]))
        self.logits = e((b, m["lm_rows"]))

    def _gemm(self, x: Any, name: str, bias: Any, out: Any, *, residual: Any = None,
              rms: bool = False) -> Callable[[], Any]:
        """``out = x w^T (+ bias) (+ residual)`` by fdpp.flat_gemm (``rms``: of rmsnorm(x), the
        norm folded into w), ``w`` the GEMM weight ``name`` (its FP8 codes and scales when
        :attr:`fp8_weights` holds it). CuPy cannot capture cuBLAS calls, so on the CuPy front end
        an unfused shape the table gives to cuBLAS runs fdpp's heuristic kernel instead (eager and
        captured alike; a fused call never takes cuBLAS)."""
        flat_gemm = fdpp.flat_gemm
        eps = self.preset.rms_eps if rms else None
        if name in self.fp8_weights:
            codes, scale = self.fp8_weights[name]
            return lambda: flat_gemm(x, codes, w_scale=scale, bias=bias, residual=residual, rms_eps=eps, out=out)
        w = self.gemm_weights[name]
        if residual is not None or rms:
            return lambda: flat_gemm(x, w, bias=bias, residual=residual, rms_eps=eps, out=out)
        if self.backend == "cupy":
            from fdpp import gemm, registry

            (mm, k), n = x.shape, w.shape[0]
            lim = registry.device_limits(self.ops.device)
            if gemm.choose(mm, n, k, lim, self.dtype).impl == "cublas":
                plan = gemm.heuristic_plan(mm, n, k, self.dtype, lim)

                def forced() -> Any:
                    with gemm.forced_plan(plan):
                        return flat_gemm(x, w, bias=bias, out=out)

                return forced
        return lambda: flat_gemm(x, w, bias=bias, out=out)

    def _attention(self, layer: int) -> Callable[[], Any]:
        q, o, lens = self.q, self.attn_out, self._lens_dev
        kc, vc = self._kv[layer]
        if self.nosplit:
            return lambda: fdpp.decode_attention_nosplit(q, kc, vc, cache_seqlens=lens, out=o)
        if self.cache_kind == "contiguous":
            return lambda: fdpp.decode_attention(q, kc, vc, cache_seqlens=lens, out=o)
        bt, layout = self._block_table, self.kv_layout
        # A quantized cache may need more arguments (scales); the hook name is the integration point
        # with the KV-format work: PagedKVCache.attention_kwargs(layer) -> dict, when it exists.
        hook = getattr(self.cache, "attention_kwargs", None)
        kw = dict(hook(layer)) if hook is not None else {}
        return lambda: fdpp.paged_decode_attention(q, kc, vc, bt, lens, out=o, kv_layout=layout, **kw)

    def _append(self, layer: int) -> Callable[[], Any]:
        k, v = self.k_new, self.v_new
        if self.cache_kind == "paged":
            cache = self.cache
            return lambda: cache.append(layer, k, v)
        kc, vc = self._kv[layer]
        lens, ops = self._lens_dev, self.ops
        return lambda: ops.contiguous_append(kc, vc, k, v, lens)

    def _rope_append(self, layer: int) -> list[tuple[str, Callable[[], Any]]]:
        """The step's RoPE and KV append of ``layer``: one fused op, or the two."""
        ops, lens = self.ops, self._lens_dev
        cos, sin, q, qkv = self.rope_cos, self.rope_sin, self.q, self.qkv
        if not self.fuse_rope_append:
            return [("rope", lambda: ops.rope_qkv(qkv, cos, sin, lens, q, self.k_new, self.v_new)),
                    ("kv_append", self._append(layer))]
        if self.cache_kind == "paged":
            cache = self.cache
            return [("rope_append", lambda: cache.append_rope(layer, qkv, cos, sin, q))]
        kc, vc = self._kv[layer]
        return [("rope_append", lambda: ops.rope_qkv_append(qkv, cos, sin, lens, q, kc, vc))]

    def _build_program(self) -> list[tuple[str, Callable[[], Any]]]:
        ops, w, m = self.ops, self.weights, self.dims
        eps = self.preset.rms_eps
        x, h = self.x, self.h
        b = self.batch
        o2 = self.attn_out.reshape(b, m["hq"] * m["d"])
        prog: list[tuple[str, Callable[[], Any]]] = [("embed", lambda: ops.embed(w["embed"], self.ids, x))]
        if self.fuse_norms:  # norms in the GEMM prologues, residual adds in the o / down epilogues
            for layer in range(m["layers"]):
                p = f"layers.{layer}."
                prog += [
                    ("qkv", self._gemm(x, p + "wqkv", w.get(p + "bqkv"), self.qkv, rms=True)),
                    *self._rope_append(layer),
                    ("attention", self._attention(layer)),
                    ("o_proj", self._gemm(o2, p + "wo", None, x, residual=x)),
                    ("gate_up", self._gemm(x, p + "w_gate_up", None, self.gate_up, rms=True)),
                    ("silu_mul", lambda: ops.silu_mul(self.gate_up, self.act)),
                    ("down", self._gemm(self.act, p + "w_down", None, x, residual=x)),
                ]
            prog.append(("lm_head", self._gemm(x, "lm_head", None, self.logits, rms=True)))
            return prog
        # The residual add and the RMSNorm after it are one op (add_rmsnorm): layer 0's attn_norm
        # alone, then after o_proj (+ mlp_norm) and after down (+ the next attn_norm, or final_norm).
        na0 = w["layers.0.attn_norm"]
        prog.append(("attn_norm", lambda: ops.rmsnorm(x, na0, eps, h)))
        for layer in range(m["layers"]):
            p = f"layers.{layer}."
            nm = w[p + "mlp_norm"]
            last = layer == m["layers"] - 1
            nxt = w["final_norm"] if last else w[f"layers.{layer + 1}.attn_norm"]
            prog += [
                ("qkv", self._gemm(h, p + "wqkv", w.get(p + "bqkv"), self.qkv)),
                *self._rope_append(layer),
                ("attention", self._attention(layer)),
                ("o_proj", self._gemm(o2, p + "wo", None, self.proj)),
                ("residual_mlp_norm", lambda nm=nm: ops.add_rmsnorm(x, self.proj, nm, eps, h)),
                ("gate_up", self._gemm(h, p + "w_gate_up", None, self.gate_up)),
                ("silu_mul", lambda: ops.silu_mul(self.gate_up, self.act)),
                ("down", self._gemm(self.act, p + "w_down", None, self.proj)),
                ("residual_final_norm" if last else "residual_attn_norm",
                 lambda nxt=nxt: ops.add_rmsnorm(x, self.proj, nxt, eps, h)),
            ]
        prog.append(("lm_head", self._gemm(h, "lm_head", None, self.logits)))
        return prog

    # ---- state -------------------------------------------------------------------------------
    @property
    def lengths(self) -> np.ndarray:
        """int64 [B]: tokens held per sequence (context and decoded tokens), on the host."""
        if self.cache_kind == "paged":
            return np.array([self.cache.length(s) for s in self.seqs], dtype=np.int64)
        return self._lens_host.astype(np.int64)

    @property
    def seqlens(self) -> Any:
        """int32 [B] device array of the lengths (what the kernels read)."""
        return self._lens_dev

    def random_kv(self, layer: int, row: int, start: int, count: int) -> tuple[Any, Any]:
        """K and V ``[count, Hkv, D]`` of the random context of sequence ``row`` in ``layer``,
        tokens ``start .. start + count - 1`` (model dtype; std 1). A function of the seed and
        of the token position only, so any chunking gives the same context."""
        m = self.dims
        row_elems = m["hkv"] * m["d"]
        shape = (count, m["hkv"], m["d"])
        name = f"kv.{layer}.{row}."
        return (self.ops.random(shape, self.seed, name + "k", 1.0, offset=start * row_elems),
                self.ops.random(shape, self.seed, name + "v", 1.0, offset=start * row_elems))

    def prefill_random(self, lengths: int | Sequence[int]) -> None:
        """Fill the (empty) cache with a random context of ``lengths`` tokens per sequence (an int
        for all, or B ints) without running a prefill: K/V from :meth:`random_kv`, written with
        ``PagedKVCache.extend`` (or into the contiguous arrays) in chunks of 32M elements.
        Lengths are in [0, max_seqlen - 1] (room for one decode step at least)."""
        lens = np.broadcast_to(_host_ints("lengths", lengths), (self.batch,)).copy()
        if lens.min() < 0 or lens.max() > self.max_seqlen - 1:
            raise ValueError(f"lengths must be in [0, max_seqlen - 1 = {self.max_seqlen - 1}], got {lens.tolist()}")
        if self.lengths.any():
            raise ValueError("prefill_random fills an empty cache; this model already holds tokens "
                             f"{self.lengths.tolist()} (make a new LlamaDecoder)")
        m = self.dims
        chunk = max(1, (1 << 25) // (m["hkv"] * m["d"]))
        for b, n in enumerate(lens.tolist()):
            for t0 in range(0, n, chunk):
                c = min(chunk, n - t0)
                if self.cache_kind == "paged":
                    self.cache.extend_reserve(self.seqs[b], c)
                for layer in range(m["layers"]):
                    k, v = self.random_kv(layer, b, t0, c)
                    if self.cache_kind == "paged":
                        self.cache.extend(layer, self.seqs[b], k, v)
                    else:
                        self.ops.copy_(self.k_cache[layer, b, t0:t0 + c], k)
                        self.ops.copy_(self.v_cache[layer, b, t0:t0 + c], v)
        if self.cache_kind == "contiguous":
            self._lens_host[:] = lens
            self.ops.copy_(self._lens_dev, self._lens_host)

    def kv_numpy(self, layer: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Host copies of the cached K and V of each sequence of ``layer``: B pairs of
        ``[length_b, Hkv, D]`` arrays (native KV formats)."""
        out = []
        lens = self.lengths
        if self.cache_kind == "contiguous":
            kc, vc = (self.ops.to_numpy(a[layer]) for a in (self.k_cache, self.v_cache))
            return [(kc[b, :n], vc[b, :n]) for b, n in enumerate(lens.tolist())]
        c = self.cache
        kp, vp = c.to_numpy(c.k_pages(layer)), c.to_numpy(c.v_pages(layer))
        bt = c.to_numpy(c.block_table)
        for b, n in enumerate(lens.tolist()):
            pages = bt[b, :-(-n // c.page_size)]
            kb, vb = kp[pages], vp[pages]
            if self.kv_layout == "HND":
                kb, vb = kb.transpose(0, 2, 1, 3), vb.transpose(0, 2, 1, 3)
            hd = kb.shape[2:]
            out.append((kb.reshape(-1, *hd)[:n], vb.reshape(-1, *hd)[:n]))
        return out

    # ---- steps -------------------------------------------------------------------------------
    def advance(self) -> None:
        """Host side of a step: room for one more token per sequence (``reserve(1)`` / the
        contiguous lengths + 1), device lengths rewritten on the current stream."""
        if int(self.lengths.max()) + 1 > self.max_seqlen:
            raise ValueError(f"a sequence would exceed max_seqlen={self.max_seqlen}")
        if self.cache_kind == "paged":
            self.cache.reserve(1)
        else:
            self._lens_host += 1
            self.ops.copy_(self._lens_dev, self._lens_host)

    def set_tokens(self, token_ids: Any) -> None:
        """Copy ``token_ids`` ([B] ints: a sequence, NumPy array or a device array of the front
        end) into the input buffer."""
        if isinstance(token_ids, (list, tuple, np.ndarray, int, np.integer)):
            ids = np.broadcast_to(_host_ints("token_ids", token_ids), (self.batch,))
            if ids.min() < 0 or ids.max() >= self.dims["vocab"]:
                raise ValueError(f"token ids must be in [0, {self.dims['vocab']}), got {ids.tolist()}")
            self.ops.copy_(self.ids, ids.astype(np.int32))
        else:
            if tuple(token_ids.shape) != (self.batch,):
                raise ValueError(f"token_ids must have shape ({self.batch},), got {tuple(token_ids.shape)}")
            self.ops.copy_(self.ids, token_ids)

    def forward(self) -> None:
        """Run :attr:`program` (the step's kernels) on the current stream."""
        for _, fn in self.program:
            fn()

    def step(self, token_ids: Any, *, copy: bool = True) -> Any:
        """One decode step: append each sequence's token, attend over its whole context.

        Parameters
        ----------
        token_ids : [B] ints
            This step's token of each sequence (host sequence/array or a device array).
        copy : bool
            Return a copy of the logits (default) or the :attr:`logits` buffer itself (valid until
            the next step).

        Returns
        -------
        logits : array [B, vocab / tp], model dtype, the front end's array type
        """
        fdpp.api.check_flag("copy", copy)
        self.set_tokens(token_ids)
        self.advance()
        self.forward()
        lg = self.logits
        if not copy:
            return lg
        return lg.clone() if self.backend == "torch" else lg.copy()

    def capture(self, token_ids: Any = None) -> CapturedStep:
        """A CUDA-graph-replayable decode step (torch: ``torch.cuda.CUDAGraph``; CuPy:
        ``Stream.begin_capture``).

        First runs one real, eager step of ``token_ids`` (default token 0) on the capture stream
        (compiles every kernel, creates fdpp's per-stream workspaces): **the context grows by one
        token**. Then captures :meth:`forward` (advance not included). See :class:`CapturedStep`.
        """
        if self.backend == "numpy":
            raise ValueError("capture needs a GPU front end (backend 'torch' or 'cupy')")
        tok = 0 if token_ids is None else token_ids
        if self.backend == "torch":
            import torch

            s = torch.cuda.Stream(device=self.ops.device)
            s.wait_stream(torch.cuda.current_stream(self.ops.device))
            with torch.cuda.stream(s):
                self.step(tok, copy=False)
            s.synchronize()
            g = torch.cuda.CUDAGraph()
            # "relaxed": fdpp's CuPy launches query the device during capture
            with torch.cuda.graph(g, stream=s, capture_error_mode="relaxed"):
                self.forward()
            torch.cuda.current_stream(self.ops.device).wait_stream(s)
            return CapturedStep(self, g, None)
        import cupy

        with cupy.cuda.Device(self.ops.device):
            s = cupy.cuda.Stream(non_blocking=True)
            s.wait_event(cupy.cuda.get_current_stream().record())  # weights, prefill: queued on the current stream
            with s:
                self.step(tok, copy=False)
                s.synchronize()
                s.begin_capture()
                try:
                    self.forward()
                finally:
                    g = s.end_capture()
                g.upload(s)
            s.synchronize()
        self._graph_streams.append(s)
        return CapturedStep(self, g, s)


class CapturedStep:
    """A decode step captured in a CUDA graph (made by :meth:`LlamaDecoder.capture`).

    ``step(token_ids)`` (or calling the object): copy the tokens into the input buffer, advance the
    cache on the host (``reserve(1)``), replay the graph; returns the model's :attr:`logits`
    buffer (valid until the next step). ``replay()``: the graph alone, no advance: the same
    position decoded again (its K/V slot rewritten), which is what a benchmark replays.
    torch replays on torch's current stream; CuPy on the capture stream, which the current stream
    then waits for.
    """

    def __init__(self, model: LlamaDecoder, graph: Any, stream: Any):
        self.model, self.graph, self.stream = model, graph, stream

    def replay(self) -> None:
        if self.stream is None:
            self.graph.replay()
            return
        import cupy

        self.graph.launch(self.stream)
        cupy.cuda.get_current_stream().wait_event(self.stream.record())

    def step(self, token_ids: Any = None) -> Any:
        m = self.model
        if self.stream is None:
            if token_ids is not None:
                m.set_tokens(token_ids)
            m.advance()
            self.graph.replay()
            return m.logits
        with self.stream:
            if token_ids is not None:
                m.set_tokens(token_ids)
            m.advance()
        self.replay()
        return m.logits

    __call__ = step
