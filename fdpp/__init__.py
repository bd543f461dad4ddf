"""fdpp: split-KV (FlashDecoding-style) GPU kernels for the decode phase of LLM inference."""

from fdpp.api import decode_attention, decode_attention_nosplit, gpu_available
from fdpp.dispatch import explain
from fdpp.gemm import flat_gemm

__version__ = "0.1.0"
__all__ = ["decode_attention", "decode_attention_nosplit", "explain", "flat_gemm", "gpu_available",
           "__version__"]
