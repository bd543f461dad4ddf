"""CPU tool: instruction counts of a decode kernel's hot loop, from its SASS (no GPU needed).

    python3 scripts/sass_count.py [--arch sm_90] [--dtype fp16] [--kv-dtype int4_g64] [--head-dim 128]
                                  [--group 4] [--page-size 0] [--shapes w4s3u1,w4s4u2]
                                  [--kernel-dir DIR] [--dump FILE]

Compiles each tensor-core decode variant with NVRTC (cuda-bindings, as tests/test_compile.py),
disassembles the cubin with ``nvdisasm`` (PATH, or the ``nvidia-cuda-nvdisasm`` wheel's
``nvidia/cu13/bin``), and prints, per kernel, the instructions of every loop that holds an MMA
(the body between a backward branch and its target) by opcode. The counts are static: a branch
taken rarely (the lazy rescale) counts as if it ran. ``--kernel-dir`` compiles another revision's
kernels_cu/ instead (for an A/B of an edit before a GPU run).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from fdpp import configs, registry

_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?);")
_LABEL = re.compile(r"\s*(\.L_x_\d+):")


def nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    for entry in sys.path:
        cand = Path(entry) / "nvidia" / "cu13" / "bin" / "nvdisasm"
        if cand.is_file():
            return str(cand)
    raise SystemExit("nvdisasm not found: pip install nvidia-cuda-nvdisasm (or put CUDA's bin/ on PATH)")


def mma_loops(sass: str) -> dict[str, list[collections.Counter]]:
    """Per function of ``sass``: an opcode Counter for each loop whose body holds an HMMA."""
    out: dict[str, list[collections.Counter]] = {}
    for func in re.split(r"\n\s*\.text\.", sass)[1:]:
        name = func.split(":", 1)[0].strip()
        ins, labels, pending = [], {}, []
        for line in func.splitlines():
            lab = _LABEL.match(line)
            if lab:
                pending.append(lab.group(1))
                continue
            m = _LINE.match(line)
            if m:
                addr = int(m.group(1), 16)
                labels.update({p: addr for p in pending})
                pending = []
                ins.append((addr, m.group(2), m.group(3)))
        loops = []
        for addr, op, args in ins:
            target = re.search(r"(\.L_x_\d+)", args)
            if op.startswith("BRA") and target and labels.get(target.group(1), addr) < addr:
                body = [o for a, o, _ in ins if labels[target.group(1)] <= a <= addr]
                if any(o.startswith("HMMA") for o in body):
                    loops.append(collections.Counter(o.split(".")[0] for o in body))
        out[name] = loops
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--kv-dtype", default="int4_g64")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--page-size", type=int, default=0)
    ap.add_argument("--shapes", default="w4s3u1", help="comma list of w<warps>s<stages>u<unroll>")
    ap.add_argument("--kernel-dir", type=Path, help="compile this kernels_cu/ instead of the tree's")
    ap.add_argument("--dump", type=Path, help="write the whole disassembly here")
    args = ap.parse_args()
    if args.kernel_dir is not None:
        kdir = args.kernel_dir.resolve()
        registry.kernel_dir = lambda: kdir
    cfgs = []
    for shape in args.shapes.split(","):
        m = re.fullmatch(r"w(\d+)s(\d+)u(\d+)", shape)
        if not m:
            raise SystemExit(f"--shapes: {shape!r} is not w<warps>s<stages>u<unroll>")
        w, s, u = (int(x) for x in m.groups())
        cfgs.append(configs.DecodeConfig(args.dtype, args.head_dim, args.group, w, s, u, mma=True,
                                         kv_dtype=args.kv_dtype, page_size=args.page_size))
    cubin, reports = registry.compile_cubin(cfgs, args.arch)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([nvdisasm(), "-c", str(path)], capture_output=True, text=True, check=True).stdout
    if args.dump:
        args.dump.write_text(sass)
    for name, loops in mma_loops(sass).items():
        rep = reports.get(name)
        if rep is None:
            continue
        print(f"{rep.key} ({args.arch}) {rep.registers} registers, {rep.spill_stores} B spilled")
        for c in loops:
            top = ", ".join(f"{op} {n}" for op, n in c.most_common(12))
            print(f"  loop: {sum(c.values())} instructions, {c['HMMA']} HMMA; {top}")


if __name__ == "__main__":
    main()
