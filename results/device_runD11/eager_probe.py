"""B=8, N=64k, llama3-8b heads: eager back-to-back timing (torch events, no graph) of the tuned plan
and of the 2-split heuristic plan, one buffer and 4 rotated buffers; then the same in a CUDA graph."""
import torch, fdpp
from fdpp import dispatch
from fdpp.configs import DecodeProblem, LaunchPlan, default_kernel, combine_config
b, hq, hkv, d, n = 8, 32, 8, 128, 65536
prob = DecodeProblem(b, hq, hkv, d, n, "fp16")
q = torch.randn(b, hq, d, device="cuda", dtype=torch.float16)
sets = [(torch.randn(b, n, hkv, d, device="cuda", dtype=torch.float16),
         torch.randn(b, n, hkv, d, device="cuda", dtype=torch.float16)) for _ in range(4)]
two = LaunchPlan.split_kv(default_kernel(prob, split=True), 2, combine_config("fp16", d, b * hq), source="probe")
def run(plan, m, reps=20, graph=False):
    ctx = dispatch.forced_plan(plan) if plan is not None else None
    if ctx: ctx.__enter__()
    try:
        out = torch.empty_like(q)
        for i in range(3):
            fdpp.decode_attention(q, *sets[i % m], out=out)
        torch.cuda.synchronize()
        if graph:
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                with torch.cuda.graph(g, stream=s):
                    for i in range(reps):
                        fdpp.decode_attention(q, *sets[i % m], out=out)
            torch.cuda.synchronize()
            g.replay(); torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        if graph:
            g.replay()
        else:
            for i in range(reps):
                fdpp.decode_attention(q, *sets[i % m], out=out)
        e1.record(); torch.cuda.synchronize()
        return e0.elapsed_time(e1) * 1e3 / reps
    finally:
        if ctx: ctx.__exit__(None, None, None)
for name, p in (("tuned", None), ("2-split", two)):
    for m in (1, 4):
        for graph in (False, True):
            print(f"{name:8s} sets={m} graph={graph}: {run(p, m, graph=graph):8.1f} us per call")
print(fdpp.explain(prob))
