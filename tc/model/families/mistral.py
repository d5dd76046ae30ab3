"""Mistral: Llama with a sliding window on every layer where config.json sets one."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, common_fields, require


def parse(data: dict[str, Any]) -> ModelConfig:
    values = common_fields(data, "mistral")
    # left out, it is transformers' MistralConfig default (4096, Mistral 7B v0.1's); null turns it off (v0.3)
    window = data.get("sliding_window", 4096)
    window = None if window is None else require({"sliding_window": window}, "sliding_window")
    return ModelConfig(**values, sliding_windows=(window,) * values["num_hidden_layers"] if window else ())
