"""Rewrite a flat GEMM table of the old format (``"kind": "flat_gemm"``, one ``source_hash`` for the
file, entries keyed by hand-typed strings) in the shared table format of :mod:`fdpp.tables` (an
``op`` header, a ``bucket`` / ``plan`` / ``sources`` object per entry), keeping every measurement.

    python scripts/convert_gemm_table.py OLD.json [NEW.json]   # NEW defaults to OLD (rewritten)

Entries keep the old file's ``source_hash`` as their ``flat_gemm.cu`` hash, so they stay in use only
if the kernel source has not changed since they were tuned. The device is taken from the old header
(its name must be one of fdpp.configs' known devices, or the GPU this runs on).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from fdpp import gemm
from fdpp.configs import H100, SM80, SM90

_OLD_KEY = re.compile(r"(?P<dt>fp16|bf16)(\.(?P<wf>e4m3))?\.n(?P<n>\d+)\.k(?P<k>\d+)\.m(?P<m>\d+)")


def convert(old: dict) -> tuple[object, list[gemm.GemmEntry]]:
    if old.get("kind") != "flat_gemm":
        raise SystemExit("not an old-format flat GEMM table (no \"kind\": \"flat_gemm\")")
    device = next((d for d in (SM90, H100, SM80) if d.name == old.get("device")), None)
    if device is None:
        from fdpp import registry

        device = registry.device_limits()
        if device.name != old.get("device"):
            raise SystemExit(f"table for {old.get('device')!r}; run this on that GPU")
    out = []
    for key, e in old["entries"].items():
        k = _OLD_KEY.fullmatch(key)
        if k is None:
            print(f"skipped malformed key {key!r}", file=sys.stderr)
            continue
        b = gemm.GemmBucket(k["dt"], int(k["n"]), int(k["k"]), int(k["m"]), k["wf"] or "")
        plan = gemm.plan_from_json(e, b.dtype, b.m)
        meta = {m: v for m, v in e.items() if m not in ("time_us", "impl", "grid", *gemm.PLAN_PARAMS)}
        out.append(gemm.GemmEntry(b, plan, {gemm.SOURCE: old["source_hash"]}, e.get("time_us"), meta))
    return device, out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python scripts/convert_gemm_table.py",
                                description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("old", type=Path, help="the old-format table (JSON)")
    p.add_argument("new", type=Path, nargs="?", default=None, help="where to write the new table (default: OLD)")
    args = p.parse_args(argv)
    src = args.old
    try:
        old = json.loads(src.read_text())
    except (OSError, ValueError) as e:
        p.error(f"argument old: cannot read {src}: {getattr(e, 'strerror', None) or e}")
    device, entries = convert(old)
    dst = args.new or src
    if dst.exists() and dst == src:
        dst.unlink()  # the writer merges into an existing file; the old format would only warn
    gemm.write_table(dst, device, entries, merge=False)
    print(f"{len(entries)} entries -> {dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
