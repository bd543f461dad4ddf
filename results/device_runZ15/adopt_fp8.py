"""Run Z15, call 5: take a re-tuned FP8 entry into the shipped H100 table only where its plan changed
and the bench after the tune (bench_fp8_retuned.csv) timed the point at least MARGIN faster than the
bench with the shipped table (bench_fp8_shipped.csv), both from the same machine, one after the other.

    PYTHONPATH=. python3 results/device_runZ15/adopt_fp8.py [OUT_DIR TABLE]

OUT_DIR and TABLE default to run Z15's (out/resZ15e, the H100 table); run Z17 passes its own
(results/device_runZ17/out/resZ17b tuning/NVIDIA_H200.json).
"""

import json
import sys
from pathlib import Path

import pandas as pd

from fdpp import tables

HERE = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "out" / "resZ15e"
TABLE = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("tuning/NVIDIA_H100_80GB_HBM3.json")
MARGIN = 0.01


def fdpp_times(csv: Path) -> dict[tuple[int, int, int], float]:
    d = pd.read_csv(csv)
    d = d[d.impl.isin(["fdpp", "fdpp-paged"])]
    return {(int(r.batch), int(r.seqlen), int(r.page_size)): float(r.time_us) for r in d.itertuples()}


def main() -> None:
    before, after = fdpp_times(HERE / "bench_fp8_shipped.csv"), fdpp_times(HERE / "bench_fp8_retuned.csv")
    new = json.loads((HERE / "tuning" / TABLE.name).read_text())["entries"]
    raw = json.loads(TABLE.read_text())
    entries = raw.pop("entries")
    taken = 0
    for key, d in new.items():
        if "kve4m3" not in key or d["plan"] == entries[key]["plan"]:
            continue
        b = tables.Bucket.from_json(d["bucket"])
        point = (b.batch, b.seqlen, b.heads.page_size)
        t0, t1 = before[point], after[point]
        take = t1 <= (1 - MARGIN) * t0
        print(f"{key}: bench {t0:.2f} -> {t1:.2f} us ({t1 / t0 - 1:+.1%}) {'taken' if take else 'kept shipped'}")
        if take:
            entries[key] = d
            taken += 1
    tables.update_file(TABLE, lambda: tables.format_table(raw, entries))
    print(f"{taken} entries taken into {TABLE}")


if __name__ == "__main__":
    main()
