#!/usr/bin/env bash
# Experiment only (not committed as code): a copy of the working tree at $2 with the attention
# split kernels' pdl_trigger moved ($1 = late: after the main KV loop; none: no explicit trigger,
# so dependents launch when the grid exits). The shipped table is restamped to the new source
# hash so the same tuned plans run (the PTX differs only in where launch_dependents sits).
set -euo pipefail
mode=$1; dst=$2; src=$(pwd)
rm -rf "$dst"; mkdir -p "$dst"
git ls-files -co --exclude-standard | grep -v "^results/" | tar cf - -T - | tar xf - -C "$dst"
cd "$dst"
f=kernels_cu/decode_split.cu
# remove the entry-point triggers of decode_split / decode_split_mma / decode_nosplit
sed -i '/^  pdl_trigger();  \/\/ the merge (or the next call) may launch now/d' $f
if [ "$mode" = late ]; then
  sed -i '253s/^  cp_async_wait<0>();$/  cp_async_wait<0>();\n  pdl_trigger();  \/\/ experiment: late trigger/' $f
  # line numbers shift by one after the first insert: the mma kernel's wait was line 673
  sed -i '674s/^  cp_async_wait<0>();$/  cp_async_wait<0>();\n  pdl_trigger();  \/\/ experiment: late trigger/' $f
  [ "$(grep -c 'experiment: late trigger' $f)" = 2 ] || { echo "late trigger not placed"; exit 1; }
fi
python3 - <<'PY'
import json
from fdpp import registry
new = registry.source_hash("decode_split.cu")
p = "tuning/NVIDIA_H200.json"; t = json.load(open(p))
old = t["kernel_hashes"]["decode_split.cu"]; t["kernel_hashes"]["decode_split.cu"] = new
n = 0
for e in t["entries"].values():
    if e.get("sources", {}).get("decode_split.cu") == old:
        e["sources"]["decode_split.cu"] = new; n += 1
json.dump(t, open(p, "w"), indent=1)
print(f"restamped {n} entries {old} -> {new}")
PY
