"""Model presets: attention head shapes and decode-phase linear-layer shapes (per GPU share)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelPreset:
    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int

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
        ModelPreset("llama3-8b", 32, 8, 128, 4096, 14336),
        ModelPreset("llama2-7b", 32, 32, 128, 4096, 11008),
        ModelPreset("llama3-70b", 64, 8, 128, 8192, 28672),
        ModelPreset("mistral-7b", 32, 8, 128, 4096, 14336),
        ModelPreset("qwen2.5-7b", 28, 4, 128, 3584, 18944),
        ModelPreset("llama3.2-3b", 24, 8, 128, 3072, 8192),
    )
}


def get_model(name: str) -> ModelPreset:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}") from None
