"""``python -m fdpp``: the version, whether a GPU is usable, and the commands of the toolkit."""

from __future__ import annotations

import sys

COMMANDS = (
    ("python -m fdpp.tune", "tune the decode kernels on this GPU (writes the table the dispatcher loads)"),
    ("python -m fdpp.bench", "latency vs context length against the memory floor and the peers (--emulator: NumPy)"),
    ("python -m fdpp.bench gemm", "flat GEMM against cuBLAS"),
    ("python -m fdpp.bench e2e", "a whole model's decode step"),
    ("python -m fdpp.plot CSV", "figures from a bench CSV"),
)


def main() -> int:
    import fdpp

    gpu = "a CUDA GPU is available" if fdpp.gpu_available() else "no GPU found: calls on NumPy arrays run the NumPy emulator"
    print(f"fdpp {fdpp.__version__}: {gpu}")
    for cmd, what in COMMANDS:
        print(f"  {cmd:<28} {what}")
    print("Each takes --help.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
