"""Hugging Face ``transformers`` integration: fdpp decode attention as an attention implementation.

Usage (the three lines)::

    import fdpp.integrations.hf
    fdpp.integrations.hf.register()                       # adds "fdpp" to transformers' attention functions
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="fdpp")   # or ._from_config(cfg, ...)

What runs where:

- **decode steps** (one query token, ``query.shape[2] == 1``): fdpp. Without an attention mask
  (what transformers passes for an unpadded batch), :func:`fdpp.decode_attention` reads the cache
  tensors transformers hands over (DynamicCache: the whole contiguous cache ``[B, Hkv, N, D]``,
  i.e. fdpp's ``kv_layout="HND"``) in place. With a mask (left-padded batches, older transformers
  that always build one), the keys each row may see are turned into a page table of one-token
  pages over the same tensors, built on the device (no host synchronisation), and
  :func:`fdpp.paged_decode_attention` attends to exactly those keys: any per-row key mask works
  (left padding, holes). The mask must not depend on the head and, for float masks, be additive
  0 / large negative (anything else than a key mask, e.g. an ALiBi bias, is not supported).
- **prefill steps** (``q_len > 1``): transformers' own SDPA attention function, unchanged.

CPU tensors (tests without a GPU) go through fdpp's NumPy paths (the split-KV emulator).
Registration uses ``AttentionInterface.register`` where it exists (transformers >= 4.50 or so),
else the ``ALL_ATTENTION_FUNCTIONS`` dict, and registers SDPA's mask function under the same name
where ``AttentionMaskInterface`` exists (so masks are built as for SDPA: None when no token is
masked).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

import fdpp

NAME = "fdpp"
_table_cache: dict[str, Any] = {}  # the page table of the last mask (one per decode step, all layers)


def register(name: str = NAME) -> str:
    """Register :func:`fdpp_attention_forward` as ``attn_implementation=name``; returns ``name``.

    Safe to call more than once."""
    try:
        from transformers import AttentionInterface
    except ImportError:  # older transformers: a plain dict
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS[name] = fdpp_attention_forward
    else:
        AttentionInterface.register(name, fdpp_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        pass
    else:
        AttentionMaskInterface.register(name, sdpa_mask)
    return name


def use_fdpp(model: Any, name: str = NAME) -> Any:
    """Switch an existing model to fdpp attention (``model.set_attn_implementation`` where it
    exists, else the config field every attention layer reads); returns the model."""
    register(name)
    setter = getattr(model, "set_attn_implementation", None)
    try:
        if setter is None:
            raise AttributeError("set_attn_implementation")
        setter(name)
    except (AttributeError, ValueError, KeyError, TypeError):  # older transformers: the config field
        model.config._attn_implementation = name
    return model


def _sdpa(*args: Any, **kwargs: Any) -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def fdpp_attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                           scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Any, None]:
    """A transformers attention function.

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (read: ``training``).
    query : torch.Tensor [B, Hq, S, D]
    key, value : torch.Tensor [B, Hkv, N, D]
        The whole cache of this layer including this step's tokens.
    attention_mask : torch.Tensor [B or 1, 1, S, N] or None
        bool (True: attend) or additive float (0: attend); None: every key.
    scaling : float, optional
        Softmax scale (default 1/sqrt(D)).
    dropout : float
        Must be 0 on decode steps (inference).

    Returns
    -------
    attn_output : torch.Tensor [B, S, Hq, D], query's dtype
    attn_weights : None

    Raises
    ------
    ValueError
        Decode-step inputs fdpp cannot serve: dropout, softcap, a head-dependent mask.
    """
    if query.shape[2] != 1:
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout and getattr(module, "training", False):
        raise ValueError("fdpp attention is for inference: dropout must be 0")
    if kwargs.get("softcap") is not None:
        raise ValueError("fdpp attention has no logit softcapping (softcap)")
    b, hkv, n, d = key.shape
    q = query[:, :, 0, :]
    key, value = _dense_rows(key), _dense_rows(value)
    if attention_mask is None:
        out = _call(fdpp.decode_attention, q, key, value, None, None, softmax_scale=scaling, kv_layout="HND")
    else:
        kp, vp = _token_pages(key), _token_pages(value)
        table, lens = _mask_table(attention_mask, b, hkv, n, key)
        out = _call(fdpp.paged_decode_attention, q, kp, vp, table, lens, softmax_scale=scaling, kv_layout="HND")
    return out.unsqueeze(1), None


def _dense_rows(x: Any) -> Any:
    """``x`` [B, Hkv, N, D] with unit stride in D, token stride D and batch stride a multiple of
    it (what DynamicCache gives); else a contiguous copy."""
    sb, sh, sn, sd = x.stride()
    d = x.shape[-1]
    if sd == 1 and sn == d and sb % d == 0 and x.data_ptr() % 16 == 0 and sh % 8 == 0:
        return x
    return x.contiguous()


def _token_pages(x: Any) -> Any:
    """A pool of one-token pages over ``x`` [B, Hkv, N, D] (HND pages ``[P, Hkv, 1, D]``): page
    ``b * (stride_b / D) + t`` is token t of row b; pages overlap (a page's heads lie N tokens
    apart), which is fine for reading. P covers exactly the tensor's extent."""
    b, hkv, n, d = x.shape
    sb, sh, sn, _ = x.stride()
    per_row = sb // sn
    pages = (b - 1) * per_row + n
    return x.as_strided((pages, hkv, 1, d), (sn, sh, sn, 1))


