"""scripts/host_profile.py end to end on the CPU stand-ins (tests/fakegpu.py): every section runs,
the CSV has its columns and a row per piece, the cProfile files are written. No timing is real;
this checks that the GPU run works first time."""

from __future__ import annotations

import csv
import sys
import types
from pathlib import Path

import numpy as np

from fdpp.configs import DECODE_PARAMS

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "scripts"))
import fakegpu  # noqa: E402
import host_profile  # noqa: E402


def _more_stand_ins(monkeypatch):
    cp, t = sys.modules["cupy"], sys.modules["torch"]

    class Dev(fakegpu._Device):
        def synchronize(self):
            pass

    class RS:
        def __init__(self, seed):
            pass

        def standard_normal(self, shape, dtype=np.float32):
            return fakegpu.ndarray(shape, dtype)

    class RK(fakegpu._RawKernel):
        def __init__(self, code, name):
            assert "__global__" in code and name in code
            super().__init__()

    cp.__version__ = "stand-in"
    cp.cuda.runtime.getDeviceCount = lambda: 1
    cp.cuda.runtime.getDeviceProperties = lambda d: {"name": b"Fake GPU"}
    cp.cuda.Device = Dev
    cp.random = types.SimpleNamespace(RandomState=RS, standard_normal=RS(0).standard_normal)
    cp.RawKernel = RK
    cp.matmul = lambda a, b, out=None: fakegpu.ndarray((a.shape[0], b.shape[0]))
    for cls in (fakegpu.ndarray, fakegpu.Tensor):
        monkeypatch.setattr(cls, "__mul__", lambda self, o: self, raising=False)
    monkeypatch.setattr(fakegpu.ndarray, "astype", lambda self, dt: fakegpu.ndarray(self.shape, dt), raising=False)
    monkeypatch.setattr(fakegpu.ndarray, "T", property(lambda self: self), raising=False)
    monkeypatch.setattr(fakegpu.Tensor, "unsqueeze", lambda self, d: self, raising=False)
    monkeypatch.setattr(fakegpu.Tensor, "transpose", lambda self, a, b: self, raising=False)
    t.__version__ = "stand-in"
    t.cuda.is_available = lambda: True
    t.randn = lambda shape, device=None, dtype=None: fakegpu.Tensor(shape, dtype)
    t.nn = types.SimpleNamespace(functional=types.SimpleNamespace(
        scaled_dot_product_attention=lambda q, k, v, enable_gqa=False: q))
    t.mm = lambda a, b, out=None: a


def test_host_profile_runs_on_stand_ins(monkeypatch, tmp_path, capsys):
    fakegpu.install(monkeypatch, record=False)
    _more_stand_ins(monkeypatch)
    out = tmp_path / "hp.csv"
    assert host_profile.main(["--out", str(out), "--batches", "1", "--warmup", "2", "--profile-calls", "50",
                              "--matrix"]) == 0
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == host_profile.COLUMNS
    by = {(r["group"], r["name"]): r for r in rows}
    assert not [r for r in rows if r["name"] == "(setup)"], [r["error"] for r in rows if r["name"] == "(setup)"]
    for g in ("cupy", "torch"):
        for name in ("fdpp.decode_attention", "DecodePlan.run", "api._fast (the whole repeat path)",
                     "plan.signature", "plan.pointers", "plan.lookup", "api._record_key", "LaunchRecord._outputs"):
            r = by[(g, name)]
            assert not r["error"] and float(r["median_us"]) > 0, r
    for g in ("gemm-cupy", "gemm-torch"):
        assert not by[(g, "fdpp.flat_gemm M=1 N=K=4096")]["error"]
        assert not by[(g, "GemmRecord.run")]["error"]
    assert not by[("torch", "SDPA eager (default backend), enable_gqa")]["error"]
    cupy_cells = [r for r in rows if r["group"] == "matrix" and "launch=plain-cupy reuse" in r["name"]]
    assert len(cupy_cells) == 2 * 2 * 5 and not [r for r in cupy_cells if r["error"]]  # reuse x kind x calls
    assert not by[("launch", f"empty kernel, struct of {DECODE_PARAMS.dtype.itemsize} B by value (Function)")]["error"]
    for kind in ("cupy", "torch"):
        text = (tmp_path / f"hp_cprofile_{kind}.txt").read_text()
        assert "tottime" in text and "decode_attention" in text
    assert "wrote" in capsys.readouterr().out
