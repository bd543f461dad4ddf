"""Host cost of fdpp's eager calls on a GPU, piece by piece (µs per call).

Run from the repository root on a machine with a CUDA GPU (about 30-60 s)::

    PYTHONPATH=. python scripts/host_profile.py --out results/host_profile_h200.csv

Each row: the median (and min/max) over ``--batches`` timeit batches of ``--calls`` back-to-back
calls, after a warm-up; the device is synchronised only between batches. The problem is the eager
bench point: B=1, N=1024, llama3-8b heads (32 q / 8 KV), head_dim 128, fp16, NHD; flat_gemm at the
o projection (M=1, N=K=4096). Pieces that this fdpp version lacks, or that fail, get a row with the
error instead of a time; nothing stops the run.

Writes ``--out`` (CSV: group, name, median_us, min_us, max_us, calls, batches, error) and, beside
it, ``<stem>_cprofile_cupy.txt`` / ``<stem>_cprofile_torch.txt``: cProfile's top 25 (by tottime)
of 20,000 eager ``fdpp.decode_attention`` calls on CuPy arrays and on torch tensors.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import csv
import io
import math
import os
import pstats
import statistics
import sys
import timeit
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

B, HQ, HKV, D, N = 1, 32, 8, 128, 1024
GEMM_N = GEMM_K = 4096
COLUMNS = ["group", "name", "median_us", "min_us", "max_us", "calls", "batches", "error"]


class Profiler:
    def __init__(self, calls: int, batches: int, warmup: int, sync: Callable[[], None]):
        self.calls, self.batches, self.warmup, self.sync = calls, batches, warmup, sync
        self.rows: list[dict[str, Any]] = []

    def time(self, group: str, name: str, fn: Callable[[], Any] | None, calls: int | None = None) -> None:
        """One row: µs per call of ``fn`` (None: the piece does not exist in this version)."""
        n = calls or self.calls
        row: dict[str, Any] = {"group": group, "name": name, "calls": n, "batches": self.batches,
                               "median_us": math.nan, "min_us": math.nan, "max_us": math.nan, "error": ""}
        if fn is None:
            row["error"] = "not in this fdpp version"
        else:
            try:
                for _ in range(self.warmup):
                    fn()
                self.sync()
                samples = []
                for _ in range(self.batches):
                    samples.append(timeit.timeit(fn, number=n) / n * 1e6)
                    self.sync()
                row.update(median_us=round(statistics.median(samples), 3), min_us=round(min(samples), 3),
                           max_us=round(max(samples), 3))
            except Exception as e:  # noqa: BLE001 - report it, keep going
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                with contextlib.suppress(Exception):
                    self.sync()
        self.rows.append(row)
        t = "" if row["error"] else f"{row['median_us']:9.2f}  [{row['min_us']:.2f}, {row['max_us']:.2f}]"
        print(f"  {group:8s} {name:58s} {t}{row['error']}", flush=True)

    def section(self, group: str, setup: Callable[[], None]) -> None:
        """Run ``setup`` (which calls :meth:`time`); a failure in it is one error row."""
        try:
            setup()
        except Exception as e:  # noqa: BLE001
            self.rows.append({"group": group, "name": "(setup)", "calls": 0, "batches": 0, "median_us": math.nan,
                              "min_us": math.nan, "max_us": math.nan, "error": f"{type(e).__name__}: {e}"[:300]})
            print(f"  {group:8s} (setup) failed: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()


def _empty_kernels(cupy: Any, struct_bytes: int) -> tuple[Any, Any]:
    """Empty kernels: one taking a struct of ``struct_bytes`` by value (like DecodeParams), one
    taking 15 scalar arguments (flat_gemm's before its residual and rms_eps were added)."""
    code = r"""
struct __align__(8) FdppEmptyParams { unsigned char b[STRUCT_BYTES]; };
extern "C" __global__ void fdpp_empty_struct(FdppEmptyParams p) {}
extern "C" __global__ void fdpp_empty_scalars(const void* x, const void* w, const void* b, void* y,
    float* ws, int* cnt, long long ldx, long long ldw, long long ldy, int m, int n, int k, int kb,
    int total, int grid) {}
""".replace("STRUCT_BYTES", str(int(struct_bytes)))
    return (cupy.RawKernel(code, "fdpp_empty_struct"), cupy.RawKernel(code, "fdpp_empty_scalars"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/host_profile.csv", help="CSV to write (cProfile files beside it)")
    p.add_argument("--calls", type=int, default=2000, help="calls per timeit batch (>= 2000)")
    p.add_argument("--batches", type=int, default=5, help="timeit batches per row (the median is reported)")
    p.add_argument("--warmup", type=int, default=200, help="untimed calls before each row")
    p.add_argument("--profile-calls", type=int, default=20000, help="eager calls under cProfile, per array type")
    p.add_argument("--matrix", action="store_true", help="also time every launcher x output reuse x one or two "
                   "launches (about a minute more)")
    args = p.parse_args(argv)
    if args.calls < 2000:
        p.error("--calls must be >= 2000")

    import numpy as np

    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as e:  # noqa: BLE001
        print(f"host_profile: needs a CUDA GPU with CuPy ({e})", file=sys.stderr)
        return 2
    import fdpp
    from fdpp import api, bench, gemm, launch, plan, workspace

    print(f"fdpp {fdpp.__file__}  cupy {cupy.__version__}  numpy {np.__version__}  python {sys.version.split()[0]}")
    print(f"device {cupy.cuda.runtime.getDeviceProperties(0)['name']}  FDPP_LAUNCH={os.environ.get('FDPP_LAUNCH', '')}")
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        with contextlib.suppress(Exception):  # registers torch.ops.fdpp (its row says so if it failed)
            import fdpp.torch_ops  # noqa: F401
        print(f"torch {torch.__version__}")
    except Exception as e:  # noqa: BLE001
        torch = None
        print(f"torch unavailable ({e}): torch rows skipped")

    def sync() -> None:
        cupy.cuda.Device().synchronize()

    prof = Profiler(args.calls, args.batches, args.warmup, sync)
    key = ("contiguous", None, "NHD", None, False, None, api._NO_QUANT.key(), None)
    print(f"\n  {'group':8s} {'piece':58s} {'median µs':>9s}  [min, max]")

    # ---- reference: the cost of a Python call -------------------------------------------
    prof.time("python", "empty lambda (timeit loop + call)", lambda: None)

    # ---- CuPy -----------------------------------------------------------------------------
    rs = cupy.random.RandomState(0)
    cq = rs.standard_normal((B, HQ, D), dtype=cupy.float32).astype(cupy.float16)
    ck = rs.standard_normal((B, N, HKV, D), dtype=cupy.float32).astype(cupy.float16)
    cv = rs.standard_normal((B, N, HKV, D), dtype=cupy.float32).astype(cupy.float16)
    carrs = (cq, ck, cv, None, None, None, None, None, None)

    def cupy_decode() -> None:
        g = "cupy"
        prof.time(g, "fdpp.decode_attention", lambda: fdpp.decode_attention(cq, ck, cv))
        dp = fdpp.DecodePlan(B, HQ, HKV, D, N, dtype="fp16")
        prof.time(g, "DecodePlan.run", lambda: dp.run(cq, ck, cv))
        if api._fast(key, carrs, None) is api._MISS:
            raise RuntimeError(f"api._fast misses with key {key}: the pieces below would time a miss")
        prof.time(g, "api._fast (the whole repeat path)", lambda: api._fast(key, carrs, None))
        rkey = api._record_key(key, "cupy", carrs, None)
        rec = plan.lookup(rkey)
        prof.time(g, "api._record_key", lambda: api._record_key(key, "cupy", carrs, None))
        prof.time(g, "plan.signature", lambda: plan.signature("cupy", (*carrs, None)))
        prof.time(g, "plan.pointers", lambda: plan.pointers("cupy", carrs))
        le = getattr(plan, "launch_env", None)
        prof.time(g, "plan.launch_env (forced plan, tables dir)", le)
        prof.time(g, "plan.lookup", lambda: plan.lookup(rkey))
        if rec is None:
            raise RuntimeError("no launch record after an eager call")
        ptrs = plan.pointers("cupy", carrs)
        prof.time(g, "LaunchRecord.pointers_ok", lambda: rec.pointers_ok(ptrs, 0))
        prof.time(g, "LaunchRecord.run", lambda: rec.run(ptrs, cq, None))
        stream = launch.stream_for("cupy", 0)
        prof.time(g, "LaunchRecord._outputs", lambda: rec._outputs(cq, None, stream))
        sfn = getattr(rec, "_stream", None)
        prof.time(g, "LaunchRecord._stream (bound stream lookup)", sfn if callable(sfn) else None)
        prof.time(g, "launch.stream_for('cupy')", lambda: launch.stream_for("cupy", 0))
        prof.time(g, "cupy.cuda.get_current_stream()", cupy.cuda.get_current_stream)
        prof.time(g, "cupy.cuda.runtime.getDevice()", cupy.cuda.runtime.getDevice)
        prof.time(g, "cupy.empty(out) [1,32,128] fp16", lambda: cupy.empty((B, HQ, D), dtype=cupy.float16))
        f16 = np.dtype(np.float16)
        prof.time(g, "cupy.cuda.alloc(out bytes)", lambda: cupy.cuda.alloc(B * HQ * D * 2))
        prof.time(g, "cupy.ndarray(shape, dtype, memptr=cupy.cuda.alloc(...))",
                  lambda: cupy.ndarray((B, HQ, D), f16, cupy.cuda.alloc(B * HQ * D * 2)))
        prof.time(g, "workspace.partials", lambda: workspace.partials(0, stream.ptr, rec.part_floats))
        words = rec._words
        prof.time(g, "input pointer words, one numpy slice assignment",
                  lambda: words.__setitem__(slice(0, len(ptrs)), ptrs))
        pack = getattr(plan, "_PACK_PTRS", None)
        buf = getattr(rec, "_buf", None)
        n_ptr = len(getattr(plan, "PTR_FIELDS", ())) or 9
        if pack is not None and buf is not None:
            allp = (ptrs + (ptrs[0],) * n_ptr)[:n_ptr]
            prof.time(g, "pointer words, struct.pack_into", lambda: pack(buf, 0, *allp))
        else:
            prof.time(g, "pointer words, struct.pack_into", None)
        keep = rec.run(ptrs, cq, None)  # the timings above wrote stand-in words: real ones again
        call = rec.calls[0]
        prof.time(g, "KernelCall (the split kernel, cupy launcher)", lambda: call(stream))
        del keep
        prof.time(g, "params[0] (the struct scalar)", lambda: rec.params[0])
        prof.time(g, "q.data.ptr", lambda: cq.data.ptr)
        prof.time(g, "q.strides", lambda: cq.strides)
        prof.time(g, "q.data.device_id", lambda: cq.data.device_id)
        prof.time(g, "type(q).__module__ (kind)", lambda: type(cq).__module__)
        def full() -> None:
            plan.clear()
            fdpp.decode_attention(cq, ck, cv)
        prof.time(g, "fdpp.decode_attention, full path (records cleared)", full)

    prof.section("cupy", cupy_decode)

    def empty_kernels() -> None:
        g = "launch"
        from fdpp.configs import DECODE_PARAMS

        params = DECODE_PARAMS.array()
        ks, k15 = _empty_kernels(cupy, params.dtype.itemsize)
        fn, fn15 = ks.kernel, k15.kernel
        stream = cupy.cuda.get_current_stream()
        prof.time(g, f"empty kernel, struct of {params.dtype.itemsize} B by value (Function)",
                  lambda: fn((1, 1, 1), (32, 1, 1), (params[0],), shared_mem=0, stream=stream))
        prof.time(g, "empty kernel, struct by value (RawKernel.__call__)",
                  lambda: ks((1, 1, 1), (32, 1, 1), (params[0],)))
        u64, i64, i32 = np.uint64, np.int64, np.int32
        a15 = (u64(1 << 32), u64(2 << 32), u64(0), u64(3 << 32), u64(4 << 32), u64(5 << 32), i64(4096), i64(4096),
               i64(4096), i32(1), i32(4096), i32(4096), i32(4), i32(1024), i32(256))
        prof.time(g, "empty kernel, 15 prebuilt numpy scalars (flat_gemm's args)",
                  lambda: fn15((256, 1, 1), (128, 1, 1), a15, shared_mem=0, stream=stream))
        prof.time(g, "empty kernel, 15 args incl. 6 fresh np.uint64",
                  lambda: fn15((256, 1, 1), (128, 1, 1), (u64(1 << 32), u64(2 << 32), u64(0), u64(3 << 32),
                                                          u64(4 << 32), u64(5 << 32), *a15[6:]),
                               shared_mem=0, stream=stream))
        import ctypes

        try:
            cu = launch._cuLaunchKernel()
            argv0 = (ctypes.c_void_p * 1)(params.ctypes.data)
            u = ctypes.c_uint
            pre = (ctypes.c_void_p(fn.ptr), u(1), u(1), u(1), u(32), u(1), u(1), u(0), ctypes.c_void_p(stream.ptr))
            prof.time(g, "empty kernel, struct by address, libcuda cuLaunchKernel (ctypes)",
                      lambda: cu(*pre, argv0, None))
        except OSError as e:
            prof.rows.append({"group": g, "name": "libcuda cuLaunchKernel (ctypes)", "calls": 0, "batches": 0,
                              "median_us": math.nan, "min_us": math.nan, "max_us": math.nan,
                              "error": f"libcuda unavailable: {e}"})
        try:
            cupy_launch = launch._cupy_launch_kernel()
            argv1 = (ctypes.c_void_p * 1)(params.ctypes.data)
            args1 = (int(fn.ptr), 1, 1, 1, 32, 1, 1, 0, stream.ptr, ctypes.addressof(argv1), 0)
            prof.time(g, "empty kernel, struct by address, CuPy driver.launchKernel (cupy-driver)",
                      lambda: cupy_launch(*args1))
        except Exception as e:  # noqa: BLE001
            prof.rows.append({"group": g, "name": "CuPy driver.launchKernel", "calls": 0, "batches": 0,
                              "median_us": math.nan, "min_us": math.nan, "max_us": math.nan,
                              "error": f"cupy.cuda.driver unavailable: {e}"})
        try:
            from cuda.bindings import driver
        except Exception as e:  # noqa: BLE001
            prof.rows.append({"group": g, "name": "driver cuLaunchKernel", "calls": 0, "batches": 0,
                              "median_us": math.nan, "min_us": math.nan, "max_us": math.nan,
                              "error": f"cuda.bindings unavailable: {e}"})
            return
        cf = driver.CUfunction(fn.ptr)
        argv = (ctypes.c_void_p * 1)(params.ctypes.data)
        hs = driver.CUstream(stream.ptr)
        addr = ctypes.addressof(argv)

        def drv() -> None:
            (err,) = driver.cuLaunchKernel(cf, 1, 1, 1, 32, 1, 1, 0, hs, addr, 0)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuLaunchKernel: {err}")
        prof.time(g, "empty kernel, struct by address, cuda.bindings cuLaunchKernel", drv)
        # fdpp's PDL launch (cuda.bindings' cuLaunchKernelEx, the programmatic-serialization attribute)
        import types

        call = launch.KernelCall(types.SimpleNamespace(threads=32, smem_bytes=lambda: 0), (1, 1, 1), 0, params,
                                 fn=fn, pdl=True)
        prof.time(g, "empty kernel, struct by address, PDL cuLaunchKernelEx (fdpp KernelCall)", lambda: call(stream))

    prof.section("launch", empty_kernels)

    # ---- torch ----------------------------------------------------------------------------
    if torch is not None:
        tdev = torch.device("cuda", 0)
        tq = torch.randn((B, HQ, D), device=tdev, dtype=torch.float16)
        tk = torch.randn((B, N, HKV, D), device=tdev, dtype=torch.float16)
        tv = torch.randn((B, N, HKV, D), device=tdev, dtype=torch.float16)
        tarrs = (tq, tk, tv, None, None, None, None, None, None)

        def torch_decode() -> None:
            g = "torch"
            prof.time(g, "fdpp.decode_attention", lambda: fdpp.decode_attention(tq, tk, tv))
            dp = fdpp.DecodePlan(B, HQ, HKV, D, N, dtype="fp16")
            prof.time(g, "DecodePlan.run", lambda: dp.run(tq, tk, tv))
            if api._fast(key, tarrs, None) is api._MISS:
                raise RuntimeError(f"api._fast misses with key {key}: the pieces below would time a miss")
            prof.time(g, "api._fast (the whole repeat path)", lambda: api._fast(key, tarrs, None))
            rkey = api._record_key(key, "torch", tarrs, None)
            rec = plan.lookup(rkey)
            prof.time(g, "api._record_key", lambda: api._record_key(key, "torch", tarrs, None))
            prof.time(g, "plan.signature", lambda: plan.signature("torch", (*tarrs, None)))
            prof.time(g, "plan.pointers", lambda: plan.pointers("torch", tarrs))
            prof.time(g, "plan.lookup", lambda: plan.lookup(rkey))
            if rec is None:
                raise RuntimeError("no launch record after an eager call")
            ptrs = plan.pointers("torch", tarrs)
            prof.time(g, "LaunchRecord.run", lambda: rec.run(ptrs, tq, None))
            stream = launch.stream_for("torch", 0, tq.device)
            prof.time(g, "LaunchRecord._outputs", lambda: rec._outputs(tq, None, stream))
            sfn = getattr(rec, "_stream", None)
            prof.time(g, "LaunchRecord._stream (bound stream lookup)", sfn if callable(sfn) else None)
            prof.time(g, "launch.stream_for('torch')", lambda: launch.stream_for("torch", 0, tq.device))
            prof.time(g, "torch.cuda.current_stream()", torch.cuda.current_stream)
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            prof.time(g, "torch._C._cuda_getCurrentRawStream(0)", (lambda: raw(0)) if raw else None)
            prof.time(g, "torch.empty(out) [1,32,128] fp16",
                      lambda: torch.empty((B, HQ, D), dtype=torch.float16, device=tdev))
            prof.time(g, "torch.empty(out), device=q.device",
                      lambda: torch.empty((B, HQ, D), dtype=torch.float16, device=tq.device))
            prof.time(g, "q.new_empty(out shape)", lambda: tq.new_empty((B, HQ, D)))
            prof.time(g, "torch.empty_like(q)", lambda: torch.empty_like(tq))
            prof.time(g, "torch.ops.fdpp.decode_attention (custom op, eager)",
                      lambda: torch.ops.fdpp.decode_attention(tq, tk, tv))
            prof.time(g, "workspace.partials (torch stream)",
                      lambda: workspace.partials(0, stream.ptr, rec.part_floats))
            prof.time(g, "q.data_ptr()", tq.data_ptr)
            prof.time(g, "q.stride()", tq.stride)
            prof.time(g, "q.device", lambda: tq.device)
            prof.time(g, "q.get_device()", tq.get_device)
            prof.time(g, "q.shape", lambda: tq.shape)

            def full() -> None:
                plan.clear()
                fdpp.decode_attention(tq, tk, tv)
            prof.time(g, "fdpp.decode_attention, full path (records cleared)", full)

        prof.section("torch", torch_decode)

        def sdpa() -> None:
            g = "torch"
            f = torch.nn.functional.scaled_dot_product_attention
            qt, kt, vt = tq.unsqueeze(2), tk.transpose(1, 2), tv.transpose(1, 2)
            prof.time(g, "SDPA eager (default backend), enable_gqa", lambda: f(qt, kt, vt, enable_gqa=True))
            try:
                from torch.nn.attention import SDPBackend, sdpa_kernel
            except ImportError:
                return
            for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
                be = getattr(SDPBackend, name, None)
                if be is None:
                    continue
                with sdpa_kernel([be]):
                    prof.time(g, f"SDPA eager ({name}), enable_gqa", lambda: f(qt, kt, vt, enable_gqa=True))

        prof.section("torch", sdpa)

        def flashinfer() -> None:
            try:
                import flashinfer as fi
            except Exception:  # noqa: BLE001
                return
            prof.time("torch", "flashinfer.single_decode_with_kv_cache (tensor cores)",
                      lambda: fi.single_decode_with_kv_cache(tq[0], tk[0], tv[0], kv_layout="NHD",
                                                             use_tensor_cores=True))

        prof.section("torch", flashinfer)

    # ---- flat_gemm ------------------------------------------------------------------------
    def gemm_rows(kind: str) -> Callable[[], None]:
        def run() -> None:
            g = f"gemm-{kind}"
            if kind == "cupy":
                x = (cupy.random.standard_normal((1, GEMM_K), dtype=cupy.float32)).astype(cupy.float16)
                w = (cupy.random.standard_normal((GEMM_N, GEMM_K), dtype=cupy.float32) * 0.02).astype(cupy.float16)
                stream = launch.stream_for("cupy", 0)
            else:
                x = torch.randn((1, GEMM_K), device="cuda", dtype=torch.float16)
                w = torch.randn((GEMM_N, GEMM_K), device="cuda", dtype=torch.float16) * 0.02
                stream = launch.stream_for("torch", 0, x.device)
            prof.time(g, "fdpp.flat_gemm M=1 N=K=4096", lambda: fdpp.flat_gemm(x, w))
            if kind == "torch":
                prof.time(g, "torch.mm(x, w.t())", lambda: torch.mm(x, w.t()))
            else:
                prof.time(g, "cupy.matmul(x, w.T)", lambda: cupy.matmul(x, w.T))
            rk = getattr(gemm, "_record_key", None)
            recs = getattr(gemm, "_records", None)
            if rk is not None and recs is not None:
                prof.time(g, "gemm._record_key", lambda: rk(x, w, None, None))
                rec = recs.get(rk(x, w, None, None))
                if rec is not None:
                    ptrs = plan.pointers(kind, (x, w, None, None, None))  # x, w, bias, w_scale, residual
                    prof.time(g, "GemmRecord.pointers_ok", lambda: rec.pointers_ok(ptrs, 0))
                    prof.time(g, "GemmRecord.run", lambda: rec.run(ptrs, None))
            else:
                prof.time(g, "gemm._record_key", None)
            prof.time(g, "gemm._check (full validation)", lambda: gemm._check(x, w, None, None))
            from fdpp import registry

            lim = registry.device_limits(0)
            prof.time(g, "gemm.choose", lambda: gemm.choose(1, GEMM_N, GEMM_K, lim, "fp16"))
            gplan = gemm.choose(1, GEMM_N, GEMM_K, lim, "fp16")
            print(f"  {g:8s} plan: {gplan.describe()}", flush=True)
            if gplan.config is not None:
                grid = gemm.launch_grid(gplan, GEMM_N, GEMM_K, 0)
                tiles = gemm.iterations(gplan.config, GEMM_N, GEMM_K)[0]
                wsf = gemm.workspace_floats(gplan.config, grid)
                prof.time(g, "workspace.partials + tickets", lambda: (workspace.partials(0, stream.ptr, wsf),
                                                                      workspace.tickets(0, stream, tiles)))
            _, views, mnk, dt, _ = gemm._check(x, w, None, None)
            prof.time(g, "gemm._device_call (full launch path, no record kept)",
                      lambda: gemm._device_call(kind, x, w, None, None, views, gplan, mnk, dt, 0))
            if kind == "cupy":
                prof.time(g, "cupy.empty(y) [1,4096] fp16", lambda: cupy.empty((1, GEMM_N), dtype=cupy.float16))
        return run

    prof.section("gemm-cupy", gemm_rows("cupy"))
    if torch is not None:
        prof.section("gemm-torch", gemm_rows("torch"))

    # ---- launcher x output-reuse matrix: the whole eager and plan/run calls ------------------
    def matrix() -> None:
        import dataclasses

        from fdpp import dispatch, registry
        from fdpp.configs import DecodeProblem

        g = "matrix"
        # the dispatcher's plan, and the same made one launch (fused merge): what a launch costs
        chosen = dispatch.select_plan(DecodeProblem(B, HQ, HKV, D, N, "fp16"), registry.device_limits(0), None)
        fused = chosen if chosen.fused else dataclasses.replace(chosen, kernels=chosen.kernels[:1], fused=True)
        print(f"  {g:8s} plan: {len(chosen.launches(N))} launch(es), {chosen.split.key}, {chosen.num_splits} splits",
              flush=True)
        gx = (cupy.random.standard_normal((1, GEMM_K), dtype=cupy.float32)).astype(cupy.float16)
        gw = (cupy.random.standard_normal((GEMM_N, GEMM_K), dtype=cupy.float32)).astype(cupy.float16)
        arrays = {"cupy": (cq, ck, cv)}
        if torch is not None:
            arrays["torch"] = (tq, tk, tv)
            tx = torch.randn((1, GEMM_K), device="cuda", dtype=torch.float16)
            tw = torch.randn((GEMM_N, GEMM_K), device="cuda", dtype=torch.float16)
        gemm_xw = {"cupy": (gx, gw), "torch": (tx, tw) if torch is not None else None}
        old_r, old_t = plan.REUSE_OUTPUTS, plan.TORCH_NEW_EMPTY
        try:
            for reuse in (True, False):
                for var in ["pdl", *bench.host_variants()]:  # PDL on, and off through each launcher
                    plan.REUSE_OUTPUTS, plan.TORCH_NEW_EMPTY = reuse, reuse
                    tag = f"launch={var} reuse={'on' if reuse else 'off'}"
                    with bench.host_variant(var):
                        for kind, (q, k, v) in arrays.items():
                            for one in (False, True):
                                plan.clear()
                                gemm._records.clear()
                                dp = fdpp.DecodePlan(B, HQ, HKV, D, N, dtype="fp16")
                                ctx = dispatch.forced_plan(fused) if one else contextlib.nullcontext()
                                what = " [one launch: fused]" if one else ""
                                with ctx:
                                    with contextlib.suppress(Exception):  # a failing launcher: its rows say why
                                        dp.run(q, k, v)  # the plan's record is fixed here (forced or not)
                                    prof.time(g, f"{kind} decode_attention{what}, {tag}",
                                              lambda q=q, k=k, v=v: fdpp.decode_attention(q, k, v))
                                prof.time(g, f"{kind} DecodePlan.run{what}, {tag}",
                                          lambda dp=dp, q=q, k=k, v=v: dp.run(q, k, v))
                            x, w = gemm_xw[kind]
                            prof.time(g, f"{kind} flat_gemm, {tag}", lambda x=x, w=w: fdpp.flat_gemm(x, w))
        finally:
            plan.REUSE_OUTPUTS, plan.TORCH_NEW_EMPTY = old_r, old_t
            plan.clear()
            gemm._records.clear()

    if args.matrix:
        prof.section("matrix", matrix)

    # ---- output ---------------------------------------------------------------------------
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=COLUMNS)
        wr.writeheader()
        wr.writerows(prof.rows)
    print(f"\nwrote {out} ({len(prof.rows)} rows)")

    def profile(kind: str, fn: Callable[[], Any]) -> None:
        path = out.with_name(f"{out.stem}_cprofile_{kind}.txt")
        try:
            for _ in range(args.warmup):
                fn()
            sync()
            pr = cProfile.Profile()
            pr.enable()
            for i in range(args.profile_calls):
                fn()
                if i % 2000 == 1999:
                    sync()  # keep the launch queue short
            pr.disable()
            sync()
            s = io.StringIO()
            s.write(f"cProfile of {args.profile_calls} eager fdpp.decode_attention calls ({kind}), "
                    f"B={B} N={N} heads {HQ}/{HKV} D={D} fp16; top 25 by tottime\n")
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
            path.write_text(s.getvalue())
            print(f"wrote {path}")
        except Exception as e:  # noqa: BLE001
            print(f"cProfile ({kind}) failed: {type(e).__name__}: {e}", file=sys.stderr)

    profile("cupy", lambda: fdpp.decode_attention(cq, ck, cv))
    if torch is not None:
        profile("torch", lambda: fdpp.decode_attention(tq, tk, tv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