def _key_mask(mask: Any, b: int, n: int) -> Any:
    """bool [B, N]: the keys each row may attend to."""
    import torch

    if mask.dim() != 4 or mask.shape[2] != 1:
        raise ValueError(f"fdpp attention expects a [B, 1, 1, N] mask on decode steps, got {tuple(mask.shape)}")
    if mask.shape[1] != 1:
        raise ValueError(f"fdpp attention takes masks shared by all heads, got shape {tuple(mask.shape)}")
    if mask.shape[-1] != n:
        raise ValueError(f"the mask covers {mask.shape[-1]} keys but the cache holds {n}")
    m = mask[:, 0, 0, :]
    valid = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    return valid.expand(b, n)


def _mask_table(mask: Any, b: int, hkv: int, n: int, key: Any) -> tuple[Any, Any]:
    """(int32 block table [B, N], int32 lengths [B]) of the keys ``mask`` lets each row see, in
    order, as pages of :func:`_token_pages`; computed on the device once per mask object (every
    layer of a step gets the same mask)."""
    import torch

    per_row = key.stride(0) // key.stride(2)
    if (b - 1) * per_row + n >= 2**31:
        raise ValueError("the cache is too large for int32 page indices")
    hit = _table_cache.get("mask")
    if hit is not None and hit[0]() is mask and hit[1] == (mask._version, b, n, per_row, key.device):
        return hit[2]
    valid = _key_mask(mask, b, n)
    lens = valid.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)  # visible keys first, in order
    base = torch.arange(b, device=key.device, dtype=torch.int64)[:, None] * per_row
    table = (order + base).to(torch.int32)
    _table_cache["mask"] = (weakref.ref(mask), (mask._version, b, n, per_row, key.device), (table, lens))
    return table, lens


def _call(fn: Any, q: Any, k: Any, v: Any, table: Any, lens: Any, **kw: Any) -> Any:
    """fdpp call on CUDA tensors; CPU tensors through NumPy (fdpp's emulator) and back."""
    if q.is_cuda:
        if table is None:
            return fn(q, k, v, cache_seqlens=lens, **kw)
        return fn(q, k, v, table, lens, **kw)
    import torch

    def host(x: Any) -> np.ndarray:
        t = x.detach()
        if t.dtype == torch.bfloat16:
            a = t.view(torch.int16).numpy().view(fdpp.dtypes.DTYPES["bf16"].np_dtype)
        else:
            a = t.numpy()
        return a

    def strided(x: Any) -> np.ndarray:  # the same view over the storage (pages overlap)
        base = host(x.as_strided((x.untyped_storage().nbytes() // x.element_size(),), (1,), 0))
        return np.lib.stride_tricks.as_strided(base[x.storage_offset():], x.shape,
                                               tuple(s * x.element_size() for s in x.stride()),
                                               writeable=False)

    args = [np.ascontiguousarray(host(q)), strided(k), strided(v)]
    if table is None:
        o = fn(*args, cache_seqlens=None, **kw)
    else:
        o = fn(*args, host(table), host(lens), **kw)
    if o.dtype == fdpp.dtypes.DTYPES["bf16"].np_dtype:
        return torch.from_numpy(o.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(o)
