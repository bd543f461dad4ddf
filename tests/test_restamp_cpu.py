"""scripts/restamp_table.py: entries whose kernels compare_ptx did not list get the current source
hashes; entries with a listed kernel stay stale (the dispatcher keeps ignoring them)."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

from fdpp import registry
from fdpp.tables import Entry, shipped_dir

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("restamp_table", ROOT / "scripts" / "restamp_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_restamp_keeps_changed_entries_stale(tmp_path, monkeypatch):
    table = tmp_path / "NVIDIA_H200.json"
    shutil.copy(shipped_dir() / "NVIDIA_H200.json", table)
    raw = json.loads(table.read_text())
    for d in raw["entries"].values():  # every entry stale, as after a kernel edit
        d["sources"] = {k: "0" * 16 for k in d["sources"]}
    raw["kernel_hashes"] = {k: "0" * 16 for k in raw["kernel_hashes"]}
    entries = raw.pop("entries")
    from fdpp import tables
    table.write_text(tables.format_table(raw, entries))
    keys = sorted(entries)
    changed_entry = next(k for k in keys if ".p16." in k)
    kernels = Entry.from_json(entries[changed_entry], str(table)).plan().kernels
    report = tmp_path / "cmp.log"
    report.write_text(f"{len(keys)} table variants on sm_90: 1 with other instructions\n   {kernels[0].key}\n")
    monkeypatch.setattr(sys, "argv", ["restamp_table.py", str(report), str(table)])
    assert _script().main() == 0
    out = json.loads(table.read_text())
    assert set(out["entries"]) == set(keys)
    hashes = {name: registry.source_hash(name) for name in ("decode_split.cu", "decode_combine.cu")}
    stale = [k for k, d in out["entries"].items() if any(v != hashes[n] for n, v in d["sources"].items())]
    uses = [k for k in keys if any(x.key == kernels[0].key for x in Entry.from_json(entries[k], "t").plan().kernels)]
    assert changed_entry in stale and sorted(stale) == sorted(uses)
    assert len(stale) < len(keys)
    assert out["kernel_hashes"] == {n: hashes[n] for n in out["kernel_hashes"]}


def test_restamp_refuses_other_input(tmp_path, monkeypatch):
    report = tmp_path / "x.log"
    report.write_text("hello\n")
    monkeypatch.setattr(sys, "argv", ["restamp_table.py", str(report), str(tmp_path / "t.json")])
    assert _script().main() == 2
