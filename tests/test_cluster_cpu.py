"""The cluster merge (``decode_split_mma_cluster``, sm_90) on the CPU: validity rules, plans, table
entries, the tuner's search and seeds, ``explain``, and the compiled kernels (NVRTC: no spills, no
stack, the cluster size in the PTX). The GPU checks are in tests/test_gpu_fused.py."""

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from fdpp import dispatch, registry, tables, tune
from fdpp.configs import (
    CLUSTER_SIZES,
    SM80,
    SM90,
    DecodeConfig,
    DecodeProblem,
    LaunchPlan,
    default_config,
    default_kernel,
)

ROOT = Path(__file__).resolve().parent.parent
P8B = DecodeProblem(1, 32, 8, 128, 1024, "fp16")


def _cfg(c=16, **kw):
    return dataclasses.replace(default_kernel(P8B, SM90), cluster=c, **kw)


def test_validity_rules():
    assert _cfg(16).check(SM90) is None
    assert "sm_90" in _cfg(16).check(SM80)
    assert _cfg(3).check(SM90) is None and _cfg(12).check(SM90) is None  # any size 2..16 runs
    assert "outside 2..16" in _cfg(17).check(SM90)
    assert "outside 2..16" in _cfg(32).check(SM90)
    assert "tensor-core" in dataclasses.replace(_cfg(4), mma=False).check(SM90)
    # the CTA's own state follows the per-warp states in shared memory
    one, many = _cfg(1), _cfg(16)
    assert many.smem_bytes() >= (one.num_warps + 1) * one.group_size * (one.head_dim + 2) * 4


def test_names():
    c = _cfg(8)
    assert c.function == "decode_split_mma_cluster" and c.key.endswith(".c8")
    assert c.name_expression().endswith(",8>") and c.name_expression().startswith("fdpp::decode_split_mma_cluster<")
    assert _cfg(1).key == default_kernel(P8B, SM90).key  # cluster 1: the plain variant, names unchanged


