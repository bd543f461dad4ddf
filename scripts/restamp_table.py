"""Re-stamp the ``sources`` hashes of tuned entries whose kernels a source edit left unchanged.

Run after ``scripts/compare_ptx.py REV`` reported which table variants got other instructions:
entries none of whose kernels is in that list keep their tuned timing (the same instruction
stream), so their ``sources`` hashes are set to the current ones; entries with a changed kernel
are left stale (the dispatcher ignores them) for a re-tune.

    PYTHONPATH=. python scripts/compare_ptx.py REV > cmp.log
    PYTHONPATH=. python scripts/restamp_table.py cmp.log tuning/NVIDIA_H200.json
"""

import argparse
import json
import sys
from pathlib import Path

from fdpp import registry, tables
from fdpp.tables import Entry


def changed_keys(report: str) -> set[str]:
    """The variant keys compare_ptx listed (its indented lines)."""
    return {ln.strip() for ln in report.splitlines() if ln.startswith("   ") and ln.strip()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", help="scripts/compare_ptx.py's output")
    ap.add_argument("table", help="the decode table to re-stamp in place")
    args = ap.parse_args()
    report = Path(args.report).read_text()
    if "table variants on" not in report:
        print("restamp_table: not a compare_ptx report", file=sys.stderr)
        return 2
    changed = changed_keys(report)
    path = Path(args.table)
    raw = json.loads(path.read_text())
    kept = stale = 0
    for key, d in raw["entries"].items():
        kernels = Entry.from_json(d, str(path)).plan().kernels
        if any(k.key in changed for k in kernels):
            stale += 1
            print(f"stale (re-tune): {key}")
            continue
        d["sources"] = {name: registry.source_hash(name) for name in d["sources"]}
        kept += 1
    entries = raw.pop("entries")
    raw["kernel_hashes"] = {name: registry.source_hash(name) for name in raw.get("kernel_hashes", {})}
    tables.update_file(path, lambda: tables.format_table(raw, entries))
    print(f"restamp_table: {kept} entries re-stamped, {stale} left stale ({len(changed)} changed variants)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
