"""CPU check of fdpp/cache.py's torch host path (run Z7): torch.from_numpy of a read-only array warns,
_TorchBackend.to_device / h2d_into / _host_tensor do not, and copy the same values. The backend's
device is set to the CPU (no GPU on this machine). Run from the repository root with torch and
fdpp's dependencies importable:
    PYTHONPATH=.:.venv/lib/python3.11/site-packages /tmp/tv/bin/python results/device_runZ7/cpu_torch_warning.py
(/tmp/tv: a venv with torch 2.13.0, CPU build)."""

import warnings

import numpy as np
import torch

from fdpp import cache

be = cache._TorchBackend.__new__(cache._TorchBackend)
be.torch, be.tdev = torch, torch.device("cpu")
a = np.arange(12, dtype=np.float16).reshape(3, 4)
a.setflags(write=False)
ro = np.broadcast_to(np.float32(0.5), (4,))  # what _descale_values returns for a [Hkv] descale
print("torch", torch.__version__, "| a writeable:", a.flags.writeable, "| broadcast writeable:", ro.flags.writeable)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    t = be.to_device(a)
    d = torch.zeros(20, dtype=torch.float16)
    be.h2d_into(d, a.reshape(-1))
    kd = torch.zeros(4)
    kd.copy_(be._host_tensor(np.ascontiguousarray(ro)))
print("fdpp paths: warnings", len(w), "| values equal:",
      t.tolist() == a.tolist(), d[:12].tolist() == a.reshape(-1).tolist(), kd.tolist() == [0.5] * 4)

# PagedKVCache.set_descale on the torch backend (device set to the CPU): the [Hkv] descale is a
# read-only broadcast inside the cache
import sys  # noqa: E402

sys.path.insert(0, "tests")
from test_quant_cache import make_cache  # noqa: E402


def _cpu_init(self, device):
    self.torch, self.device, self.tdev = torch, 0, torch.device("cpu")


cache._TorchBackend.__init__ = _cpu_init
c = make_cache("torch", "fp8_e4m3", 64, "NHD", 16)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    c.set_descale(0, 0.25, [0.5, 1.0])
print("set_descale: warnings", len(w), "| k_descale", c.k_descale(0).tolist(), "| v_descale", c.v_descale(0).tolist())

# last: torch warns once per process, so the checks above must come first
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    torch.from_numpy(a)
print("plain torch.from_numpy of the read-only array: warnings", len(w), "|", str(w[0].message)[:60] if w else "")
