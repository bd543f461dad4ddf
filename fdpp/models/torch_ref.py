"""A PyTorch reference of :class:`fdpp.models.llama.LlamaDecoder`: the same model (the decoder's
weight tensors themselves) in plain torch: ``torch.nn.functional.linear`` (cuBLAS),
``scaled_dot_product_attention(..., enable_gqa=True)`` over a contiguous HND cache
``[layers, B, Hkv, max_seqlen, D]``, eager or captured in a ``torch.cuda.CUDAGraph``.

Its elementwise ops are written here, independently of fdpp's front ends, in the Hugging Face
Llama style: RMSNorm in float32, RoPE (rotate-half) in float32 from a float64-made table,
``silu(gate) * up`` in the model dtype.

Attention, two forms:

- ``masked``: over all ``max_seqlen`` slots with a boolean mask ``slot < length`` built on the
  device from the device lengths; valid for any lengths, and for every replay of one captured
  graph while the lengths grow (what :meth:`TorchReference.capture` gives by default).
- ``sliced``: over the first ``n`` slots with no mask (all lengths equal to ``n``): what an eager
  decode loop does, and SDPA's fastest kernels; a graph captured this way
  (``capture(dynamic=False)``) is valid at that one length only (``replay()``: the same position
  again), which is what the benchmark times.

:func:`compare_logits` runs a decoder and its reference side by side, step by step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fdpp.models._backends import rope_tables
from fdpp.models.llama import LlamaDecoder


class TorchReference:
    """The reference model of ``decoder`` (a torch-front-end :class:`LlamaDecoder`).

    Parameters
    ----------
    decoder : LlamaDecoder
        backend "torch"; its weights are used as they are (shared tensors) and its
        :meth:`~LlamaDecoder.random_kv` gives :meth:`prefill_random` the same context.
    max_seqlen : int, optional
        Slots of the contiguous cache (default the decoder's).
    batch : int, optional
        Default the decoder's.

    Attributes
    ----------
    k_cache, v_cache : torch.Tensor [layers, B, Hkv, max_seqlen, D], model dtype
    logits : torch.Tensor [B, vocab / tp] (the output buffer of captured steps)
    """

    def __init__(self, decoder: LlamaDecoder, *, max_seqlen: int | None = None, batch: int | None = None):
        import torch

        if decoder.backend != "torch":
            raise ValueError(f"TorchReference needs a decoder with backend='torch', got {decoder.backend!r}")
        self.torch, self.F = torch, torch.nn.functional
        self.decoder, self.w, self.dims, self.preset = decoder, decoder.weights, decoder.dims, decoder.preset
        self.batch = decoder.batch if batch is None else int(batch)
        self.max_seqlen = decoder.max_seqlen if max_seqlen is None else int(max_seqlen)
        dev = decoder.ops.tdev
        self.dtype = decoder.ops.dtype
        cos, sin = rope_tables(self.max_seqlen, self.dims["d"], self.preset.rope_theta)
        self.cos, self.sin = torch.from_numpy(cos).to(dev), torch.from_numpy(sin).to(dev)
        m = self.dims
        shape = (m["layers"], self.batch, m["hkv"], self.max_seqlen, m["d"])
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=dev)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=dev)
        self.lens_host = np.zeros(self.batch, dtype=np.int64)
        self.lens = torch.zeros(self.batch, dtype=torch.int64, device=dev)
        self.ids = torch.zeros(self.batch, dtype=torch.int64, device=dev)
        self.logits = torch.zeros((self.batch, m["lm_rows"]), dtype=self.dtype, device=dev)
        self._slots = torch.arange(self.max_seqlen, device=dev)
        self._rows = torch.arange(self.batch, device=dev)

    # ---- state ---------------------------------------------------------------------------------
    def prefill_random(self, lengths: int | Sequence[int]) -> None:
        """The decoder's random context (same seed, same values) of ``lengths`` tokens."""
        lens = np.broadcast_to(np.asarray(lengths, dtype=np.int64), (self.batch,)).copy()
        if lens.min() < 0 or lens.max() > self.max_seqlen - 1:
            raise ValueError(f"lengths must be in [0, {self.max_seqlen - 1}], got {lens.tolist()}")
        chunk = max(1, (1 << 25) // (self.dims["hkv"] * self.dims["d"]))
        for b, n in enumerate(lens.tolist()):
            for t0 in range(0, n, chunk):
                c = min(chunk, n - t0)
                for layer in range(self.dims["layers"]):
                    k, v = self.decoder.random_kv(layer, b, t0, c)  # [c, Hkv, D]
                    self.k_cache[layer, b, :, t0:t0 + c] = k.transpose(0, 1)
                    self.v_cache[layer, b, :, t0:t0 + c] = v.transpose(0, 1)
        self.lens_host[:] = lens
        self.lens.copy_(self.torch.from_numpy(lens))

    def advance(self) -> None:
        if int(self.lens_host.max()) + 1 > self.max_seqlen:
            raise ValueError(f"a sequence would exceed max_seqlen={self.max_seqlen}")
        self.lens_host += 1
        self.lens.copy_(self.torch.from_numpy(self.lens_host))

    def set_tokens(self, token_ids: Any) -> None:
        t = self.torch
        ids = token_ids if isinstance(token_ids, t.Tensor) else t.from_numpy(
            np.broadcast_to(np.asarray(token_ids, dtype=np.int64), (self.batch,)).copy())
        self.ids.copy_(ids)

    # ---- the step ------------------------------------------------------------------------------
    def _rmsnorm(self, x: Any, w: Any) -> Any:
        x32 = x.float()
        return (x32 * self.torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.preset.rms_eps)
                * w.float()).to(self.dtype)

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        """x [B, H, D]; cos, sin [B, 1, D/2]."""
        d2 = x.shape[-1] // 2
        x32 = x.float()
        x1, x2 = x32[..., :d2], x32[..., d2:]
        return self.torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(self.dtype)

    def forward(self, sliced: int | None = None) -> Any:
        """One forward pass of the tokens in :attr:`ids` at the device lengths (advanced first);
        writes and returns :attr:`logits`. ``sliced``: attend over the first ``sliced`` slots
        without a mask (every length must equal it), else the masked form."""
        F, w, m = self.F, self.w, self.dims
        b, hq, hkv, d = self.batch, m["hq"], m["hkv"], m["d"]
        pos = self.lens - 1
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
        mask = None if sliced else (self._slots[None, :] < self.lens[:, None])[:, None, None, :]
        x = F.embedding(self.ids, w["embed"])
        for layer in range(m["layers"]):
            p = f"layers.{layer}."
            h = self._rmsnorm(x, w[p + "attn_norm"])
            qkv = F.linear(h, w[p + "wqkv"], w.get(p + "bqkv"))
            q = self._rope(qkv[:, :hq * d].view(b, hq, d), cos, sin)
            k = self._rope(qkv[:, hq * d:(hq + hkv) * d].view(b, hkv, d), cos, sin)
            v = qkv[:, (hq + hkv) * d:].view(b, hkv, d)
            kc, vc = self.k_cache[layer], self.v_cache[layer]  # [B, Hkv, S, D]
            kc.transpose(1, 2).index_put_((self._rows, pos), k)
            vc.transpose(1, 2).index_put_((self._rows, pos), v)
            if sliced:
                kc, vc = kc[:, :, :sliced], vc[:, :, :sliced]
            o = F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, attn_mask=mask, enable_gqa=True)
            x = x + F.linear(o.reshape(b, hq * d), w[p + "wo"])
            h = self._rmsnorm(x, w[p + "mlp_norm"])
            gate, up = F.linear(h, w[p + "w_gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w[p + "w_down"])
        self.logits.copy_(F.linear(self._rmsnorm(x, w["final_norm"]), w["lm_head"]))
        return self.logits

    def _equal_length(self) -> int | None:
        n = self.lens_host
        return int(n[0]) if n.size and (n == n[0]).all() else None

    def step(self, token_ids: Any) -> Any:
        """One eager decode step; returns a copy of the logits [B, vocab / tp]. Equal lengths
        attend the sliced way, unequal ones the masked way."""
        self.set_tokens(token_ids)
        self.advance()
        return self.forward(sliced=self._equal_length()).clone()

    def capture(self, token_ids: Any = None, *, dynamic: bool = True) -> CapturedReference:
        """A graph-captured step. Runs one real eager step of ``token_ids`` (default 0) on the
        capture stream first (the context grows by one token), then captures :meth:`forward`:
        masked (``dynamic=True``: valid as the lengths grow) or sliced at the length the next
        step would have (``dynamic=False``: :meth:`CapturedReference.replay` only)."""
        t = self.torch
        s = t.cuda.Stream(device=self.lens.device)
        s.wait_stream(t.cuda.current_stream(self.lens.device))
        with t.cuda.stream(s):
            self.step(0 if token_ids is None else token_ids)
        s.synchronize()
        sliced = None
        if not dynamic:
            n = self._equal_length()
            if n is None:
                raise ValueError(f"dynamic=False needs equal lengths, got {self.lens_host.tolist()}")
            # the graph decodes position n (the next step's) again on every replay
            self.advance()
            sliced = n + 1
        g = t.cuda.CUDAGraph()
        with t.cuda.graph(g, stream=s):
            self.forward(sliced=sliced)
        t.cuda.current_stream(self.lens.device).wait_stream(s)
        return CapturedReference(self, g, dynamic)


class CapturedReference:
    """``step(token_ids)``: tokens in, advance, replay, the :attr:`TorchReference.logits` buffer
    out (``dynamic`` captures only). ``replay()``: the graph alone."""

    def __init__(self, ref: TorchReference, graph: Any, dynamic: bool):
        self.ref, self.graph, self.dynamic = ref, graph, dynamic

    def replay(self) -> None:
        self.graph.replay()

    def step(self, token_ids: Any = None) -> Any:
        if not self.dynamic:
            raise ValueError("a dynamic=False capture attends over one fixed length: use replay()")
        if token_ids is not None:
            self.ref.set_tokens(token_ids)
        self.ref.advance()
        self.graph.replay()
        return self.ref.logits

    __call__ = step


def compare_logits(decoder: LlamaDecoder, reference: TorchReference, steps: int, *,
                   tokens: Sequence[Sequence[int]] | None = None, decoder_step: Any = None,
                   reference_step: Any = None) -> list[dict[str, float]]:
    """Decode ``steps`` steps with both models on the same tokens and compare the logits.

    Parameters
    ----------
    decoder, reference
        Holding the same context (e.g. both ``prefill_random(n)``).
    steps : int
    tokens : [steps][B] ints, optional
        Teacher-forced inputs. Default: greedy on the reference (step 0 feeds token 1 to every
        sequence; step i feeds the reference's argmax of step i - 1).
    decoder_step, reference_step : callable, optional
        What runs one step (default ``decoder.step`` / ``reference.step``; e.g. captured steps).

    Returns
    -------
    One dict per step: ``max_abs`` (max |decoder - reference| over the logits), ``scale`` (max
    |reference|), ``argmax_agree`` (fraction of sequences with the same argmax) and ``margin``
    (smallest top-1 minus top-2 gap of the reference's logits, to judge argmax flips).
    """
    import torch

    dstep = decoder_step or decoder.step
    rstep = reference_step or reference.step
    out: list[dict[str, float]] = []
    ids = [1] * decoder.batch
    for i in range(steps):
        if tokens is not None:
            ids = list(tokens[i])
        a = dstep(ids).float()
        r = rstep(ids).float()
        top2 = torch.topk(r, 2, dim=-1).values
        out.append({
            "step": float(i), "max_abs": float((a - r).abs().max()), "scale": float(r.abs().max()),
            "argmax_agree": float((a.argmax(-1) == r.argmax(-1)).float().mean()),
            "margin": float((top2[:, 0] - top2[:, 1]).min()),
        })
        ids = r.argmax(-1).tolist()
    return out
