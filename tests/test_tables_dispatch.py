"""Tuned tables and the dispatcher, on the CPU: round trip, header and hash checks, nearest
bucket, user override, split scaling, forced plans, explain()."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from fdpp import dispatch, gemm, tables, tune
from fdpp.configs import SM80, SM90, DecodeProblem, DeviceLimits, LaunchPlan, default_config
from fdpp.tables import Bucket, Entry, HeadConfig, TableWarning, bucket_pow2

ROOT = Path(__file__).resolve().parent.parent
L8B = HeadConfig(32, 8, 128, "fp16")  # llama3-8b heads


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Empty shipped dir and a tmp user dir, fresh caches (a committed tuning/*.json must not leak in)."""
    shipped = tmp_path / "shipped"
    user = tmp_path / "user"
    shipped.mkdir()
    user.mkdir()
    monkeypatch.setattr(tables, "shipped_dir", lambda: shipped)
    monkeypatch.setenv(tables.ENV_DIR, str(user))
    dispatch.clear_cache()
    yield shipped, user
    dispatch.clear_cache()


def prob(batch=1, n=4096, heads=L8B):
    return DecodeProblem(batch, heads.num_q_heads, heads.num_kv_heads, heads.head_dim, n, heads.dtype)


def variant(heads=L8B, i=-1):
    """A valid kernel config other than the heuristic's (the last of kernel_space)."""
    heur = default_config(prob(heads=heads)).split
    cands = [c for c in tune.kernel_candidates(prob(heads=heads)) if c.is_valid(SM90) and c != heur]
    return cands[i]


def entry(seqlen=4096, batch=1, splits=33, cfg=None, heads=L8B, cw=2, **meta):
    cfg = cfg or variant(heads)
    comb = tables.CombineConfig(heads.dtype, heads.head_dim, cw) if splits > 1 else None
    b = Bucket(heads, seqlen, batch)
    return Entry.from_plan(b, LaunchPlan.split_kv(cfg, splits, comb), time_us=5.0, heuristic_time_us=6.0, **meta)


def table_path(d: Path, device=SM90) -> Path:
    return d / tables.table_filename(device.name)


# ---- buckets --------------------------------------------------------------------------------
@pytest.mark.parametrize("x, want", [(0, 1), (1, 1), (2, 2), (3, 4), (5, 4), (6, 8), (7, 8), (1000, 1024),
                                     (1448, 1024), (1449, 2048), (4096, 4096), (5000, 4096), (6000, 8192),
                                     (262144, 262144), (300000, 262144)])
def test_bucket_pow2_is_nearest_in_log2(x, want):
    assert bucket_pow2(x) == want


def test_bucket_key_and_problem():
    b = Bucket.of(DecodeProblem(3, 32, 8, 128, 5000, "bf16"))
    assert b.key == "q32.kv8.d128.bf16.n4096.b4"
    assert b.problem() == DecodeProblem(4, 32, 8, 128, 4096, "bf16")


def test_table_filename():
    assert tables.table_filename("NVIDIA H200") == "NVIDIA_H200.json"
    assert tables.table_filename("NVIDIA A100-SXM4-80GB") == "NVIDIA_A100_SXM4_80GB.json"


# ---- round trip -----------------------------------------------------------------------------
def test_round_trip_and_dispatch(isolated):
    _, user = isolated
    e = entry()
    path = tables.write_table(user, SM90, [e], {"cupy": "14.2.0"})
    assert path == table_path(user)
    assert not [p for p in user.iterdir() if p.suffix == ".tmp"], "temp file left behind"
    doc = json.loads(path.read_text())
    assert doc["schema"] == tables.SCHEMA_VERSION and doc["params"] == list(tables.PARAM_NAMES)
    assert doc["device"]["name"] == SM90.name and set(doc["kernel_hashes"]) >= {"decode_split.cu"}
    t = tables.read_table(path, SM90)
    assert t.error is None and not t.rejected
    back = t.entries[e.bucket.key]
    assert back == e and back.time_us == 5.0 and back.heuristic_time_us == 6.0
    plan = dispatch.select_plan(prob(), SM90)
    assert plan.source == "table"
    assert plan.split == e.split and plan.num_splits == 33 and plan.combine.num_warps == 2


