"""PyTorch custom ops (``torch.library``): fdpp calls that ``torch.compile`` traces without a
graph break, with fake (meta) implementations for shape inference.

Registered when this module is imported; ``import fdpp`` imports it when torch is already
imported (``import torch`` first, or ``import fdpp.torch_ops`` at any time). The ops run on
torch's current stream and allocate their outputs from torch's allocator, so
``torch.compile(mode="reduce-overhead")`` (CUDA graphs) captures them.

- ``torch.ops.fdpp.decode_attention(q, k_cache, v_cache, cache_seqlens, softmax_scale, kv_layout,
  num_splits) -> out``
- ``torch.ops.fdpp.decode_attention_lse(...) -> (out, lse)``
- ``torch.ops.fdpp.paged_decode_attention(q, k_pages, v_pages, block_table, cache_seqlens,
  softmax_scale, kv_layout, num_splits) -> out``
- ``torch.ops.fdpp.flat_gemm(x, w, bias, w_scale) -> y`` (``w_scale``: FP8 weights)
- ``torch.ops.fdpp.merge_states(outs, lses) -> (out, lse)`` (stacked [S, B, H, D] / [S, B, H])
- ``torch.ops.fdpp.merge_state_(out, lse, out_other, lse_other) -> ()`` (in place into out, lse)

Shapes, dtypes and layouts are those of :func:`fdpp.decode_attention`,
:func:`fdpp.paged_decode_attention`, :func:`fdpp.flat_gemm`, :func:`fdpp.merge_states` and
:func:`fdpp.merge_state_`.
"""

# torch.library infers each op's schema from these annotations at run time: typing.Optional, not
# a string (no `from __future__ import annotations`) and not `X | None`.
# ruff: noqa: UP007, UP045
from typing import Optional

import torch

from fdpp import api, gemm, merge

Tensor = torch.Tensor


@torch.library.custom_op("fdpp::decode_attention", mutates_args=(), device_types="cuda")
def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor] = None,
                     softmax_scale: Optional[float] = None, kv_layout: str = "NHD",
                     num_splits: Optional[int] = None) -> Tensor:
    return api.decode_attention(q, k_cache, v_cache, cache_seqlens=cache_seqlens, softmax_scale=softmax_scale,
                                kv_layout=kv_layout, num_splits=num_splits)


@decode_attention.register_fake
def _(q, k_cache, v_cache, cache_seqlens=None, softmax_scale=None, kv_layout="NHD", num_splits=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("fdpp::decode_attention_lse", mutates_args=(), device_types="cuda")
def decode_attention_lse(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor] = None,
                         softmax_scale: Optional[float] = None, kv_layout: str = "NHD",
                         num_splits: Optional[int] = None) -> tuple[Tensor, Tensor]:
    return api.decode_attention(q, k_cache, v_cache, cache_seqlens=cache_seqlens, softmax_scale=softmax_scale,
                                kv_layout=kv_layout, num_splits=num_splits, return_lse=True)


@decode_attention_lse.register_fake
def _(q, k_cache, v_cache, cache_seqlens=None, softmax_scale=None, kv_layout="NHD", num_splits=None):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(q.shape[:2], dtype=torch.float32))


@torch.library.custom_op("fdpp::paged_decode_attention", mutates_args=(), device_types="cuda")
def paged_decode_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                           cache_seqlens: Tensor, softmax_scale: Optional[float] = None, kv_layout: str = "NHD",
                           num_splits: Optional[int] = None) -> Tensor:
    return api.paged_decode_attention(q, k_pages, v_pages, block_table, cache_seqlens, softmax_scale=softmax_scale,
                                      kv_layout=kv_layout, num_splits=num_splits)


@paged_decode_attention.register_fake
def _(q, k_pages, v_pages, block_table, cache_seqlens, softmax_scale=None, kv_layout="NHD", num_splits=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("fdpp::flat_gemm", mutates_args=(), device_types="cuda")
def flat_gemm(x: Tensor, w: Tensor, bias: Optional[Tensor] = None, w_scale: Optional[Tensor] = None) -> Tensor:
    return gemm.flat_gemm(x, w, bias=bias, w_scale=w_scale)


@flat_gemm.register_fake
def _(x, w, bias=None, w_scale=None):
    return x.new_empty((x.shape[0], w.shape[0]))


@torch.library.custom_op("fdpp::merge_states", mutates_args=(), device_types="cuda")
def merge_states(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    return merge.merge_states(outs, lses)


@merge_states.register_fake
def _(outs, lses):
    return outs.new_empty(outs.shape[1:]), lses.new_empty(lses.shape[1:], dtype=torch.float32)


@torch.library.custom_op("fdpp::merge_state_", mutates_args=("out", "lse"), device_types="cuda")
def merge_state_(out: Tensor, lse: Tensor, out_other: Tensor, lse_other: Tensor) -> None:
    merge.merge_state_(out, lse, out_other, lse_other)


@merge_state_.register_fake
def _(out, lse, out_other, lse_other):
    return None
