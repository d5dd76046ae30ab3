"""Phi-3: Mistral's layer, with q/k/v and gate/up stored fused in the checkpoint (qkv_proj, gate_up_proj)."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, common_fields, require


def parse(data: dict[str, Any]) -> ModelConfig:
    values = common_fields(data, "phi3")
    window = None if data.get("sliding_window") is None else require(data, "sliding_window")
    return ModelConfig(**values, fused_checkpoint=True,
                       sliding_windows=(window,) * values["num_hidden_layers"] if window else ())
