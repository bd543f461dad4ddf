"""GPU probe: variants of the tensor-core kernel's online softmax, timed on the shipped table's plans.

    python3 scripts/probe_softmax.py --variant exact|no-max|lazy-quad [--heads 32/8,8/1] [--batch 1,8]
                                     [--seqlens 1024,4096,16384,65536]

Each variant patches the 16-bit (and INT4) softmax of ``attend_chunk_mma`` in decode_split.cu's text (the
FP8 path has its own since run Q6) before anything is compiled;
run one process per variant (compiled kernels are cached per process) and compare the us columns.

- ``exact``: the shipped source.
- ``no-max``: the running max removed (phi = 0 in the log2 domain: the rescale vote and the
  rescale are gone). An upper bound on what a unified max can save, without the window checks
  ``softmax_mode="unified_max"`` keeps: not a usable kernel (exact on this probe's data, whose
  scores stay near 0; the err column checks).
- ``lazy-quad``: the lazy-rescale vote on each lane's own tile max, the quad shuffles only inside
  the (rare) rescale branch. Bitwise the same results as ``exact`` in exact softmax mode (the
  kernels this probe times): a row's quad max exceeds m + 8 exactly when one of its lanes' maxima
  does. (Not for the unified-max twins, whose first-block test ``mx < m - 1`` needs the quad max.)
"""

from __future__ import annotations

import argparse

from probe_cluster import PROBE_HEADER, _ints, table_row, time_plans, use_sources

from fdpp import registry

# The 16-bit (and INT4) paths' softmax, inside the else branch of the FP8 one (8 spaces deep).
_SHUFFLES = ("        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));\n"
             "        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));\n")
_VOTE = "        if (__any_sync(0xffffffffu, mx > m + LAZY || (first && mx < m - 1.f && qrow < G))) {\n"
# Text replacements of each variant (each old text must occur exactly once).
VARIANTS: dict[str, dict[str, str]] = {
    "exact": {},
    "no-max": {"float m = m0, l = 0.f;  // for head row qrow": "float m = 0.f, l = 0.f;  // for head row qrow",
               _VOTE: "        if (false) {\n"},
    "lazy-quad": {_SHUFFLES: "", _VOTE: _VOTE + _SHUFFLES.replace("        ", "          ")},
}


def patch(variant: str) -> None:
    src = registry.kernel_source("decode_split.cu")
    for old, new in VARIANTS[variant].items():
        if src.count(old) != 1:
            raise SystemExit(f"probe_softmax: {old!r} occurs {src.count(old)} times in decode_split.cu")
        src = src.replace(old, new)
    use_sources(lambda name, text: src if name == "decode_split.cu" else text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="exact")
    ap.add_argument("--heads", default="32/8,8/1")
    ap.add_argument("--batch", type=_ints, default=[1, 8])
    ap.add_argument("--seqlens", type=_ints, default=[1024, 4096, 16384, 65536])
    args = ap.parse_args()
    patch(args.variant)
    print(f"{args.variant:<9} {PROBE_HEADER}")
    for heads in args.heads.split(","):
        for b in args.batch:
            for n in args.seqlens:
                time_plans(heads, b, n, lambda prob: [table_row(prob)])


if __name__ == "__main__":
    main()
