"""Qwen2 / Qwen2.5: biases on q, k and v; no other difference from Llama."""
from __future__ import annotations

from typing import Any

from ..config import ConfigError, ModelConfig, common_fields, flag
from ..rope import DEFAULT_ROPE_THETA


def refuse_sliding_window(data: dict[str, Any], family: str) -> None:
    """Qwen's use_sliding_window slides from max_window_layers on, which no released checkpoint turns on."""
    if flag(data, "use_sliding_window"):
        raise ConfigError(f"config.json sets use_sliding_window = {data['use_sliding_window']!r}; sliding window "
                          f"attention is not implemented for {family} in tc (every layer attends to the whole "
                          "context)")


def parse(data: dict[str, Any], default_theta: float = DEFAULT_ROPE_THETA) -> ModelConfig:
    """`default_theta`: the rotary base where config.json gives none (Qwen2-VL's language model takes its own)."""
    refuse_sliding_window(data, "qwen2")
    return ModelConfig(**common_fields(data, "qwen2", default_theta=default_theta), qkv_bias=True)
