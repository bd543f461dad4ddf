"""Run Z16, call 3: why the device FP8 quantizer gave code 0 where NumPy gives 78 for x = 1e-44
(7 * 2^-149) with amax = x (call 2). Prints the device descale and code, and the float32 operations
of that path (fabsf, the NaN-aware max, __fdiv_rn, fmaxf) on subnormals in a small RawKernel
compiled as fdpp compiles (NVRTC, -std=c++17), through fdpp.registry's own compile when possible."""
import cupy as cp
import numpy as np

import fdpp

from fdpp import quant

made = []
_empty = quant._Dev.empty


def empty(self, shape, dtype):  # keep every buffer the device path makes (the amax one among them)
    a = _empty(self, shape, dtype)
    made.append((shape, dtype, a))
    return a


quant._Dev.empty = empty
k = np.zeros((1, 8, 1, 64), np.float32)
k[0, 0, 0, 0] = 1e-44
for fmt in ("fp8_e4m3",):
    qd = fdpp.quantize_kv(cp.asarray(k), cp.asarray(np.ones_like(k)), fmt)
    qn = fdpp.quantize_kv(k, np.ones_like(k), fmt)
    print(fmt, "device descale", cp.asnumpy(qd.k_descale).ravel()[:1].view(np.uint32), "numpy",
          qn.k_descale.ravel()[:1].view(np.uint32))
    for shape, dtype, a in made:
        if dtype == "float32":
            print("buffer", shape, cp.asnumpy(a).ravel()[:4].view(np.uint32))
    print(fmt, "device code", cp.asnumpy(qd.k).view(np.uint8).ravel()[:2], "numpy", qn.k.view(np.uint8).ravel()[:2])

src = r'''
extern "C" __global__ void ops(const float* x, const float* d, float* out) {
  float a = x[0], b = d[0];
  out[0] = fabsf(a);
  out[1] = (a != a || a > 0.0f) ? a : 0.0f;
  out[2] = __fdiv_rn(a, b);
  out[3] = fmaxf(__fdiv_rn(a, 448.0f), __int_as_float(1));
  out[4] = a / b;
  out[5] = __fmul_rn(a, 1.0f);
  out[6] = (a == 0.0f) ? 1.0f : 2.0f;
}
'''
for opts in (("-std=c++17",), ("-std=c++17", "--ftz=false"), ("-std=c++17", "--ftz=true")):
    mod = cp.RawModule(code=src, options=opts)
    f = mod.get_function("ops")
    x = cp.asarray(np.array([1e-44], np.float32))
    d = cp.asarray(np.array([np.finfo(np.float32).smallest_subnormal], np.float32))
    out = cp.zeros(8, cp.float32)
    f((1,), (1,), (x, d, out))
    o = cp.asnumpy(out)
    print(opts, "fabs, max, fdiv_rn, descale, a/b, fmul, a==0:", o[:7], o[:7].view(np.uint32))
print("x bits", np.float32(1e-44).view(np.uint32), "2^-149 bits", np.finfo(np.float32).smallest_subnormal.view(np.uint32))
