"""Model presets (:mod:`fdpp.models.presets`) and a Llama-family decode step built on fdpp's
public API (:mod:`fdpp.models.llama`, imported on first use: ``fdpp.models.LlamaDecoder``)."""

from __future__ import annotations

from typing import Any

from fdpp.models.presets import MODELS, ModelPreset, get_model

__all__ = ["MODELS", "ModelPreset", "get_model", "LlamaDecoder"]


def __getattr__(name: str) -> Any:  # lazy: fdpp.bench and fdpp.tune import the presets only
    if name == "LlamaDecoder":
        from fdpp.models.llama import LlamaDecoder

        return LlamaDecoder
    raise AttributeError(f"module 'fdpp.models' has no attribute {name!r}")
