"""Mistral: Llama with a sliding window on every layer where config.json sets one."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, common_fields, require


def parse(data: dict[str, Any]) -> ModelConfig:
    values = common_fields(data, "mistral")
    window = None if data.get("sliding_window") is None else require(data, "sliding_window")
    return ModelConfig(**values, sliding_windows=(window,) * values["num_hidden_layers"] if window else ())
