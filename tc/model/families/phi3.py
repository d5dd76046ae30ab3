"""Phi-3: Mistral's layer, with q/k/v and gate/up stored fused in the checkpoint (qkv_proj, gate_up_proj)."""
from __future__ import annotations

from typing import Any

from ..config import ConfigError, ModelConfig, common_fields, require


def parse(data: dict[str, Any]) -> ModelConfig:
    values = common_fields(data, "phi3")
    if values["rope"].type != "default":
        # transformers' Phi3Config takes longrope only (and reads "yarn" as longrope): no Phi-3 scales its rotary
        # embedding another way, and transformers refuses the file that says so
        raise ConfigError(f"config.json gives Phi3ForCausalLM rope scaling {values['rope'].type!r}; Phi-3 scales "
                          "its rotary embedding with longrope only, which tc does not compute")
    window = None if data.get("sliding_window") is None else require(data, "sliding_window")
    return ModelConfig(**values, fused_checkpoint=True,
                       sliding_windows=(window,) * values["num_hidden_layers"] if window else ())
