"""flat_gemm calls for Nsight Compute (profile the 3rd launch of flat_tma): llama3-8b gate_up or
down at M = 1, FP8 weights (``w8``) or fp16 ones (``f16``), the GEMM table's plan
($FDPP_GEMM_TABLE)."""
import sys

import cupy as cp

import fdpp
from fdpp.models import get_model

layer, fmt = sys.argv[1], sys.argv[2]
n, k = get_model("llama3-8b").linear_shapes(1)[layer]
rng = cp.random.default_rng(0)
w = (rng.standard_normal((n, k), dtype=cp.float32) / 64).astype(cp.float16)
x = rng.standard_normal((1, k), dtype=cp.float32).astype(cp.float16)
kw = {}
if fmt == "w8":
    w, kw["w_scale"] = fdpp.quantize_weight(w)
for _ in range(3):
    fdpp.flat_gemm(x, w, **kw)
cp.cuda.runtime.deviceSynchronize()
