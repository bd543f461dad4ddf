"""How tuning/NVIDIA_H200.json was made from run M3's table and run M2's (both tuned on the H200
with today's kernel sources: the same source hashes): M3's table, except that an FP8 / INT4
bucket takes M2's entry where M2's tuner time (time_us) is more than 3 % lower (past the noise of
two tuning runs: the same plan timed within 0.1-1 % in both). Run from the project root:

    python3 results/device_runM3/merge_quantized.py

Why: M1's INT4 study (12 trials per bucket, the cluster merge widening the search) missed plans
the earlier table had (INT4, B = 8, N = 64k: 337.7 us against 284.3), and M2's sweeps measured
the earlier table's plans (results/device_runM2/bench_int4.log, bench_fp8.log). fp16 / bf16
buckets stay M3's, which run M1's sweeps measured.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fdpp.tables import format_table  # noqa: E402 - the table file's own layout

here = Path(__file__).resolve().parent
m3 = json.loads((here / "NVIDIA_H200.json").read_text())
m2 = json.loads((here.parent / "device_runM2" / "NVIDIA_H200.json").read_text())["entries"]
assert m3["kernel_hashes"] == json.loads((here.parent / "device_runM2" / "NVIDIA_H200.json").read_text())["kernel_hashes"]
taken = []
for key, e in m3["entries"].items():
    other = m2.get(key)
    if e["bucket"]["kv_dtype"] not in ("fp16", "bf16", "fp32") and other and other["time_us"] < 0.97 * e["time_us"]:
        m3["entries"][key] = other
        taken.append(f"{key}: {e['time_us']} -> {other['time_us']} us")
out = here.parent.parent / "tuning" / "NVIDIA_H200.json"
header = {k: v for k, v in m3.items() if k != "entries"}
out.write_text(format_table(header, m3["entries"]))
print(f"{len(taken)} entries from run M2's table:\n  " + "\n  ".join(taken))
