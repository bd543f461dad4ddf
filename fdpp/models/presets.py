"""Model presets: attention head shapes, decode-phase linear-layer shapes (per GPU share) and the
remaining hyperparameters a decode step needs (layers, vocabulary, RoPE theta, RMSNorm epsilon)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelPreset:
    """A model's shapes (whole model; :meth:`heads` / :meth:`linear_shapes` give one GPU's share).

    ``num_layers``, ``vocab``, ``rope_theta`` (RoPE base), ``rms_eps`` (RMSNorm epsilon) and
    ``qkv_bias`` (bias on the q/k/v projections, as in Qwen2) are what a whole decode step
    (:mod:`fdpp.models.llama`) needs beyond the attention and GEMM shapes."""

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    num_layers: int = 32
    vocab: int = 32000
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    qkv_bias: bool = False  # Qwen2-style bias on the q/k/v projections

    def heads(self, tp: int = 1) -> tuple[int, int, int]:
        """(q heads, kv heads, head_dim) held by one GPU under tensor parallelism ``tp``.

        KV heads are replicated when tp exceeds their number (as vLLM does)."""
        if tp < 1 or self.num_q_heads % tp:
            raise ValueError(f"tp must divide num_q_heads={self.num_q_heads}, got {tp}")
        return self.num_q_heads // tp, max(1, self.num_kv_heads // tp), self.head_dim

    def linear_shapes(self, tp: int = 1) -> dict[str, tuple[int, int]]:
        """Decode-phase projections y = x W^T as layer -> (N, K), W being [N, K] (torch Linear)."""
        hq, hkv, d = self.heads(tp)
        return {
            "qkv": ((hq + 2 * hkv) * d, self.hidden),
            "o": (self.hidden, hq * d),
            "gate_up": (2 * self.intermediate // tp, self.hidden),
            "down": (self.hidden, self.intermediate // tp),
        }


MODELS: dict[str, ModelPreset] = {
    m.name: m
    for m in (
        ModelPreset("llama3-8b", 32, 8, 128, 4096, 14336, 32, 128256, 500000.0, 1e-5),
        ModelPreset("llama2-7b", 32, 32, 128, 4096, 11008, 32, 32000, 10000.0, 1e-5),
        ModelPreset("llama3-70b", 64, 8, 128, 8192, 28672, 80, 128256, 500000.0, 1e-5),
        ModelPreset("mistral-7b", 32, 8, 128, 4096, 14336, 32, 32000, 1000000.0, 1e-5),
        ModelPreset("qwen2.5-7b", 28, 4, 128, 3584, 18944, 28, 152064, 1000000.0, 1e-6, qkv_bias=True),
        ModelPreset("llama3.2-3b", 24, 8, 128, 3072, 8192, 28, 128256, 500000.0, 1e-5),
        # a test model: the NumPy path runs it on the CPU in milliseconds
        ModelPreset("tiny", 4, 2, 64, 256, 512, 2, 512, 10000.0, 1e-5),
    )
}


def get_model(name: str) -> ModelPreset:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}") from None