def test_write_merges_and_replaces(isolated):
    _, user = isolated
    tables.write_table(user, SM90, [entry(4096, splits=33), entry(65536, splits=64)])
    tables.write_table(user, SM90, [entry(4096, splits=17)])
    t = tables.read_table(table_path(user), SM90)
    assert {k: e.num_splits for k, e in t.entries.items()} == {
        "q32.kv8.d128.fp16.n4096.b1": 17, "q32.kv8.d128.fp16.n65536.b1": 64}


def test_no_table_means_heuristic():
    p = prob(batch=3, n=5000)
    assert dispatch.select_plan(p, SM90) == default_config(p, SM90)
    text = dispatch.explain(p, SM90)
    assert "no tuned table" in text and "heuristic" in text


def test_num_splits_argument_keeps_heuristic_kernel(isolated):
    _, user = isolated
    tables.write_table(user, SM90, [entry()])
    plan = dispatch.select_plan(prob(), SM90, num_splits=7)
    heur = default_config(prob(), SM90).split  # at 4k a cluster of 8 (heuristic_cluster): its kernel, merged in the launch
    assert heur.cluster == 8 and plan.split == dataclasses.replace(heur, cluster=1) and plan.mode == "fused"
    assert plan.num_splits == 7 and plan.source == "user"
    with pytest.raises(ValueError):
        dispatch.select_plan(prob(), SM90, num_splits=0)


# ---- damaged tables: warn, fall back, never crash ---------------------------------------------
def _write_doc(path: Path, mutate) -> None:
    doc = json.loads(path.read_text())
    mutate(doc)
    path.write_text(json.dumps(doc))
    dispatch.clear_cache()


def _assert_heuristic_with_warning(p, match):
    with pytest.warns(TableWarning, match=match):
        plan = dispatch.select_plan(p, SM90)
    assert plan == default_config(p, SM90)


def test_corrupt_json_falls_back(isolated):
    _, user = isolated
    table_path(user).write_text('{"schema": 1, "entries": {')
    _assert_heuristic_with_warning(prob(), "corrupt JSON")
    assert "IGNORED: corrupt JSON" in dispatch.explain(prob(), SM90)


@pytest.mark.parametrize("field, value, match", [
    ("schema", 99, "schema 99"),
    ("params", ["num_warps", "num_splits", "tile_shape"], "tuned parameters"),
    ("params", 5, "tuned parameters"),
    ("entries", [1, 2], "no 'entries' object"),
    ("device", {"name": "NVIDIA A100-SXM4-80GB"}, "written for device"),
])
def test_header_mismatch_falls_back(isolated, field, value, match):
    _, user = isolated
    path = tables.write_table(user, SM90, [entry()])
    _write_doc(path, lambda d: d.__setitem__(field, value))
    _assert_heuristic_with_warning(prob(), match)


def test_source_hash_mismatch_rejects_entry(isolated):
    _, user = isolated
    path = tables.write_table(user, SM90, [entry()])
    _write_doc(path, lambda d: d["entries"]["q32.kv8.d128.fp16.n4096.b1"]["sources"].update(
        {"decode_split.cu": "deadbeefdeadbeef"}))
    _assert_heuristic_with_warning(prob(), "decode_split.cu changed since tuning")
    text = dispatch.explain(prob(), SM90)
    assert "rejected: q32.kv8.d128.fp16.n4096.b1" in text and "deadbeefdeadbeef" in text


