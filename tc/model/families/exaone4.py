"""EXAONE 4.0: OLMo 2's norms (after attention and the MLP, none before) with Qwen3's q and k norms over each head,
and, where config.json sets a sliding window, hybrid attention: the layers layer_types names sliding attend within
the window and rotate q and k, the full-attention layers rotate nothing (NoPE). Without a window every layer
attends to the whole context and rotates (EXAONE 4.0 1.2B)."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, common_fields, hybrid_layers

EXAONE4_WINDOW, EXAONE4_PATTERN = 4096, 4  # Exaone4Config's sliding_window and sliding_window_pattern defaults
EXAONE4_DEFAULTS = {"num_key_value_heads": 32}  # Exaone4Config's where left out (not one KV head per query head)


def parse(data: dict[str, Any]) -> ModelConfig:
    values = common_fields(data, "exaone4", defaults=EXAONE4_DEFAULTS)
    windows, types, window = hybrid_layers(data, values["num_hidden_layers"], EXAONE4_WINDOW, EXAONE4_PATTERN)
    # with a window, only the sliding layers rotate (none, where none slides); without one, every layer does
    rope_layers = tuple(kind == "sliding_attention" for kind in types) if window is not None else ()
    return ModelConfig(**values, qk_norm=True, sandwich_norms=True, pre_norms=False, sliding_windows=windows,
                       rope_layers=rope_layers)