@pytest.mark.parametrize("n", [5, 1000, 1024, 70000])
def test_plan_launches_one_cluster_per_group(n):
    prob = dataclasses.replace(P8B, seqlen=n)
    p = LaunchPlan.cluster_merge(default_kernel(prob, SM90), 16)
    assert p.mode == "cluster" and len(p.kernels) == 1 and p.combine is None
    assert p.effective_splits(n) == 16  # the whole cluster, trailing CTAs empty when n < 16 chunks
    assert p.chunk(n) == -(-n // 16)
    assert p.split.grid(prob, p.effective_splits(n)) == (16, 8, 1)
    assert p.counter_words(prob, n) == 0
    paged = LaunchPlan.cluster_merge(default_kernel(dataclasses.replace(prob, page_size=64), SM90), 4)
    assert paged.chunk(n) % 64 == 0


def test_split_kv_keeps_a_cluster_variant_a_cluster():
    p = LaunchPlan.split_kv(_cfg(4), 99, fused=True)
    assert p.mode == "cluster" and p.num_splits == 4


def test_table_entry_round_trip_and_scaling():
    b = tables.Bucket.of(P8B)
    plan = LaunchPlan.cluster_merge(default_kernel(P8B, SM90), 16, source="tune")
    e = tables.Entry.from_plan(b, plan, time_us=4.2)
    d = e.to_json()
    assert d["plan"]["merge"] == "cluster" and d["plan"]["cluster"] == 16 and d["plan"]["combine_warps"] is None
    back = tables.Entry.from_json(d)
    assert back.plan().mode == "cluster" and back.plan().split == plan.split
    assert back.check(SM90) is None
    assert back.plan(5).split.cluster == 4  # scaled (a larger batch): the largest cluster within
    assert back.plan(1).mode == "single" and back.plan(1).split.cluster == 1
    bad = {**d, "plan": {**d["plan"], "cluster": 1}}
    with pytest.raises(ValueError, match="cluster"):
        tables.Entry.from_json(bad)
    bad = {**d, "plan": {**d["plan"], "num_splits": 8}}
    with pytest.raises(ValueError, match="cluster"):
        tables.Entry.from_json(bad)


def test_search_offers_the_cluster_merge_only_where_it_runs():
    assert "cluster" in tune.search_space(P8B, SM90)["merge"]
    assert "cluster" not in tune.search_space(P8B, SM80)["merge"]
    assert "cluster" not in tune.search_space(dataclasses.replace(P8B, dtype="fp32"), SM90)["merge"]
    assert "cluster" not in tune.search_space(dataclasses.replace(P8B, seqlen=64), SM90)["merge"]


@pytest.mark.parametrize("splits, want", [(16, 16), (17, 16), (12, 8), (3, 2), (1, 0)])
def test_trial_params_map_the_split_count_to_a_cluster(splits, want):
    space = tune.search_space(P8B, SM90)
    params = {**tune.params_of(default_config(P8B, SM90), space), "merge": "cluster", "num_splits": splits}
    p = tune.plan_from_params(P8B, params)
    if want:
        assert p.mode == "cluster" and p.split.cluster == want
        assert tune.params_of(p, space)["merge"] == "cluster"
        assert tune.plan_key(p, 1024).endswith("|cluster")
    else:
        assert p.mode == "single"


def test_seeds_and_precompiled_variants_hold_the_cluster_merge():
    space = tune.search_space(P8B, SM90)
    seeds = [s for s in tune._seed_points(P8B, SM90, space) if s["merge"] == "cluster"]
    assert {s["num_splits"] for s in seeds} == {16, 8}  # 8 KV heads x 16 CTAs fill 128 of 132 SMs
    b8 = dataclasses.replace(P8B, batch=8)
    assert {s["num_splits"] for s in tune._seed_points(b8, SM90, tune.search_space(b8, SM90))
            if s["merge"] == "cluster"} == {2}
    vs = tune.variants(tables.head_config(P8B), SM90)
    assert {v.cluster for v in vs if isinstance(v, DecodeConfig)} == {1, *CLUSTER_SIZES}
    assert all(v.cluster == 1 for v in tune.variants(tables.head_config(P8B), SM80) if isinstance(v, DecodeConfig))


@pytest.mark.parametrize("prob, dev, want", [
    (P8B, SM90, 8),                                                            # 16 splits: a cluster of 8
    (dataclasses.replace(P8B, seqlen=4096), SM90, 8),
    (dataclasses.replace(P8B, batch=8), SM90, 2),                              # 2 splits
    (dataclasses.replace(P8B, num_q_heads=8, num_kv_heads=1), SM90, 8),        # llama3-70b TP 8
    (dataclasses.replace(P8B, kv_dtype="fp8_e4m3"), SM90, 8),
    (dataclasses.replace(P8B, page_size=16), SM90, 8),
    (dataclasses.replace(P8B, seqlen=8192), SM90, 1),                          # longer: fused
    (dataclasses.replace(P8B, batch=64), SM90, 1),                             # one split
    (dataclasses.replace(P8B, num_kv_heads=32), SM90, 1),                      # 4 splits (MHA)
    (dataclasses.replace(P8B, page_size=256), SM90, 1),                        # whole pages: 4 splits launched
    (dataclasses.replace(P8B, kv_dtype="int4_g64"), SM90, 1),
    (dataclasses.replace(P8B, num_q_heads=28, num_kv_heads=4), SM90, 8),       # 7 heads per CTA (qwen2.5-7b)
    (dataclasses.replace(P8B, num_q_heads=16, num_kv_heads=8, seqlen=2048), SM90, 8),  # 2 heads per CTA
    (dataclasses.replace(P8B, num_q_heads=24, num_kv_heads=8), SM90, 8),       # 3 heads per CTA
    (dataclasses.replace(P8B, dtype="fp32", kv_dtype="fp32"), SM90, 1),       # CUDA cores
    (P8B, SM80, 1),                                                            # no clusters
])
def test_heuristic_merges_short_caches_in_a_cluster(prob, dev, want, isolated_tuning):
    """configs.heuristic_cluster: what the heuristic (and, without a table, the dispatcher) launches."""
    plan = default_config(prob, dev)
    if want == 1:
        assert plan.split.cluster == 1 and plan.mode in ("fused", "single")
    else:
        assert plan.mode == "cluster" and plan.split.cluster == want and plan.num_splits == want
        assert plan.split.is_valid(dev) and plan.source == "heuristic"
        assert dataclasses.replace(plan.split, cluster=1) == default_kernel(prob, dev)
        space = tune.search_space(prob, dev)  # the tuner's first trial is this plan
        assert tune.plan_from_params(prob, tune._seed_points(prob, dev, space)[0]) == plan
    assert dispatch.select_plan(prob, dev) == plan  # no table (isolated_tuning)


def test_explain_names_the_cluster_merge():
    plan = LaunchPlan.cluster_merge(default_kernel(P8B, SM90), 16)
    with dispatch.forced_plan(plan):
        text = dispatch.explain(P8B, SM90)
    assert "thread-block cluster of its 16 CTAs" in text


def _ptx(cfg, arch):
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs the cuda-bindings NVRTC wheel")
    spec = importlib.util.spec_from_file_location("compare_ptx", ROOT / "scripts" / "compare_ptx.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ptx(Path(registry.kernel_dir()), cfg, arch)


def _cluster_variants():
    out = []
    for dt, kv, page, hq, hkv, d in [("fp16", "", 0, 32, 8, 128), ("bf16", "", 16, 32, 8, 128),
                                     ("fp16", "fp8_e4m3", 0, 32, 8, 128), ("fp16", "int4_g64", 16, 32, 8, 128),
                                     ("fp16", "", 1, 8, 1, 128), ("bf16", "", 0, 8, 8, 64), ("fp16", "", 0, 32, 8, 256)]:
        base = default_kernel(DecodeProblem(1, hq, hkv, d, 4096, dt, kv, page_size=page), SM90)
        out += [dataclasses.replace(base, cluster=c) for c in CLUSTER_SIZES]
    return out


def test_cluster_variants_compile_without_spills():
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs the cuda-bindings NVRTC wheel")
    cfgs = _cluster_variants()
    assert all(c.is_valid(SM90) for c in cfgs)
    reports = registry.compile_offline(cfgs, "sm_90")
    assert set(reports) == {c.key for c in cfgs}
    for r in reports.values():
        assert (r.spill_stores, r.spill_loads, r.stack_bytes, r.static_smem) == (0, 0, 0, 0), r


@pytest.mark.parametrize("c", CLUSTER_SIZES)
def test_ptx_declares_the_cluster_and_merges_through_it(c):
    body = _ptx(_cfg(c), "sm_90")
    assert re.search(rf"\.reqnctapercluster {c}, 1, 1", body)
    assert "mapa.shared::cluster" in body
    # the first barrier whole (states written), the second split: each thread arrives once its remote
    # reads are done (never before one of them) and waits at the end
    bars = re.findall(r"barrier\.cluster\.\S+", body)
    assert bars[:2] == ["barrier.cluster.arrive.release.aligned;", "barrier.cluster.wait.acquire.aligned;"], bars
    assert bars[-1] == "barrier.cluster.wait.acquire;" and 1 <= bars.count("barrier.cluster.arrive.release;") <= 2
    assert body.index("barrier.cluster.arrive.release;") > body.rindex("ld.shared::cluster")
    assert "ld.shared::cluster" in body and "atom." not in body  # no tickets
    plain = _ptx(_cfg(1), "sm_90")
    assert "reqnctapercluster" not in plain and "barrier.cluster" not in plain