def test_combine_hash_only_invalidates_entries_that_combine(isolated):
    _, user = isolated
    no_split = entry(4096, splits=1)
    split = entry(65536, splits=64)
    assert set(no_split.sources) == {"decode_split.cu"}
    assert set(split.sources) == {"decode_split.cu", "decode_combine.cu"}
    path = tables.write_table(user, SM90, [no_split, split])

    def stale_combine(d):
        for e in d["entries"].values():
            if "decode_combine.cu" in e["sources"]:
                e["sources"]["decode_combine.cu"] = "0000000000000000"

    _write_doc(path, stale_combine)
    with pytest.warns(TableWarning, match="decode_combine.cu changed"):
        ts = tables.table_set(SM90)
    assert set(ts.entries) == {no_split.bucket.key}


def test_malformed_and_invalid_entries_rejected(isolated):
    _, user = isolated
    path = tables.write_table(user, SM90, [entry(4096), entry(16384)])

    def damage(d):
        d["entries"]["q32.kv8.d128.fp16.n4096.b1"]["plan"]["num_warps"] = "eight"
        d["entries"]["q32.kv8.d128.fp16.n16384.b1"]["plan"]["num_warps"] = 3
        d["entries"]["garbage"] = {"bucket": 1}
        zero = json.loads(json.dumps(d["entries"]["q32.kv8.d128.fp16.n16384.b1"]))
        zero["bucket"]["num_kv_heads"] = 0
        d["entries"]["q32.kv0.d128.fp16.n16384.b1"] = zero

    _write_doc(path, damage)
    with pytest.warns(TableWarning, match="4 entries"):
        ts = tables.table_set(SM90)
    assert not ts.entries
    assert dispatch.select_plan(prob(), SM90) == default_config(prob(), SM90)


def test_config_invalid_on_device_rejected(isolated):
    _, user = isolated
    small = DeviceLimits(SM90.name, (9, 0), 132, smem_per_block=1024)
    tables.write_table(user, SM90, [entry()])
    dispatch.clear_cache()
    with pytest.warns(TableWarning, match="invalid on"):
        ts = tables.table_set(small)
    assert not ts.entries


def test_unreadable_tables_never_break_a_call(isolated, monkeypatch):
    def boom(*a, **k):
        raise PermissionError("no")

    monkeypatch.setattr(tables, "table_set", boom)
    with pytest.warns(TableWarning, match="unavailable"):
        assert dispatch.select_plan(prob(), SM90) == default_config(prob(), SM90)


