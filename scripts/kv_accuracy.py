"""Attention-output error of each quantized KV format against attention over the fp16 cache.

NumPy only (no GPU, no fdpp kernel): the caches are quantized and dequantized by fdpp.quant's NumPy
path (bit for bit what the GPU kernels store and read), and the attention of both caches is the
float64 reference ``fdpp.reference.attention_reference`` (plain NumPy).

Run from the repository root (about 1 CPU-minute for the defaults; 3 min wall on a busy 2-core machine)::

    PYTHONPATH=. python scripts/kv_accuracy.py --out results/kv_accuracy

Problem: llama3-8b heads (32 q heads, 8 KV heads, head_dim 128), one decode query per request,
B requests of N tokens for each ``--points`` entry B:N (default B = 2 at N = 1k and 4k, B = 1 at
N = 16k). Two kinds of cache (fp16):

- ``gaussian``: K, V and q standard normal.
- ``llm_like``: V standard normal; K standard normal plus, in each KV head, 4 fixed outlier
  channels (of 128) with magnitude x10-x20 and a nonzero mean (as the K of real LLMs has, e.g.
  KIVI, KVQuant); q standard normal with extra weight on those channels (so the scores lean on
  them, as in real models). No real model's K/V is used: no weights can be downloaded here.

Formats: fp8_e4m3 (per-head and per-tensor descales), fp8_e5m2 (per head), int4 with groups of 32,
64, 128; each of those but the per-tensor one also with K rotated (``+ K rot``: K and q multiplied
by ``fdpp.hadamard(D)`` in float32, rounded to fp16, before quantizing / attending; the reference
stays the unrotated fp16 cache). One row is an analysis, not an fdpp format: ``int4 K per-channel
T64 (analysis)``, K quantized as KIVI does (per channel, over groups of 64 tokens: scale and zero
fp16 per (token group, KV head, channel)) and V as ``int4 g64``, simulated here in NumPy. Metrics per (kind, format, B, N): relative L2 error of the output over all requests and
heads, ``||o_q - o_ref||_2 / ||o_ref||_2``, and the max absolute error ``max |o_q - o_ref|``; also
the same for K and V themselves (relative L2 of the dequantized cache) to separate cache error
from its effect on attention; and, of the reference, the spread of the scaled scores (std over
tokens, mean over rows) and the effective number of attended tokens 1 / sum p^2 (mean over rows),
so the peakedness of each data kind is on record.

Writes ``<out>/accuracy.csv`` and ``<out>/accuracy.png``.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import numpy as np

import fdpp
from fdpp.reference import attention_reference

HQ, HKV, D = 32, 8, 128
OUTLIERS = 4
PER_CHANNEL = "int4 K per-channel T64 (analysis)"
TOKEN_GROUP = 64  # PER_CHANNEL's tokens per K scale / zero
#: --data kinds (make_inputs)
DATA_KINDS = ("gaussian", "llm_like")
FORMATS = [  # (label, fmt, scale, group_size, K rotated by fdpp.hadamard)
    ("fp8_e4m3 per_head", "fp8_e4m3", "per_head", 64, False),
    ("fp8_e4m3 per_tensor", "fp8_e4m3", "per_tensor", 64, False),
    ("fp8_e5m2 per_head", "fp8_e5m2", "per_head", 64, False),
    ("int4 g32", "int4", "per_head", 32, False),
    ("int4 g64", "int4", "per_head", 64, False),
    ("int4 g128", "int4", "per_head", 128, False),
    ("fp8_e4m3 per_head + K rot", "fp8_e4m3", "per_head", 64, True),
    ("fp8_e5m2 per_head + K rot", "fp8_e5m2", "per_head", 64, True),
    ("int4 g32 + K rot", "int4", "per_head", 32, True),
    ("int4 g64 + K rot", "int4", "per_head", 64, True),
    ("int4 g128 + K rot", "int4", "per_head", 128, True),
    (PER_CHANNEL, "int4", "per_head", 64, False),
]
COLUMNS = ["data", "format", "fmt", "scale", "group_size", "k_rotation", "batch", "seqlen", "num_q_heads", "num_kv_heads",
           "head_dim", "out_rel_l2", "out_max_abs", "ref_out_max_abs", "k_rel_l2", "v_rel_l2", "ref_score_std",
           "ref_eff_tokens", "seed"]


def make_inputs(kind: str, b: int, n: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """q [B, HQ, D], k, v [B, N, HKV, D] (NHD), fp16."""
    q = rng.standard_normal((b, HQ, D), dtype=np.float32)
    k = rng.standard_normal((b, n, HKV, D), dtype=np.float32)
    v = rng.standard_normal((b, n, HKV, D), dtype=np.float32)
    if kind == "llm_like":
        # per KV head: OUTLIERS channels, magnitude 10-20, mean +-0.5 of it (fixed per head and
        # channel, shared by every request and token)
        ch = np.stack([rng.choice(D, OUTLIERS, replace=False) for _ in range(HKV)])  # [HKV, OUTLIERS]
        mag = rng.uniform(10, 20, (HKV, OUTLIERS)).astype(np.float32)
        mean = 0.5 * mag * rng.choice([-1.0, 1.0], (HKV, OUTLIERS)).astype(np.float32)
        r = HQ // HKV
        for h in range(HKV):
            k[:, :, h, ch[h]] = k[:, :, h, ch[h]] * mag[h] + mean[h]
            # q of the heads reading KV head h lean on its outlier channels (moderately: the scores
            # stay a few units wide, as in trained models)
            q[:, h * r:(h + 1) * r][:, :, ch[h]] += 0.15 * np.sign(mean[h])
    elif kind != "gaussian":
        raise ValueError(f"unknown data kind {kind!r}")
    return q.astype(np.float16), k.astype(np.float16), v.astype(np.float16)


def k_per_channel(k: np.ndarray, tokens: int) -> np.ndarray:
    """K [B, N, Hkv, D] quantized to 4 bits per channel over groups of ``tokens`` tokens (KIVI's
    K), asymmetric with fdpp's int4 rules (scale fp16((max - min) / 15), zero fp16(min), codes
    rint in float32, fp16(n * scale + zero)), returned dequantized. N must be a multiple of
    ``tokens``. NumPy analysis only: fdpp has no such format."""
    b, n, h, d = k.shape
    if n % tokens:
        raise ValueError(f"N = {n} is not a multiple of the token group {tokens}")
    x = k.astype(np.float32).reshape(b, n // tokens, tokens, h, d)
    mx, mn = x.max(2, keepdims=True), x.min(2, keepdims=True)
    scale = ((mx - mn) / np.float32(15)).astype(np.float16)
    scale[scale == 0] = 1
    zero = mn.astype(np.float16)
    codes = np.clip(np.rint((x - zero.astype(np.float32)) / scale.astype(np.float32)), 0, 15)
    deq = (codes.astype(np.float64) * scale.astype(np.float64) + zero.astype(np.float64)).astype(np.float16)
    return deq.astype(np.float32).reshape(b, n, h, d)


def rotated(x: np.ndarray, h: np.ndarray) -> np.ndarray:
    """x @ h in float32, rounded once to fp16 (fdpp.hadamard's recipe)."""
    return (x.astype(np.float32) @ h).astype(np.float16)


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a64 - b64) / np.linalg.norm(b64))


