"""Re-rank run J3's GEMM table with the CUBLAS_MARGIN rule added after J3 (fdpp.gemm.rank_candidates),
on the times the tuner measured there: an entry whose kernel beat cuBLAS by less than the margin
becomes a cuBLAS entry (its kernel moves into the alternatives). Writes through gemm.write_table."""
import json
import sys

from fdpp import gemm
from fdpp.configs import SM90

path = sys.argv[1]
raw = json.load(open(path))
changed = {}
for key, e in raw["entries"].items():
    if e["impl"] == "cublas" or e["time_us"] <= e["cublas_us"] * (1 - gemm.CUBLAS_MARGIN):
        continue
    dt, m = key.split(".")[0], int(key.rsplit(".m", 1)[1])
    won = gemm.plan_from_entry(e, dt, m)
    ranked = gemm.rank_candidates([(e["time_us"], won), (e["cublas_us"], gemm.GemmPlan("cublas"))], e["cublas_us"])
    assert ranked[0][1].impl == "cublas"
    alts = dict(sorted({won.describe(): e["time_us"], **e["alternatives"]}.items(), key=lambda kv: kv[1])[:4])
    changed[key] = gemm.entry_from_plan(ranked[0][1], time_us=e["cublas_us"], cublas_us=e["cublas_us"], alternatives=alts)
    print(f"{key}: {won.describe()} {e['time_us']} vs cuBLAS {e['cublas_us']} -> cuBLAS")
gemm.write_table(path, SM90, changed)