def test_other_device_has_no_table(isolated):
    _, user = isolated
    tables.write_table(user, SM90, [entry()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SM80 simply has no file: no warning
        assert dispatch.select_plan(prob(), SM80) == default_config(prob(), SM80)


# ---- lookup ---------------------------------------------------------------------------------
def test_nearest_bucket(isolated):
    _, user = isolated
    a = entry(4096, 1, splits=33)
    b = entry(65536, 8, splits=16)
    tables.write_table(user, SM90, [a, b])
    ts = tables.table_set(SM90)
    m = ts.lookup(prob(1, 5000))  # bucket n4096.b1: exact
    assert m.exact and m.entry == a
    m = ts.lookup(prob(1, 16384))  # 2 octaves from 4096; the b8 entry is 3 octaves of batch away
    assert not m.exact and m.entry == a and (m.d_seqlen, m.d_batch) == (2, 0)
    m = ts.lookup(prob(8, 30000))  # bucket n32768.b8 -> n65536.b8
    assert m.entry == b and (m.d_seqlen, m.d_batch) == (1, 0)
    m = ts.lookup(prob(2, 4096))  # batch 2: b1 is 1 octave away, b8 2 octaves and 4 of seqlen
    assert m.entry == a and m.d_batch == 1
    assert ts.lookup(prob(1, 1 << 20)) is None  # 8 octaves: too far -> heuristic
    assert ts.lookup(prob(1, 4096, HeadConfig(32, 32, 128, "fp16"))) is None  # other heads
    assert ts.lookup(prob(1, 4096, HeadConfig(32, 8, 128, "bf16"))) is None  # other dtype
    text = dispatch.explain(prob(1, 1 << 20), SM90)
    assert "no tuned bucket within 2 octaves" in text


def test_nearest_tie_goes_to_larger_bucket(isolated):
    _, user = isolated
    lo, hi = entry(16384, splits=17), entry(65536, splits=64)
    tables.write_table(user, SM90, [lo, hi])
    m = tables.table_set(SM90).lookup(prob(1, 32768))
    assert m.entry == hi and m.d_seqlen == 1


def test_user_overrides_shipped(isolated):
    shipped, user = isolated
    other_cfg = variant(i=0)
    tables.write_table(shipped, SM90, [entry(4096, cfg=other_cfg), entry(65536, cfg=other_cfg)])
    tables.write_table(user, SM90, [entry(4096)])
    assert dispatch.select_plan(prob(1, 4096), SM90).split == variant()
    assert dispatch.select_plan(prob(1, 65536), SM90).split == other_cfg
    text = dispatch.explain(prob(1, 4096), SM90)
    assert f"shipped table: {table_path(shipped)}" in text and f"user table: {table_path(user)}" in text
    assert f"from {table_path(user)}" in text


def test_env_dir_override(isolated, tmp_path, monkeypatch):
    _, user = isolated
    other = tmp_path / "other"
    tables.write_table(other, SM90, [entry(4096)])
    assert dispatch.select_plan(prob(), SM90).source == "heuristic"
    monkeypatch.setenv(tables.ENV_DIR, str(other))  # no clear_cache needed: the dir is in the key
    assert dispatch.select_plan(prob(), SM90).source == "table"
    monkeypatch.setenv(tables.ENV_DIR, str(user))
    assert dispatch.select_plan(prob(), SM90).source == "heuristic"


def test_lookup_is_memoised(isolated, monkeypatch):
    _, user = isolated
    tables.write_table(user, SM90, [entry()])
    reads = []
    real = tables.read_table
    monkeypatch.setattr(tables, "read_table", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    first = dispatch.select_plan(prob(), SM90)
    for n in (4000, 4096, 5000, 3000):
        dispatch.select_plan(prob(1, n), SM90)
    assert len(reads) == 2  # shipped + user, once
    table_path(user).unlink()
    assert dispatch.select_plan(prob(), SM90) == first  # still memoised
    dispatch.clear_cache()
    assert dispatch.select_plan(prob(), SM90).source == "heuristic"


# ---- split scaling --------------------------------------------------------------------------
def test_scaled_splits_keeps_count_and_ctas(isolated):
    e8 = entry(65536, 8, splits=33)
    assert dispatch.scaled_splits(e8, prob(8, 65536)) == 33
    assert dispatch.scaled_splits(e8, prob(8, 50000)) == 33  # same bucket: count kept, chunk follows
    assert dispatch.scaled_splits(e8, prob(4, 65536)) == 66  # half the batch: twice the splits
    assert dispatch.scaled_splits(e8, prob(6, 65536)) == 44
    assert dispatch.scaled_splits(e8, prob(16, 65536)) == 17  # 16.5 rounds half up
    e1 = entry(1024, 1, splits=16)
    assert dispatch.scaled_splits(e1, prob(1, 900)) == 14  # chunks of >= MIN_CHUNK tokens
    assert dispatch.scaled_splits(e1, prob(1, 40)) == 1
    assert dispatch.scaled_splits(entry(4096, 8, splits=1), prob(32, 4096)) == 1
    e = entry(4096, 8, splits=1)
    assert e.plan(3).combine is not None and e.plan(1).combine is None


def test_dispatch_scales_and_explains(isolated):
    _, user = isolated
    tables.write_table(user, SM90, [entry(4096, 8, splits=33)])
    p = prob(4, 5000)
    plan = dispatch.select_plan(p, SM90)
    assert plan.num_splits == 66 and plan.source == "table"
    text = dispatch.explain(p, SM90)
    assert "nearest tuned bucket q32.kv8.d128.fp16.n4096.b8" in text
    assert "tuned 33 at batch 8, scaled to 66 for batch 4" in text
    assert "5.00 µs there vs 6.00 µs" in text
    assert f"runs: {plan.split.key}, 66 splits of 76 tokens" in text


def test_explain_exact(isolated):
    _, user = isolated
    tables.write_table(user, SM90, [entry()])
    text = dispatch.explain(prob(1, 4000), SM90)
    assert "bucket: q32.kv8.d128.fp16.n4096.b1" in text
    assert f"tuned entry for this exact bucket: q32.kv8.d128.fp16.n4096.b1 from {table_path(user)}" in text
    assert "1 entries kept, 0 rejected" in text


# ---- forced plans ---------------------------------------------------------------------------
def test_forced_plan(isolated):
    p = prob(2, 3000)
    forced = LaunchPlan.split_kv(variant(), 5, tables.CombineConfig("fp16", 128, 8))
    with dispatch.forced_plan(forced):
        assert dispatch.select_plan(p, SM90) is forced
        assert dispatch.select_plan(p, SM90, num_splits=3) is forced
        assert "forced" in dispatch.explain(p, SM90)
        with pytest.raises(ValueError, match=r"\(dtype, kv_dtype, head_dim, page_size\)"):
            dispatch.select_plan(dataclasses.replace(p, dtype="bf16"), SM90)
        with pytest.raises(ValueError, match="group_size"):
            dispatch.select_plan(dataclasses.replace(p, num_kv_heads=16), SM90)  # ratio 2
    assert dispatch.select_plan(p, SM90) == default_config(p, SM90)


def test_tables_import_no_cupy():
    code = ("import sys; import fdpp.tables, fdpp.dispatch, fdpp.tune; "
            "assert 'cupy' not in sys.modules, 'cupy imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})


def test_user_dir_without_platformdirs(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "platformdirs", None)  # import fails
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tables.user_cache_dir() == tmp_path / "fdpp"


def test_version_differences_are_reported_not_fatal(isolated):
    _, user = isolated
    path = tables.write_table(user, SM90, [entry()], {"cupy": "13.0.0"})
    _write_doc(path, lambda d: d.__setitem__("fdpp_version", "0.0.1"))
    assert dispatch.select_plan(prob(), SM90).source == "table"
    assert "tuned with fdpp 0.0.1" in dispatch.explain(prob(), SM90)


def test_source_hash_ignores_comments_but_not_code():
    from fdpp.registry import _code_only

    code = "__global__ void k(int* x) { x[0] = 1; }"
    assert _code_only("// variants: measured 66 us\n" + code + "  /* note */\n") == _code_only(code)
    assert _code_only(code.replace("= 1", "= 2")) != _code_only(code)


SHIPPED = sorted((ROOT / "tuning").glob("*.json"))


def test_the_shipped_tables_are_found():
    assert {p.name for p in SHIPPED} >= {f"{c}{op}.json" for c in ("NVIDIA_H200", "NVIDIA_H100_80GB_HBM3")
                                         for op in ("", "_gemm")}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_table_is_current(path):
    """Every entry of a shipped table (attention or flat GEMM) matches the tree's kernel sources,
    headers included: a stale entry would be dropped with a TableWarning on every user's first call
    on that GPU. After a kernel or header edit: scripts/compare_ptx.py REV --restamp TABLE (--gemm
    TABLE for a GEMM table), then re-tune what it leaves stale."""
    dev = json.loads(path.read_text())["device"]
    card = DeviceLimits(dev["name"], tuple(dev["cc"]), dev["sm_count"], SM90.smem_per_block)
    op = gemm.GEMM_OP if path.name.endswith("_gemm.json") else tables.ATTENTION
    t = tables.read_table(path, card, warn=False, op=op)
    assert t.error is None, t.error
    assert not t.rejected, sorted(t.rejected.items())[:3]
    assert len(t.entries) >= 20
