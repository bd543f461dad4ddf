"""Does a kernel-source change alter the instructions of existing variants?

Compiles every phase-1 variant a shipped table names (``configs.table_variants``; combine kernels
too) from the sources of a git revision and from the working tree, and compares the PTX with
parameter offsets and the parameter block's size normalised (a DecodeParams field added moves
them) and module-level ``.global`` constant declarations ignored (unused template constants).
Identical normalised PTX means the same instruction stream, so tuned timings still hold: with
``--restamp TABLE`` the entries none of whose kernels changed get the current ``sources`` hashes,
and the entries with a changed kernel are left stale (the dispatcher ignores them) for a re-tune
(``python -m fdpp.tune ... --skip-tuned``).

    PYTHONPATH=. python scripts/compare_ptx.py e042e22 [--arch sm_90] [--restamp tuning/NVIDIA_H200.json]

``--sass``: a variant whose PTX differs still counts as unchanged when the SASS that ptxas makes of
it is equal, instruction for instruction (PTX virtual registers renumbered by an edit that changes
no instruction; nvdisasm from PATH or the ``nvidia-cuda-nvdisasm`` wheel).

``--gemm TABLE``: the same for the flat GEMM table (every kernel its entries name, at each entry's
M bucket); with ``--restamp`` its entries are re-stamped entry by entry as the attention table's are
(cuBLAS entries, which launch no fdpp kernel but were chosen against them, only when no kernel of
the table changed).
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from cuda.bindings import nvrtc

from fdpp import registry, tables
from fdpp.configs import SM90, table_variants

FILES = ("decode_split.cu", "decode_combine.cu", "merge.cuh", "kv_cache.cuh", "common.cuh", "flat_gemm.cu")


def ptx(kdir: Path, cfg, arch: str, cubin: bool = False):
    """The PTX of ``cfg`` compiled from ``kdir`` (``cubin``: the cubin's bytes instead)."""
    src = (kdir / cfg.source).read_text().encode()
    # named by its path in kdir: NVRTC looks for a quoted #include beside the program's name first,
    # so a relative name ("kernels_cu/x.cu") would read the working tree's headers for either side
    _, prog = nvrtc.nvrtcCreateProgram(src, str(kdir.resolve() / cfg.source).encode(), 0, [], [])
    try:
        nvrtc.nvrtcAddNameExpression(prog, cfg.name_expression().encode())
        opts = [f"--gpu-architecture={arch}", *registry.NVRTC_OPTIONS, f"-I{kdir}"]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{cfg.key}: {err}")
        if cubin:
            _, n = nvrtc.nvrtcGetCUBINSize(prog)
            buf = b" " * n
            nvrtc.nvrtcGetCUBIN(prog, buf)
            return buf
        _, n = nvrtc.nvrtcGetPTXSize(prog)
        buf = b" " * n
        nvrtc.nvrtcGetPTX(prog, buf)
        return buf.decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def sass(kdir: Path, cfg, arch: str) -> list[str]:
    """The SASS of ``cfg`` compiled from ``kdir`` (nvdisasm, as scripts/sass_count.py finds it),
    instruction addresses and encodings dropped."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:  # sass_count sits beside this script
        sys.path.insert(0, here)
    from sass_count import nvdisasm

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ptx(kdir, cfg, arch, cubin=True))
        f.flush()
        text = subprocess.run([nvdisasm(), "-c", f.name], capture_output=True, text=True, check=True).stdout
    lines = (re.sub(r"/\*[0-9a-f]{4,}\*/", "", ln).strip() for ln in text.splitlines())
    return [ln for ln in lines if ln and not ln.startswith("/*")]


def normalise(text: str) -> list[str]:
    text = re.sub(r"_param_0\+\d+\]", "_param_0+OFF]", text)
    text = re.sub(r"(\.param \.align \d+ \.b8 \S+)\[\d+\]", r"\1[SIZE]", text)
    return [ln for ln in text.splitlines() if not ln.startswith(".global .align 4 .u32 _ZN4fdpp")]


def entry_kernels(e) -> list:
    """The kernel configs a table entry launches (attention's Entry, flat GEMM's GemmEntry)."""
    if isinstance(e, tables.Entry):
        return list(e.plan().kernels)
    return [e.plan.config] if e.plan.config is not None else []


def restamp(path: Path, changed: set[str], op: tables.TableOp = tables.ATTENTION) -> tuple[int, int]:
    """Give the entries of ``op``'s table ``path`` that use none of the ``changed`` variant keys
    the current source hashes (in place, the tables' locked atomic write); returns (re-stamped,
    left stale). An entry that launches no fdpp kernel (cuBLAS) is re-stamped only when nothing
    changed."""
    raw = json.loads(Path(path).read_text())
    entries = raw.pop("entries")
    kept = stale = 0
    for key, d in entries.items():
        ks = entry_kernels(op.parse(d, str(path)))
        if any(k.key in changed for k in ks) or (changed and not ks):
            stale += 1
            print(f"stale (re-tune): {key}")
            continue
        d["sources"] = {name: registry.source_hash(name) for name in d["sources"]}
        kept += 1
    raw["kernel_hashes"] = {name: registry.source_hash(name) for name in raw.get("kernel_hashes", {})}
    tables.update_file(Path(path), lambda: tables.format_table(raw, entries))
    return kept, stale


def gemm_variants(path: Path) -> list:
    """The kernels a GEMM table's entries launch (cuBLAS entries: none)."""
    from fdpp import gemm

    out = {}
    for d in json.loads(Path(path).read_text())["entries"].values():
        for cfg in entry_kernels(gemm.GEMM_OP.parse(d, str(path))):
            out[cfg.key] = cfg
    return list(out.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="git revision holding the old kernels_cu/")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--restamp", metavar="TABLE", default=None,
                    help="re-stamp this table's entries whose kernels kept their instructions")
    ap.add_argument("--sass", action="store_true",
                    help="a variant whose PTX differs counts as unchanged when its SASS is equal "
                         "(nvdisasm: PATH or the nvidia-cuda-nvdisasm wheel); PTX register renumbering")
    ap.add_argument("--gemm", metavar="TABLE", default=None,
                    help="compare the kernels of this flat GEMM table instead (--restamp: re-stamp it)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp)
        for f in FILES:
            text = subprocess.run(["git", "show", f"{args.rev}:kernels_cu/{f}"], check=True, capture_output=True,
                                  text=True).stdout
            (old / f).write_text(text)
        changed, same_sass = [], []
        variants = gemm_variants(Path(args.gemm)) if args.gemm else table_variants(SM90)
        for cfg in variants:
            if normalise(ptx(old, cfg, args.arch)) != normalise(ptx(registry.kernel_dir(), cfg, args.arch)):
                if args.sass and sass(old, cfg, args.arch) == sass(registry.kernel_dir(), cfg, args.arch):
                    same_sass.append(cfg.key)
                else:
                    changed.append(cfg.key)
    print(f"{len(variants)} table variants on {args.arch}: {len(changed)} with other instructions")
    for k in changed:
        print("  ", k)
    if same_sass:
        print(f"{len(same_sass)} more with other PTX but the same SASS (counted unchanged):")
        for k in same_sass:
            print("  ", k)
    if args.gemm and args.restamp:
        from fdpp import gemm

        kept, stale = restamp(Path(args.gemm), set(changed), gemm.GEMM_OP)
        print(f"{args.gemm}: {kept} entries re-stamped, {stale} left stale (re-tune: python -m fdpp.bench gemm --tune)")
        return 0
    if args.restamp:
        kept, stale = restamp(Path(args.restamp), set(changed))
        print(f"{args.restamp}: {kept} entries re-stamped, {stale} left stale")
        return 0
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
