"""scripts/sass_count.py on the CPU: NVRTC compiles, nvdisasm disassembles, the parser finds the
MMA loops (the tool a kernel edit's instruction counts are read with before a GPU run); and the
INT4 loop's instruction budget. INT4 decode attention is bound by instruction issue more than
bytes: the budget guards against an edit, or a compiler, that brings back what run Z13 removed (a
shift per nibble pair, the nibble masks moved into a register before every use)."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fdpp import configs, registry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
sass_count = importlib.import_module("sass_count")

#: (page size, warps, stages, unroll) -> most instructions the INT4 (group 64, D 128, GQA 4) loop
#: may hold, sm_90. Run Z13's kernel: 453 and 508 (main's before it: 598 and 653).
BUDGET = {(0, 4, 2, 1): 480, (16, 4, 2, 1): 540}


def _sass(cfgs: list[configs.DecodeConfig], tmp_path) -> tuple[str, dict]:
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs the cuda-bindings NVRTC wheel")
    try:
        tool = sass_count.nvdisasm()
    except SystemExit:
        pytest.skip("needs nvdisasm (the nvidia-cuda-nvdisasm wheel of the test extra)")
    cubin, reports = registry.compile_cubin(cfgs, "sm_90")
    (tmp_path / "k.cubin").write_bytes(cubin)
    return subprocess.run([tool, "-c", str(tmp_path / "k.cubin")], capture_output=True, text=True, check=True).stdout, reports


def test_mma_loops_parser():
    text = """
        .text.k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LOP3.LUT R2, R2, 0xf, RZ, 0xc0, !PT ;
        /*0020*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0030*/              @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0040*/                   IADD3 R3, R3, 0x1, RZ ;
        /*0050*/              @P1 BRA `(.L_x_2) ;
        /*0060*/                   EXIT ;
"""
    loops = sass_count.mma_loops(text)
    assert list(loops) == ["k"]
    assert len(loops["k"]) == 1  # the second loop holds no MMA
    assert loops["k"][0] == {"LOP3": 1, "HMMA": 1, "BRA": 1}


def test_counts_a_shipped_kernel(tmp_path):
    cfg = configs.DecodeConfig("fp16", 128, 4, 4, 3, 1, mma=True, kv_dtype="fp8_e4m3")
    sass, reports = _sass([cfg], tmp_path)
    loops = sass_count.mma_loops(sass)
    (name,) = [n for n in loops if n in reports]
    assert reports[name].key == cfg.key
    # one 16-token block per warp a tile: S = K q^T and O += V^T P^T, D / 16 MMAs each
    (loop,) = loops[name]
    assert loop["HMMA"] == 2 * 128 // 16
    assert 100 < sum(loop.values()) < 2000


def test_int4_loop_instruction_budget(tmp_path):
    cfgs = {k: configs.DecodeConfig("fp16", 128, 4, k[1], k[2], k[3], mma=True, kv_dtype="int4_g64", page_size=k[0])
            for k in BUDGET}
    sass, reports = _sass(list(cfgs.values()), tmp_path)
    seen = set()
    for name, found in sass_count.mma_loops(sass).items():
        rep = reports.get(name)
        if rep is None:
            continue
        k = next(k for k, c in cfgs.items() if c.key == rep.key)
        seen.add(k)
        inner = min(sum(c.values()) for c in found)  # the tile loop (paged kernels also show an outer one)
        assert inner <= BUDGET[k], f"{rep.key}: {inner} instructions in the loop, budget {BUDGET[k]}"
    assert seen == set(BUDGET), f"kernels not found in the disassembly: {set(BUDGET) - seen}"
    # the nibble masks stay in registers (kept_const): no move of either immediate anywhere
    masks = re.findall(r"MOV(?:\.U32)? R\d+, (?:RZ, RZ, )?(0xf000f0?)\b", sass)
    assert not masks, f"nibble masks re-materialised {len(masks)} times"
