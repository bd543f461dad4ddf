"""fdpp: split-KV (FlashDecoding-style) GPU kernels for the decode phase of LLM inference."""

import sys

from fdpp.api import (
    calibrate_unified_max,
    decode_attention,
    decode_attention_nosplit,
    gpu_available,
    paged_decode_attention,
    set_checks,
)
from fdpp.cache import OutOfPagesError, PagedKVCache
from fdpp.dispatch import explain
from fdpp.gemm import flat_gemm, fold_rmsnorm
from fdpp.merge import merge_state_, merge_states
from fdpp.plan import DecodePlan
from fdpp.quant import QuantizedKV, dequantize_kv, hadamard, quantize_kv, quantize_weight

__version__ = "0.1.0"
__all__ = ["calibrate_unified_max", "context_parallel_decode", "DecodePlan", "decode_attention", "decode_attention_nosplit", "dequantize_kv",
           "explain", "flat_gemm", "fold_rmsnorm", "gpu_available", "hadamard", "merge_state_", "merge_states", "OutOfPagesError", "PagedKVCache",
           "paged_decode_attention", "QuantizedKV", "quantize_kv", "quantize_weight", "set_checks", "__version__"]


def __getattr__(name: str):
    # fdpp.context_parallel_decode on first use: fdpp.distributed is loaded only then (it imports
    # torch / CuPy itself only when their arrays are passed)
    if name == "context_parallel_decode":
        from fdpp.distributed import context_parallel_decode

        return context_parallel_decode
    raise AttributeError(f"module 'fdpp' has no attribute {name!r}")


if "torch" in sys.modules:  # torch users get the custom ops (torch.ops.fdpp.*) without asking
    from fdpp import torch_ops  # noqa: F401