def score_stats(q: np.ndarray, k: np.ndarray) -> tuple[float, float]:
    """(std of the scaled scores over tokens, effective tokens 1 / sum p^2), each a mean over rows."""
    b, hq, d = q.shape
    hkv = k.shape[2]
    kk = k.astype(np.float64).transpose(0, 2, 1, 3)
    s = np.einsum("bhrd,bhnd->bhrn", q.astype(np.float64).reshape(b, hkv, hq // hkv, d), kk) / np.sqrt(d)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return float(s.std(-1).mean()), float((1 / (p**2).sum(-1)).mean())


def run(kinds: list[str], points: list[tuple[int, int]], seed: int, log: bool = True) -> list[dict]:
    rows = []
    for kind in kinds:
        for b, n in points:
            rng = np.random.default_rng([seed, n, b, kinds.index(kind)])
            q, k, v = make_inputs(kind, b, n, rng)
            ref, _ = attention_reference(q, k, v)  # float64 over the fp16 cache
            sstd, eff = score_stats(q, k)
            h = fdpp.hadamard(D)
            qr, kr = rotated(q, h), rotated(k, h)
            for label, fmt, scale, g, rot in FORMATS:
                t0 = time.perf_counter()
                qkv = fdpp.quantize_kv(kr if rot else k, v, fmt, scale=scale, group_size=g)
                dk, dv = fdpp.dequantize_kv(qkv)
                if label == PER_CHANNEL:
                    dk = k_per_channel(k, TOKEN_GROUP)
                out, _ = attention_reference(qr if rot else q, dk, dv)
                if rot:
                    dk = dk @ h.T  # back to K's own basis for its error
                err = np.abs(out - ref)
                rows.append(dict(
                    data=kind, format=label, fmt=fmt, scale=scale if fmt != "int4" else "",
                    group_size=g if fmt == "int4" else "", k_rotation="hadamard" if rot else "", batch=b, seqlen=n, num_q_heads=HQ,
                    num_kv_heads=HKV, head_dim=D, out_rel_l2=f"{rel_l2(out, ref):.4e}",
                    out_max_abs=f"{float(err.max()):.4e}", ref_out_max_abs=f"{float(np.abs(ref).max()):.4e}",
                    k_rel_l2=f"{rel_l2(dk, k):.4e}", v_rel_l2=f"{rel_l2(dv, v):.4e}",
                    ref_score_std=f"{sstd:.3f}", ref_eff_tokens=f"{eff:.1f}", seed=seed))
                if log:
                    r = rows[-1]
                    print(f"{kind:9s} B={b} N={n:6d} {label:20s} out rel L2 {r['out_rel_l2']}  max abs "
                          f"{r['out_max_abs']}  K rel L2 {r['k_rel_l2']}  ({time.perf_counter() - t0:.1f} s)",
                          flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["data"] for r in rows))
    fig, axes = plt.subplots(2, len(kinds), figsize=(6 * len(kinds), 8), squeeze=False)
    for j, kind in enumerate(kinds):
        for i, (metric, title) in enumerate((("out_rel_l2", "relative L2 error"), ("out_max_abs", "max abs error"))):
            ax = axes[i][j]
            for label, *_, rot in FORMATS:
                pts = sorted((int(r["seqlen"]), float(r[metric])) for r in rows
                             if r["data"] == kind and r["format"] == label)
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", ls="--" if rot else "-", label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("N (tokens per request)")
            ax.set_ylabel(title)
            bs = sorted({(int(r["seqlen"]), int(r["batch"])) for r in rows if r["data"] == kind})
            ax.set_title(f"{kind}: output {title} vs fp16 cache\n(B per N: {', '.join(f'{n}: {b}' for n, b in bs)})",
                         fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"Quantized KV caches, llama3-8b heads ({HQ} q / {HKV} KV, D {D}); float64 attention")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/kv_accuracy", help="output directory")
    ap.add_argument("--points", default="2:1024,2:4096,1:16384", help="comma-separated B:N")
    ap.add_argument("--data", default="gaussian,llm_like", help="comma-separated kinds: gaussian, llm_like")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        points = [(int(b), int(n)) for b, n in (p.split(":") for p in a.points.split(","))]
    except ValueError:
        ap.error(f"argument --points: comma-separated B:N pairs of integers, got {a.points!r}")
    if any(b < 1 or n < 1 for b, n in points):
        ap.error(f"argument --points: B and N must be >= 1, got {a.points!r}")
    bad = [n for _, n in points if n % TOKEN_GROUP]
    if bad:  # the per-channel analysis row groups K over TOKEN_GROUP tokens
        ap.error(f"--points: N must be a multiple of {TOKEN_GROUP}, got {bad}")
    kinds = a.data.split(",")
    if not kinds or any(k not in DATA_KINDS for k in kinds):
        ap.error(f"argument --data: comma-separated kinds from {', '.join(DATA_KINDS)}, got {a.data!r}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = run(kinds, points, a.seed)
    with open(out / "accuracy.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    plot(rows, out / "accuracy.png")
    print(f"wrote {out / 'accuracy.csv'} ({len(rows)} rows) and {out / 'accuracy.png'} in "
          f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
