"""One fdpp call and one cuDNN SDPA call at llama3-8b heads, B=8, N=64k (bandwidth-bound), for ncu."""
import torch, fdpp
from torch.nn.attention import SDPBackend, sdpa_kernel
b, hq, hkv, d, n = 8, 32, 8, 128, 65536
q = torch.randn(b, hq, d, device="cuda", dtype=torch.float16)
k = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.float16)
v = torch.randn_like(k)
for _ in range(2):
    fdpp.decode_attention(q, k, v)
torch.cuda.synchronize()
qq, kk, vv = q[:, :, None], k.transpose(1, 2), v.transpose(1, 2)
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    for _ in range(2):
        torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)
torch.cuda.synchronize()
print(fdpp.explain(fdpp.configs.DecodeProblem(b, hq, hkv, d, n, "fp16")))
